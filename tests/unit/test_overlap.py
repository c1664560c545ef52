"""The overlap math of the training loop (peer/train/loop.py ``run_overlapped``), with exact numbers.

The inner steps are replaced by "params <- params / 2", so a round's pseudo-gradient is half of the
parameters it started from, and the outer step is plain subtraction (lr 1, momentum 0): every value
below is exact in fp32. With M0 the initial master:

    synchronous:  M1 = M0 - M0/2 = M0/2, M2 = M0/4, M3 = M0/8
    delayed:      inner steps 0 and 1 both start from M0 (nothing applied yet): d0 = d1 = M0/2
                  boundary 1: apply avg(d0) to M0 -> M1 = M0/2; round 1's averaging (d1) starts, base M1
                  inner steps 2 start from M1: d2 = M0/4
                  boundary 2: apply avg(d1) to M1 -> M2 = M0/2 - M0/2 = 0; round 2's averaging (d2) starts
                  drain:      apply avg(d2) to M2 -> M3 = -M0/4
    eager:        like delayed, but the next inner steps start from the outer step our own delta
                  would take: S1 = M0 - d0 = M0/2, d1 = M0/4; S2 = M1 - d1 = M0/4, d2 = M0/8; so with
                  identical members (the average is our own delta) eager lands exactly where
                  synchronous rounds do: M3 = M0/8
"""

from __future__ import annotations

from typing import Any

import torch

from hivetrain.peer.averaging.api import AverageResult
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.train.data import Corpus
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts

from .conftest import TINY


class Log:
    """An averager of a group of identical members: the average is the delta itself. Logs every
    call in order, with what it saw; ``fail`` rounds raise RoundFailed when their result is awaited."""

    def __init__(self, trainer_ref: list[Trainer], fail: tuple[int, ...] = ()):
        self.events: list[tuple[Any, ...]] = []
        self.ref, self.fail = trainer_ref, fail

    def average(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        return self.begin(round_, base_hash, delta).result()

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> Any:
        outer = self.ref[0].outer
        assert base_hash == outer.hash() and round_ == outer.round  # the base is the master we hold now
        self.events.append(("begin", round_, delta.clone()))
        log, fail = self.events, round_ in self.fail

        class InFlight:
            def result(self) -> AverageResult:
                log.append(("result", round_))
                if fail:
                    raise RoundFailed("test: this round fails")
                return AverageResult(delta.clone(), ("me", "other"), f"{round_:02d}" * 32)

        return InFlight()

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None, population: int = 0) -> None:
        self.events.append(("announce", round_, base_hash is not None))


def make(corpus: Corpus, overlap: str, fail: tuple[int, ...] = ()) -> tuple[Trainer, Log, torch.Tensor]:
    spec = RunSpec(name="t", model=TINY, seq_len=16, batch_size=2, sync_every=2, outer_lr=1.0, outer_momentum=0.0,
                   overlap=overlap, eval_every=1000)
    ref: list[Trainer] = []
    log = Log(ref, fail)
    t = Trainer(TrainerParts(spec, "me", corpus, log, MetricsWriter(None)), eval_batch_count=0, log=lambda _: None)
    ref.append(t)

    def halve() -> tuple[float, float]:
        with torch.no_grad():
            first = next(t.model.parameters()).reshape(-1)[0].item()
            log.events.append(("compute from", first))
            for p in t.model.parameters():
                p.mul_(0.5)
        return 1.0, 1.0

    t.inner_steps = halve  # type: ignore[method-assign]
    return t, log, t.outer.master.clone()


def test_synchronous_rounds_apply_each_average_at_once(corpus: Corpus) -> None:
    t, log, m0 = make(corpus, "none")
    t.run(3)
    assert torch.equal(t.outer.master, m0 / 8) and t.outer.round == 3
    begins = [e for e in log.events if e[0] == "begin"]
    assert [b[1] for b in begins] == [0, 1, 2]
    for b, expected in zip(begins, (m0 / 2, m0 / 4, m0 / 8), strict=True):
        assert torch.equal(b[2], expected)


def test_delayed_rounds_apply_each_average_one_round_late_with_exact_values(corpus: Corpus) -> None:
    t, log, m0 = make(corpus, "delayed")
    x = m0[0].item()
    t.run(3)
    assert t.outer.round == 3
    assert torch.equal(t.outer.master, -m0 / 4)  # M3 = -M0/4 (see the module doc)
    assert all(torch.equal(p.detach().reshape(-1), t.outer.master[: p.numel()]) for p in list(t.model.parameters())[:1])
    kinds = [(e[0], e[1]) if e[0] != "begin" else ("begin", e[1]) for e in log.events]
    # the order on the training thread: inner steps run while the previous round's averaging is in flight
    assert kinds == [
        ("announce", 0), ("compute from", x), ("begin", 0),
        ("announce", 1), ("compute from", x), ("result", 0), ("begin", 1),
        ("announce", 2), ("compute from", x / 2), ("result", 1), ("begin", 2),
        ("result", 2),
    ]
    begins = {e[1]: e[2] for e in log.events if e[0] == "begin"}
    assert torch.equal(begins[0], m0 / 2) and torch.equal(begins[1], m0 / 2) and torch.equal(begins[2], m0 / 4)
    # only the first announcement knows its base: later ones are made before the average in flight lands
    assert [e[2] for e in log.events if e[0] == "announce"] == [True, False, False]


def test_a_void_round_in_flight_applies_nothing_and_the_next_averaging_starts_from_the_kept_master(
        corpus: Corpus) -> None:
    t, log, m0 = make(corpus, "delayed", fail=(1,))
    t.run(3)
    # M1 = M0/2; round 1 void: M2 = M1 (its link is VOID_LINK); inner steps 2 started from M1: d2 = M0/4;
    # M3 = M2 - d2 = M0/4
    assert torch.equal(t.outer.master, m0 / 4) and t.outer.round == 3
    assert t.totals["rounds_void"] == 1 and t.totals["rounds_completed"] == 2


def test_every_round_record_splits_compute_network_and_idle_time(corpus: Corpus, tmp_path: Any) -> None:
    import json

    t, _, _ = make(corpus, "delayed")
    path = tmp_path / "m.jsonl"
    t.parts = TrainerParts(t.spec, "me", corpus, t.parts.averager, MetricsWriter(str(path)))
    t.run(3)
    t.parts.metrics.close()
    rounds = [json.loads(line) for line in path.read_text().splitlines() if '"event": "round"' in line]
    assert [r["round"] for r in rounds] == [0, 1, 2] and [r["drain"] for r in rounds] == [False, False, True]
    for r in rounds:
        assert r["overlap"] == "delayed" and 0.0 <= r["utilization"] <= 1.0
        assert r["round_s"] >= r["compute_s"] and r["idle_s"] >= 0.0


def test_a_nan_loss_in_overlap_shares_nothing_and_voids_its_round(corpus: Corpus) -> None:
    t, log, m0 = make(corpus, "delayed")
    real = t.inner_steps

    def poisoned() -> tuple[float, float]:
        real()
        return (float("nan"), 1.0) if sum(e[0] == "compute from" for e in log.events) == 2 else (1.0, 1.0)

    t.inner_steps = poisoned  # type: ignore[method-assign]
    t.run(3)
    assert [e[1] for e in log.events if e[0] == "begin"] == [0, 2]  # round 1's delta never left
    assert t.totals["rounds_void"] == 1 and t.totals["rounds_completed"] == 2


def test_eager_rounds_start_from_our_own_outer_step_and_match_synchronous_rounds_for_identical_members(
        corpus: Corpus) -> None:
    t, log, m0 = make(corpus, "eager")
    x = m0[0].item()
    t.run(3)
    assert torch.equal(t.outer.master, m0 / 8) and t.outer.round == 3
    assert [e[1] for e in log.events if e[0] == "compute from"] == [x, x / 2, x / 4]
    begins = {e[1]: e[2] for e in log.events if e[0] == "begin"}
    assert torch.equal(begins[0], m0 / 2) and torch.equal(begins[1], m0 / 4) and torch.equal(begins[2], m0 / 8)
