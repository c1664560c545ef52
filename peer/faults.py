"""Faults and attacks for tests, injected from outside the protocol: ``--fault kill@after_parts:2``.

``FaultPlan.parse`` builds a ``Behaviour`` (peer/averaging/behaviour.py): the protocol asks it what
to send at each point, and this one answers wrongly, or stops the process, at the planned point and
round. Nothing in the protocol code knows about faults. A fault logs one line to the peer's fault
log (when one is set) before it acts, so a test can assert that the fault really happened.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
from dataclasses import dataclass

import torch

from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.reduce import Finding, FindingKind
from hivetrain.peer.errors import ConfigError

POINTS = ("after_matchmaking", "before_parts", "after_parts", "before_results", "before_cross", "after_round", "serve_state",
          "parts", "results")
# kill/stop/exit fire once at POINT:ROUND; the others stand from ROUND on: "corrupt" (a state donor
# serving wrong bytes, at POINT "serve_state"), the part attacks below (at POINT "parts"), "wrongsum"
# (a reducer that sends a wrong aggregate, at POINT "results") and "accuse" (an auditor that calls
# every shard it audits a wrong aggregate, at POINT "results")
ATTACKS = ("nan", "huge", "flip", "const", "scale", "shortlen")
ACTIONS = ("kill", "stop", "exit", "corrupt", "wrongsum", "accuse", *ATTACKS)


@dataclass
class FaultPlan(Behaviour):
    action: str | None = None
    point: str | None = None
    round: int = -1
    log_path: str | None = None
    fired: bool = False

    @classmethod
    def parse(cls, text: str | None, log_path: str | None = None) -> FaultPlan:
        """Parses ``ACTION@POINT:ROUND``; raises ConfigError with the accepted values."""
        if not text:
            return cls(log_path=log_path)
        try:
            action, rest = text.split("@", 1)
            point, round_ = rest.rsplit(":", 1)
            plan = cls(action, point, int(round_), log_path)
        except ValueError:
            raise ConfigError(f"--fault {text!r} must look like ACTION@POINT:ROUND, e.g. kill@after_parts:2") from None
        if action not in ACTIONS or point not in POINTS or plan.round < 0:
            raise ConfigError(f"--fault: ACTION in {ACTIONS}, POINT in {POINTS}, ROUND >= 0; got {text!r}")
        return plan

    def active(self, point: str, round_: int) -> bool:
        """For standing faults (``corrupt@serve_state:R``): true from round R on; logged once."""
        if self.action is None or self.point != point or round_ < self.round:
            return False
        if not self.fired:
            self.fired = True
            self._log(f"{self.action}@{point}:{round_}")
        return True

    def _log(self, line: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{line} pid={os.getpid()}\n")
                f.flush()
                os.fsync(f.fileno())

    # ---- Behaviour ------------------------------------------------------------------------------

    def at(self, point: str, round_: int) -> None:
        if self.fired or self.action not in ("kill", "stop", "exit") or (point, round_) != (self.point, self.round):
            return
        self.fired = True
        self._log(f"{self.action}@{point}:{round_}")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            sys.exit(3)

    def parts(self, round_: int, parts: list[bytes], delta: torch.Tensor, bounds: list[tuple[int, int]],
              codec: Codec) -> list[bytes]:
        if self.action not in ATTACKS or not self.active("parts", round_):
            return parts
        return [attack_part(self.action, part, delta[a:b], codec) for part, (a, b) in zip(parts, bounds, strict=True)]

    def served_piece(self, round_: int, index: int, body: bytes) -> bytes:
        if self.action != "corrupt" or not self.active("serve_state", round_):
            return body
        return bytes(b ^ 0x5A for b in body[:64]) + body[64:]  # a poisoned donor

    def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int, codec: Codec) -> bytes:
        if self.action != "wrongsum" or not self.active("results", round_):
            return result
        return attack_result(result, numel, codec)

    def finding(self, round_: int, shard: int, finding: Finding | None) -> Finding | None:
        if self.action != "accuse" or not self.active("results", round_):
            return finding
        return Finding(FindingKind.WRONG_AGGREGATE, "(fault injection) a false accusation")


def attack_part(action: str, honest: bytes, delta: torch.Tensor, codec: Codec) -> bytes:
    """What a Byzantine member sends instead of ``honest`` (its encoded slice ``delta``)."""
    if action == "huge":
        return bytes(codec.encode(delta * 1e6))
    if action == "flip":
        return bytes(codec.encode(delta * -1000.0))
    if action == "const":
        norm = float(torch.linalg.vector_norm(delta))
        return bytes(codec.encode(torch.full_like(delta, 10.0 * norm / max(1, delta.numel()) ** 0.5)))
    if action == "nan":
        return struct.pack("<f", float("nan")) + honest[4:]
    if action == "scale":
        return struct.pack("<f", 1e30) + honest[4:]
    if action == "shortlen":
        return honest[:-1]
    raise ValueError(f"not an attack: {action}")


def attack_result(honest: bytes, numel: int, codec: Codec) -> bytes:
    """What a cheating reducer sends instead of its result: the aggregate shifted by its largest
    magnitude (about 127 quantization steps)."""
    x = codec.decode(honest, numel)  # (numel,) fp32
    spread = float(x.abs().max()) or 1.0
    return bytes(codec.encode(x - spread))
