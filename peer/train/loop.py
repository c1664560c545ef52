"""The DiLoCo loop of one peer: H inner steps, pseudo-gradient, group all-reduce, outer step.

Runs on the training thread. Everything network-related goes through the ``Averager`` seam and
the ``heartbeat`` callback; a failed round is void and handled in exactly one place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import torch

from hivetrain.peer.averaging.api import Averager
from hivetrain.peer.averaging.behaviour import HONEST, Behaviour
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.state.heartbeats import attestation_fields
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.train.data import Corpus, ShardSampler, eval_batches, evaluate
from hivetrain.peer.train.diloco import OuterState, copy_params_to_flat, state_hash
from hivetrain.peer.train.model import build_model
from hivetrain.peer.trust import Trust


class StateHooks(Protocol):
    """What the loop asks of the network about state, at round boundaries (training thread)."""

    def catch_up(self, round_: int, state_hash: str) -> tuple[Snapshot, dict[str, Any]] | None:
        """A verified state this peer should move to (the run is ahead or disagrees) and how it was
        obtained, or None to keep ours."""
        ...

    def committed(self, snapshot: Snapshot) -> None:
        """The state at a new round boundary: serve it to joiners, checkpoint it."""
        ...


def ring_allreduce_bytes(numel: int, group_size: int, bytes_per_value: int = 4) -> int:
    """Bytes one member sends in a bandwidth-optimal fp32 all-reduce (what DDP sends per step)."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * numel * bytes_per_value // group_size


class MetricsWriter:
    """Appends one JSON object per line; flushed at once so other processes can follow it."""

    def __init__(self, path: str | None):
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclass(frozen=True)
class TrainerParts:
    """What the loop needs, built by the caller (the CLI) and passed in."""

    spec: RunSpec
    peer_id: str
    corpus: Corpus
    averager: Averager
    metrics: MetricsWriter
    behaviour: Behaviour = HONEST  # faults are injected here (peer/faults.py); the honest peer by default
    state: StateHooks | None = None
    trust: Trust | None = None  # the earned-trust ledger the averager and fork choice read; we record into it


class Trainer:
    def __init__(self, parts: TrainerParts, device: str = "cpu", eval_batch_count: int = 8,
                 log: Callable[[str], None] = print, heartbeat: Callable[..., None] | None = None):
        spec = parts.spec
        self.parts, self.spec, self.device, self.log = parts, spec, torch.device(device), log
        self.heartbeat = heartbeat or (lambda **kw: None)
        self.model = build_model(spec.model, spec.init_seed).to(self.device)
        self.outer = OuterState(self.model, spec.outer_lr, spec.outer_momentum)
        self.inner_opt = torch.optim.AdamW(
            self.model.parameters(), lr=spec.inner_lr, weight_decay=spec.inner_weight_decay, betas=(0.9, 0.95)
        )
        seed = int.from_bytes(hashlib.sha256(parts.peer_id.encode()).digest()[:8], "little")
        self.sampler = ShardSampler(parts.corpus.train, spec.seq_len, spec.batch_size, seed)
        self.eval_set = eval_batches(parts.corpus.heldout, spec.seq_len, spec.batch_size, eval_batch_count)
        self.numel = self.outer.numel
        self.totals = {"bytes_sent": 0, "bytes_received": 0, "inner_steps": 0, "rounds_completed": 0,
                       "rounds_void": 0, "ddp_equivalent_bytes": 0}

    def _eval(self) -> float | None:
        return evaluate(self.model, self.eval_set, self.device) if self.eval_set else None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def inner_steps(self) -> tuple[float, float]:
        """H AdamW steps from the current parameters; returns (mean train loss, tokens per second)."""
        self.model.train()
        total, t0 = 0.0, time.perf_counter()
        for _ in range(self.spec.sync_every):
            x, y = self.sampler.next_batch()
            with self._autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            assert loss is not None
            loss.backward()
            if self.spec.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
            self.inner_opt.step()
            self.inner_opt.zero_grad(set_to_none=True)
            total += float(loss.detach())
        seconds = time.perf_counter() - t0
        tokens = self.spec.sync_every * self.spec.batch_size * self.spec.seq_len
        return total / self.spec.sync_every, tokens / max(seconds, 1e-9)

    def run(self, max_rounds: int) -> dict[str, Any]:
        """Trains until ``max_rounds`` rounds have passed (0: forever); returns the totals."""
        initial = self._eval()
        self.parts.metrics.write({"event": "start", "round": 0, "state_hash": self.outer.hash(),
                                  "eval_loss": initial, "numel": self.numel, "peer_id": self.parts.peer_id})
        self.log(f"start: {self.numel:,} parameters, held-out loss {_fmt(initial)}, state {self.outer.hash()[:12]}")
        self._committed(0.0, None, initial)
        while max_rounds == 0 or self.outer.round < max_rounds:
            self.catch_up()
            if max_rounds and self.outer.round >= max_rounds:
                break
            self.run_round()
        return dict(self.totals, initial_eval_loss=initial)

    def resume(self, snapshot: Snapshot) -> None:
        """Starts from a verified local checkpoint (its lineage included); the first ``catch_up``
        checks it against the run."""
        self.outer.load(snapshot, self.model)
        self.log(f"resumed from checkpoint: round {snapshot.round}, state {snapshot.hash[:12]}")

    def catch_up(self) -> None:
        """At a round boundary: moves to the state fork choice picks (peer/state/choose.py), if any."""
        if self.parts.state is None:
            return
        t0 = time.perf_counter()
        found = self.parts.state.catch_up(self.outer.round, self.outer.hash())
        if found is None:
            return
        snapshot, info = found
        from_round, from_hash = self.outer.round, self.outer.hash()
        self.outer.load(snapshot, self.model)
        eval_loss = self._eval()
        # the hash of what the model now holds, recomputed from its parameters (not the cached snapshot)
        params = copy_params_to_flat(self.model.parameters(), torch.empty(self.numel, dtype=torch.float32))
        loaded_hash = state_hash(self.outer.round, params, self.outer.momentum, self.outer.parent, self.outer.link)
        self.parts.metrics.write({"event": "sync", "round": snapshot.round, "state_hash": loaded_hash,
                                  "from_round": from_round, "from_hash": from_hash, "eval_loss": eval_loss,
                                  "seconds": time.perf_counter() - t0, **info})
        self.log(f"synced to round {snapshot.round}, state {snapshot.hash[:12]}, held-out {_fmt(eval_loss)}")
        self._committed(0.0, None, eval_loss)

    def _committed(self, throughput: float, train_loss: float | None, eval_loss: float | None) -> None:
        snapshot = self.outer.snapshot()
        if self.parts.state is not None:
            self.parts.state.committed(snapshot)
        self.heartbeat(**attestation_fields(snapshot), throughput=throughput, train_loss=train_loss,
                       eval_loss=eval_loss)

    def run_round(self) -> dict[str, Any]:
        """One outer round: H inner steps, the group's all-reduce, the outer step (or a void round)."""
        r, base = self.outer.round, self.outer.hash()
        t0 = time.perf_counter()
        train_loss, tokens_per_s = self.inner_steps()
        delta = self.outer.pseudo_gradient(self.model)
        t1 = time.perf_counter()
        record: dict[str, Any] = {"event": "round", "round": r, "base_hash": base, "inner_steps": self.spec.sync_every,
                                  "train_loss": train_loss if math.isfinite(train_loss) else None,
                                  "tokens_per_s": tokens_per_s, "compute_s": t1 - t0}
        try:
            if not math.isfinite(train_loss):
                self.inner_opt.state.clear()  # its moments are poisoned too: start them afresh
                raise RoundFailed(f"training loss became {train_loss} in round {r}; our pseudo-gradient is not shared")
            result = self.parts.averager.average(r, base, delta)
        except RoundFailed as e:  # the one place a failed round is handled: void, restore, report
            self.outer.void(self.model)
            self.totals["rounds_void"] += 1
            record.update(void=True, why=str(e), group_size=0, group=[], bytes_sent=0, bytes_received=0,
                          excluded=e.excluded)
            self.log(f"round {r}: VOID ({e}); parameters restored")
        else:
            self.outer.apply(result.averaged, self.model, keep=result.void_ranges, link=result.applied)
            if self.parts.trust is not None:  # what fork choice and probation weigh: rounds completed together
                self.parts.trust.record_completed(r, result.group, self.parts.peer_id)
            self.totals["rounds_completed"] += 1
            self.totals["bytes_sent"] += result.bytes_sent
            self.totals["bytes_received"] += result.bytes_received
            self.totals["ddp_equivalent_bytes"] += self.spec.sync_every * ring_allreduce_bytes(
                self.numel, len(result.group))
            record.update(void=False, why=None, group_size=len(result.group), group=list(result.group),
                          bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
                          excluded=result.excluded, void_shards=[list(v) for v in result.void_ranges], **result.stats)
        self.totals["inner_steps"] += self.spec.sync_every
        record["allreduce_s"] = time.perf_counter() - t1
        eval_loss = self._eval()
        state = self.outer.hash()
        record.update(state_hash=state, eval_loss=eval_loss)
        self.parts.metrics.write(record)
        self._committed(tokens_per_s, record["train_loss"], eval_loss)
        if not record["void"]:
            self.log(f"round {r}: train {train_loss:.3f} | held-out {_fmt(eval_loss)} | group {record['group_size']} "
                     f"| sent {record['bytes_sent'] / 1e6:.2f} MB | {record['compute_s']:.1f}s compute "
                     f"{record['allreduce_s']:.1f}s all-reduce | state {state[:12]}")
        self.parts.behaviour.at("after_round", r)
        return record


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
