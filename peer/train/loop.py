"""The DiLoCo loop of one peer: H inner steps, pseudo-gradient, group all-reduce, outer step.

Runs on the training thread. The objective is a ``Learner`` (peer/train/learner.py: a language
model for a real peer, a quadratic in the simulator); everything network-related goes through the
``Averager`` seam, the ``StateHooks`` and the ``heartbeat`` callback; a failed round is void and
handled in exactly one place. Time is read through dht/clock.py (virtual in the simulator).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import torch
from torch import nn

from hivetrain.dht import clock
from hivetrain.peer.averaging.api import Averager, Finished, Pending, begin_now
from hivetrain.peer.averaging.averager import MAX_AWAITED
from hivetrain.peer.averaging.behaviour import HONEST, Behaviour
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed, StateMismatch
from hivetrain.peer.state.heartbeats import attestation_fields
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.train.data import Corpus
from hivetrain.peer.train.diloco import OuterState, copy_flat_to_params, copy_params_to_flat, state_hash
from hivetrain.peer.train.learner import Learner, LMLearner
from hivetrain.peer.trust import Trust


class StateHooks(Protocol):
    """What the loop asks of the network about state, at round boundaries (training thread)."""

    def catch_up(self, round_: int, state_hash: str, announce: bool = False, held: bool = True,
                 partners: Collection[str] = ()) -> tuple[Snapshot, dict[str, Any]] | None:
        """A verified state this peer should move to (the run is ahead or disagrees) and how it was
        obtained, or None to keep ours. ``announce``: we will train the round we move to, so tell
        the run before downloading (the others wait for us within their grace). ``held``: False
        while our state is not one of the run's (no weights of its start): ours then gets no vote.
        ``partners``: the group whose round made our state; only they may not have published it yet."""
        ...

    def committed(self, snapshot: Snapshot) -> None:
        """The state at a new round boundary: serve it to joiners, checkpoint it."""
        ...

    def wait_for_next(self, round_: int, attesters: list[str], timeout: float) -> bool:
        """After a joiner's sync: waits until the peers it synced from move past ``round_``."""
        ...

    def wait_for_end(self, round_: int, peers: tuple[str, ...], until: float) -> list[str]:
        """After a round we voided or trained alone: waits until each of ``peers`` announces a
        state past ``round_`` (how the round ended for it), at most until ``until``
        (``clock.now()``); returns those that did not."""
        ...

    def peers_seen(self) -> int | None:
        """Peers whose heartbeats the last look at the run found (None: not looked yet)."""
        ...


def ring_allreduce_bytes(numel: int, group_size: int, bytes_per_value: int = 4) -> int:
    """Bytes one member sends in a bandwidth-optimal fp32 all-reduce (what DDP sends per step)."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * numel * bytes_per_value // group_size


class MetricsWriter:
    """Appends one JSON object per line; flushed at once so other processes can follow it."""

    def __init__(self, path: str | None, keep: int = 2000):
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._history: deque[dict[str, Any]] = deque(maxlen=keep)  # the latest records (the dashboard's)
        self._lock = threading.Lock()  # the dashboard reads them from its own threads

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._history)

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Began(Protocol):
    """Where a peer notes, before it averages, the round and base state it averages: it outlives
    the process (peer/state/checkpoint.py ``BeganFile``)."""

    def marked(self) -> set[tuple[int, str]]:
        """The (round, base) pairs noted last (a few: overlapped rounds)."""
        ...

    def mark(self, round_: int, base: str) -> None: ...


@dataclass(frozen=True)
class TrainerParts:
    """What the loop needs, built by the caller (peer/assembly.py, or a test) and passed in."""

    spec: RunSpec
    peer_id: str
    corpus: Corpus | None  # the data of the default learner (unused when ``learner`` is given)
    averager: Averager
    metrics: MetricsWriter
    behaviour: Behaviour = HONEST  # faults are injected here (peer/faults.py); the honest peer by default
    state: StateHooks | None = None
    trust: Trust | None = None  # the earned-trust ledger the averager and fork choice read; we record into it
    model: nn.Module | None = None  # a Hugging Face model (peer/train/hf.py); None: build the spec's built-in model
    learner: Learner | None = None  # the objective; None: a language model on ``corpus`` (LMLearner)
    pause: Callable[[float], None] = time.sleep  # how the training thread waits (the simulator's takes virtual time)
    began: Began | None = None  # notes the rounds we begin averaging (None: nothing noted, restarts not guarded)


class Trainer:
    def __init__(self, parts: TrainerParts, device: str = "cpu", eval_batch_count: int = 8,
                 log: Callable[[str], None] = print, heartbeat: Callable[..., None] | None = None,
                 micro_batch: int = 0, checkpointing: bool = False, compile: bool = False):
        spec = parts.spec
        self.parts, self.spec, self.log = parts, spec, log
        # (round, base) pairs whose averaging we began before a restart
        self._began_before = parts.began.marked() if parts.began is not None else set()
        self.heartbeat = heartbeat or (lambda **kw: None)
        if parts.learner is not None:
            self.learner: Learner = parts.learner
        else:
            if parts.corpus is None:
                raise ValueError("a Trainer needs a corpus or a learner")
            self.learner = LMLearner(spec, parts.peer_id, parts.corpus, parts.model, device, eval_batch_count,
                                     micro_batch, checkpointing, compile)
        self.model = self.learner.model
        self.outer = OuterState(self.model, spec.outer_lr, spec.outer_momentum, spec.outer_nesterov)
        self.numel = self.outer.numel
        # a run that names its start (a Hugging Face model): weights that are not it (none, or another copy)
        # hold no state of the run, which then comes by sync first (take_run_state)
        self.held = not spec.init_hash or self.outer.hash() == spec.init_hash
        self.max_rounds = 0  # the run's round this process stops at (0: never); set by ``run``
        self._mark = clock.now()  # when the previous round record was written (or training started)
        self._cpu_mark = time.process_time()  # the process's CPU time then
        self._computed = 0.0  # seconds of inner steps since the previous round record
        self._compute_estimate = 0.0  # how long the last inner steps took: the ETA we announce
        self._joined = False  # a joiner waits once, after its first sync, for the run's next boundary
        # (round, peers, until): the peers that may end the round we just ended without us (see catch_up)
        self._awaiting: tuple[int, tuple[str, ...], float] = (-1, (), 0.0)
        self._made_with: tuple[str, tuple[str, ...]] = ("", ())  # (state hash, the group whose round made it)
        self.progress: Callable[..., None] = lambda **fields: None  # the console's live line (peer/progress.py)
        self._boundary_wait = 2 * spec.matchmaking_timeout + spec.allreduce_timeout + 60.0  # seconds, at most
        self.totals = {"bytes_sent": 0, "bytes_received": 0, "inner_steps": 0, "rounds_completed": 0,
                       "rounds_void": 0, "ddp_equivalent_bytes": 0}

    def _eval(self) -> float | None:
        return self.learner.evaluate()

    def inner_steps(self) -> tuple[float, float]:
        """H inner steps from the current parameters; returns (mean train loss, tokens per second)."""
        first = self.outer.round * self.spec.sync_every  # the run's inner step (peer/train/schedule.py)
        return self.learner.inner_steps(first, self.progress)

    def run(self, max_rounds: int, until_round: int = 0) -> dict[str, Any]:
        """Trains ``max_rounds`` rounds (0: no limit), counted from the round this process starts
        training (a joiner's first sync included), and stops at the run's round ``until_round`` (0:
        no limit), whichever comes first; returns the totals."""
        self.max_rounds = until_round
        if not self.held:
            self.take_run_state()
        initial = self._eval()
        self.parts.metrics.write({"event": "start", "round": 0, "state_hash": self.outer.hash(),
                                  "eval_loss": initial, "numel": self.numel, "peer_id": self.parts.peer_id,
                                  "overlap": self.spec.overlap})
        self.log(f"start: {self.numel:,} parameters, held-out loss {_fmt(initial)}, state {self.outer.hash()[:12]}"
                 + (", rounds overlapped (all-reduce during the next round's inner steps)"
                    if self.spec.overlap != "none" else ""))
        self._committed(0.0, None, initial)
        self._mark, self._cpu_mark = clock.now(), time.process_time()
        if self.spec.overlap != "none":
            self.run_overlapped(max_rounds)
        else:
            self.catch_up()
            self._stop_after(max_rounds)
            while not (self.max_rounds and self.outer.round >= self.max_rounds):
                self.run_round()
                self.catch_up()
        return dict(self.totals, initial_eval_loss=initial)

    def _stop_after(self, rounds: int) -> None:
        """Where this process starts training is known (after its first fork choice): ``rounds`` from
        there is the round to stop at (``max_rounds``, the run's round number), if sooner."""
        if rounds:
            stop = self.outer.round + rounds
            self.max_rounds = min(self.max_rounds, stop) if self.max_rounds else stop

    def take_run_state(self) -> None:
        """Without the weights of the run's start we hold no state of the run: take one from its
        peers (fork choice as a joiner, our own state without a vote) before training."""
        if self.parts.state is None:
            raise StateMismatch("this peer has no weights of the run's start and no peers to take them from")
        deadline = clock.now() + self._boundary_wait  # (a catch_up's reads and download count too)
        self.log(f"our weights are not the run's start ({self.spec.init_hash[:12]}): taking the run's state from its "
                 "peers first")
        while True:
            self.catch_up()
            if self.held:
                return
            if clock.now() >= deadline:
                raise StateMismatch(f"no peer of the run served its state within {self._boundary_wait:.0f} s; start "
                                    "a peer that has the run's initial weights (the same --model folder with its "
                                    "*.safetensors)")
            self.parts.pause(2.0)

    def resume(self, snapshot: Snapshot) -> None:
        """Starts from a verified local checkpoint (its lineage included); the first ``catch_up``
        checks it against the run."""
        self.held = True
        self.outer.load(snapshot, self.model)
        self.log(f"resumed from checkpoint: round {snapshot.round}, state {snapshot.hash[:12]}")

    def catch_up(self) -> None:
        """At a round boundary: moves to the state fork choice picks (peer/state/choose.py), if any."""
        if self.parts.state is None:
            return
        r, peers, until = self._awaiting
        self._awaiting = (-1, (), 0.0)
        self.progress(phase="checking the run's state", round=self.outer.round)
        if peers and until > clock.now():
            self.progress(phase="waiting for the round's outcome")
            # tell them we are coming to the next round (base not known yet): their matchmaking waits for
            # us a while, else in short rounds they decide it before our wait ends; our announcement with
            # the base we choose, below, replaces this one (it expires later)
            if self.spec.overlap == "none" and not (self.max_rounds and self.outer.round >= self.max_rounds):
                self._announce(self.outer.round, None)
            # we voided or went alone while these peers may be completing the round without us: choosing
            # before they publish how it ended, we would train the next round on a lineage they left
            self.log(f"round {r}: waiting up to {until - clock.now():.0f} s for {len(peers)} peer(s) of the round "
                     "to say how it ended for them, before choosing our state")
            missing = self.parts.state.wait_for_end(r, peers, until)
            if missing:
                self.log(f"round {r}: {len(missing)} of them did not say: {', '.join(p[:16] for p in missing)}")
        t0 = clock.now()
        # a joiner's first sync lands inside the others' round, which it will not train (it waits for
        # their next boundary, below): it announces nothing; any later sync it does announce
        trusted = self.parts.trust is not None and self.parts.trust.has_history(self.outer.round)
        mine = self.outer.hash()
        partners = self._made_with[1] if self._made_with[0] == mine else ()
        found = self.parts.state.catch_up(self.outer.round, mine, announce=self._joined or trusted,
                                          held=self.held, partners=partners)
        self.progress(peers=self.parts.state.peers_seen())
        if found is None:
            return
        snapshot, info = found
        if snapshot.round == 0 and self.spec.init_hash and snapshot.hash != self.spec.init_hash:
            self.log(f"refused state {snapshot.hash[:12]}: a round-0 state that is not the run's start "
                     f"({self.spec.init_hash[:12]})")
            return
        self.held = True
        from_round, from_hash = self.outer.round, self.outer.hash()
        self.outer.load(snapshot, self.model)
        eval_loss = self._eval() if self._eval_due() else None  # not on every sync: the others are waiting
        # the hash of what the model now holds, recomputed from its parameters (not the cached snapshot)
        params = copy_params_to_flat(self.model.parameters(), torch.empty(self.numel, dtype=torch.float32))
        loaded_hash = state_hash(self.outer.round, params, self.outer.momentum, self.outer.parent, self.outer.link,
                                 self.outer.population)
        self.parts.metrics.write({"event": "sync", "round": snapshot.round, "state_hash": loaded_hash,
                                  "from_round": from_round, "from_hash": from_hash, "eval_loss": eval_loss,
                                  "seconds": clock.now() - t0, **info})
        self.log(f"synced to round {snapshot.round}, state {snapshot.hash[:12]}, held-out {_fmt(eval_loss)}")
        self._committed(0.0, None, eval_loss)
        if info.get("joiner") and not self._joined:
            self._joined = True
            if snapshot.round == 0:  # the run's start (we had no weights of it): the others may not have begun
                return
            # a joiner's first sync lands somewhere inside the others' round: start with them at the next one
            self.log("waiting for the run's next round boundary, to start it together with the others")
            if self.parts.state.wait_for_next(snapshot.round, info.get("attesters", []), self._boundary_wait):
                self.catch_up()

    def _committed(self, throughput: float, train_loss: float | None, eval_loss: float | None) -> None:
        if not self.held:  # not a state of the run: nothing to serve or attest
            return
        snapshot = self.outer.snapshot()
        if self.parts.state is not None:
            self.parts.state.committed(snapshot)
        self.heartbeat(**attestation_fields(snapshot), throughput=throughput, train_loss=train_loss,
                       eval_loss=eval_loss)

    def run_round(self) -> dict[str, Any]:
        """One synchronous round: H inner steps, the group's all-reduce, the outer step (or a void round)."""
        r, base = self.outer.round, self.outer.hash()
        self._announce(r, base)
        record, delta = self._compute(r, base, self.outer.pseudo_gradient)
        t1 = clock.now()
        return self._finish(record, self._share(record, delta, begin=False), t1)

    def run_overlapped(self, max_rounds: int) -> None:
        """Rounds whose outer step is applied one round late (``spec.overlap``: "delayed", DiLoCoX;
        "eager", Kale et al. 2025), so that each all-reduce runs during the next inner steps.

        At each boundary: the inner steps that just ended give delta (against the parameters they
        started from); the averaging in flight (round r, base M_r) is awaited and applied, M_r ->
        M_r+1; fork choice may move us; the new delta's averaging starts in the background with base
        M_r+1, and the next inner steps start, while it runs, from M_r+1 (delayed) or from the outer
        step our own delta would take from M_r+1 (eager: it stands in for the group's average). So
        a delta computed from round r-1's start is applied to M_r: every member of a group holds the
        same base and applies the same average, hence ends bit-identical, as in synchronous rounds;
        where the next inner steps start is each peer's own business. A void round applies nothing
        (M_r+1 = M_r). A joiner syncs at a boundary and averages its first delta with that base."""
        self.catch_up()
        self._stop_after(max_rounds)
        pending: tuple[dict[str, Any], Pending] | None = None
        spare = [torch.empty(self.numel, dtype=torch.float32) for _ in range(2)]  # delta in flight / delta being made
        start = self.outer.master.clone()  # where the inner steps being run started
        while True:
            upcoming = self.outer.round + (1 if pending else 0)  # the round the coming inner steps are averaged in
            computing = not (self.max_rounds and upcoming >= self.max_rounds)
            if computing:
                self._announce(upcoming, None if pending else self.outer.hash())
                out = spare[upcoming % 2]

                def make_delta(model: nn.Module, out: torch.Tensor = out) -> torch.Tensor:
                    return self.outer.pseudo_gradient(model, out=out, start=start)

                record, delta = self._compute(upcoming, "", make_delta)
            if pending is not None:
                t1 = clock.now()
                done, inflight = pending
                self._finish(done, inflight, t1, drain=not computing)
            if not computing:
                return
            self.catch_up()
            record.update(round=self.outer.round, base_hash=self.outer.hash())
            if self.spec.overlap == "eager" and record["train_loss"] is not None:
                self.outer.lookahead(delta, out=start)
            else:
                start.copy_(self.outer.master)
            copy_flat_to_params(start, self.model.parameters())  # the next inner steps start here
            pending = (record, self._share(record, delta, begin=True))

    def _announce(self, round_: int, base: str | None) -> None:
        eta = self._compute_estimate
        self.parts.averager.announce(round_, base, eta * 1.05 + 0.2 if eta else None, self.outer.population)

    def _compute(self, r: int, base: str, make_delta: Callable[[nn.Module], torch.Tensor]
                 ) -> tuple[dict[str, Any], torch.Tensor]:
        t0 = clock.now()
        train_loss, tokens_per_s = self.inner_steps()
        delta = make_delta(self.model)
        seconds = clock.now() - t0
        self._compute_estimate = seconds
        self._computed += seconds
        self.totals["inner_steps"] += self.spec.sync_every
        record: dict[str, Any] = {"event": "round", "round": r, "base_hash": base, "inner_steps": self.spec.sync_every,
                                  "train_loss": train_loss if math.isfinite(train_loss) else None,
                                  "tokens_per_s": tokens_per_s, "delta_compute_s": seconds,
                                  "mfu": self.learner.mfu(tokens_per_s)}
        if not math.isfinite(train_loss):
            record["why"] = f"training loss became {train_loss} in round {r}; our pseudo-gradient is not shared"
        return record, delta

    def _share(self, record: dict[str, Any], delta: torch.Tensor, begin: bool) -> Pending:
        """Averages ``delta`` (``begin``: in the background), or voids at once a round whose loss went bad."""
        r, base = record["round"], record["base_hash"]
        if record["train_loss"] is None:
            self.learner.reset()  # its moments are poisoned too: start them afresh
            return Finished(RoundFailed(record["why"]))
        began = self.parts.began
        if began is not None:
            if (r, base) in self._began_before:  # we crashed inside this round's averaging and restarted
                # (kept: fork choice can bring us back to this very state while the others still end the
                # round, and a joiner's count of prefixes did, seconds later: we began it again, and every
                # reducer that held our first parts banned us for two different ones; search seed 3,000,982)
                # the group we were in may still be ending the round (at its deadline, without our
                # results): fork choice waits for the peers we trust to say how it ended, so that we
                # start the next round with them rather than alone and ahead of them
                trusted = sorted(self.parts.trust.trusted(r)) if self.parts.trust is not None else []
                return Finished(RoundFailed(
                    f"we began averaging round {r} from this state before a restart: parts recomputed since "
                    "could contradict those sent (the others would take it for equivocation)",
                    awaiting=tuple(trusted[:MAX_AWAITED]),
                    awaiting_until=clock.now() + self.spec.allreduce_timeout + self.spec.matchmaking_timeout))
            began.mark(r, base)
        population = self.outer.population  # (the outer state is at the round's base here)
        if begin:
            return self.parts.averager.begin(r, base, delta, population)
        return begin_now(self.parts.averager, r, base, delta, population)

    def _finish(self, record: dict[str, Any], pending: Pending, t1: float, drain: bool = False) -> dict[str, Any]:
        """The one place a round ends: waits for its averaging, applies it or voids the round
        (restore, report), then records, evaluates, commits and prints."""
        r = record["round"]
        self.progress(phase="averaging", round=r)
        try:
            result = pending.result()
        except RoundFailed as e:  # the one place a failed round is handled: void, restore, report
            self._awaiting = (r, e.awaiting, e.awaiting_until)
            self.outer.void(self.model)
            self.totals["rounds_void"] += 1
            record.update(void=True, why=str(e), group_size=0, group=[], bytes_sent=0, bytes_received=0,
                          excluded=e.excluded)
            self.log(f"round {r}: VOID ({e}); parameters restored")
        else:
            self._awaiting = (r, result.awaiting, result.awaiting_until)
            self.outer.apply(result.averaged, self.model, keep=result.void_ranges, link=result.applied,
                             population=result.population)
            if self.parts.trust is not None:  # what fork choice and probation weigh: rounds completed together
                self.parts.trust.record_completed(r, (*result.group, *result.companions), self.parts.peer_id)
            self.totals["rounds_completed"] += 1
            self.totals["bytes_sent"] += result.bytes_sent
            self.totals["bytes_received"] += result.bytes_received
            self.totals["ddp_equivalent_bytes"] += self.spec.sync_every * ring_allreduce_bytes(
                self.numel, len(result.group))
            record.update(void=False, why=None, group_size=len(result.group), group=list(result.group),
                          bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
                          excluded=result.excluded, void_shards=[list(v) for v in result.void_ranges], **result.stats)
        now = clock.now()
        record.setdefault("matchmaking_s", None)
        record.setdefault("allreduce_s", None)
        record["idle_s"] = now - t1  # the training thread waited for the network (and the outer step)
        record["compute_s"], self._computed = self._computed, 0.0  # inner steps since the previous record
        record["round_s"] = now - self._mark
        cpu = time.process_time()  # the whole process: inner steps, encoding, reducing, auditing, the DHT
        record["cpu_s"], self._cpu_mark = cpu - self._cpu_mark, cpu
        record["utilization"] = record["compute_s"] / max(record["round_s"], 1e-9)
        record["overlap"] = self.spec.overlap
        record["drain"] = drain
        self._mark = now
        eval_loss = self._eval() if self._eval_due() else None
        state = self.outer.hash()
        self._made_with = (state, tuple(record["group"]) if record["group_size"] > 1 else ())
        record.update(state_hash=state, eval_loss=eval_loss, eval_s=clock.now() - now)
        self.parts.metrics.write(record)
        self._committed(record["tokens_per_s"], record["train_loss"], eval_loss)
        self.progress(group=record["group_size"], tokens_per_s=record["tokens_per_s"], loss=record["train_loss"])
        if not record["void"]:
            self._say_round(record)
        self.parts.behaviour.at("after_round", r)
        self._mark += record["eval_s"]  # evaluation is not network time: the next round's wall clock starts after it
        return record

    def _eval_due(self) -> bool:
        r = self.outer.round
        return r % self.spec.eval_every == 0 or (self.max_rounds > 0 and r >= self.max_rounds)

    def _say_round(self, record: dict[str, Any]) -> None:
        r, n = record["round"], record["group_size"]
        net = (f"matchmaking {record['matchmaking_s']:.1f}s, all-reduce {record['allreduce_s']:.1f}s"
               if record.get("matchmaking_s") is not None else "no network")
        overlapped = " (overlapped)" if self.spec.overlap != "none" else ""
        eval_part = f" | held-out {record['eval_loss']:.3f}" if record["eval_loss"] is not None else ""
        rate = f" | {record['tokens_per_s']:,.0f} tok/s" + (f", MFU {record['mfu']:.0%}" if record.get("mfu") else "")
        groups = int(record.get("groups") or 1)
        alone = n == 1 and groups <= 1
        across = f" of {groups} groups, {int(record.get('round_members') or n)} peers" if groups > 1 else ""
        self.log(f"round {r}: train {_fmt(record['train_loss'])}{eval_part}{rate} | group {n}{across}"
                 f"{' (ALONE)' if alone else ''} "
                 f"| sent {record['bytes_sent'] / 1e6:.2f} MB | compute {record['compute_s']:.1f}s, {net}{overlapped}, "
                 f"idle {record['idle_s']:.1f}s | utilization {record['utilization']:.0%} | state {record['state_hash'][:12]}")
        others = int(record.get("others_seen") or 0)
        if alone and others:
            self.log(f"warning: round {r} trained alone while {others} other peer(s) of the run were at another "
                     "state or left the group; we move to the run's state at the next boundary if it is ahead")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
