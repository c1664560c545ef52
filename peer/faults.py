"""Fault injection for tests, addressed by point and round: ``--fault kill@after_parts:2``.

A fault fires at most once. Before acting it appends one line to the peer's fault log (when
one is set), so a test can assert that the fault really happened rather than guess.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from hivetrain.peer.errors import ConfigError

POINTS = ("after_matchmaking", "before_parts", "after_parts", "before_results", "after_round", "serve_state",
          "parts", "results")
# kill/stop/exit fire once at POINT:ROUND; the others stand from ROUND on: "corrupt" (a state donor
# serving wrong bytes), the Byzantine part attacks below (at POINT "parts") and "wrongsum" (a reducer
# that sends a wrong aggregate with honest commitments, at POINT "results"), "accuse" (an auditor that
# calls every shard it audits a wrong aggregate, at POINT "results") and "replay" (a member that
# sends its previous round's part messages verbatim instead of this round's, at POINT "parts")
ATTACKS = ("nan", "huge", "flip", "const", "scale", "shortlen")
ACTIONS = ("kill", "stop", "exit", "corrupt", "wrongsum", "accuse", "replay", *ATTACKS)


@dataclass
class FaultPlan:
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

    def fire(self, point: str, round_: int) -> None:
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


def attack_part(action: str, honest: bytes, delta: Any, codec: Any) -> bytes:
    """What a Byzantine member sends instead of ``honest`` (its encoded slice ``delta``)."""
    import struct

    import torch

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


def attack_result(honest: bytes, numel: int, codec: Any) -> bytes:
    """What a cheating reducer sends instead of its result: the aggregate pushed 50 steps off."""
    x = codec.decode(honest, numel)  # (numel,) fp32
    spread = float(x.abs().max()) or 1.0
    return bytes(codec.encode(x - spread))
