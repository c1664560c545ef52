"""The training loop's one place for a failed round (peer/train/loop.py): a NaN loss voids the round
(nothing is shared, the parameters are restored, training goes on); a completed round is applied
with its lineage and recorded in the trust ledger."""

from __future__ import annotations

import math

import torch

from hivetrain.peer.averaging.api import AverageResult, Finished, begin_now
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.train.data import Corpus
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts
from hivetrain.peer.trust import Trust

from .conftest import TINY


class Recorder:
    """An averager that records its calls and averages with a fixed partner (or fails)."""

    def __init__(self, fail: bool = False):
        self.calls: list[int] = []
        self.announced: list[int] = []
        self.fail = fail

    def average(self, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        self.calls.append(round_)
        if self.fail:
            raise RoundFailed("no group")
        return AverageResult(delta.clone(), ("me", "partner"), "cd" * 32)

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor) -> Finished:
        return begin_now(self, round_, base_hash, delta)

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None) -> None:
        self.announced.append(round_)


def trainer(corpus: Corpus, averager: Recorder, trust: Trust | None = None) -> Trainer:
    spec = RunSpec(name="t", model=TINY, seq_len=16, batch_size=2, sync_every=2)
    return Trainer(TrainerParts(spec, "me", corpus, averager, MetricsWriter(None), trust=trust), eval_batch_count=1,
                   log=lambda _: None)


def test_a_nan_loss_voids_the_round_without_sharing_and_training_goes_on(corpus: Corpus) -> None:
    averager = Recorder()
    t = trainer(corpus, averager)
    master = t.outer.master.clone()
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))  # the inner steps now produce a NaN loss
    record = t.run_round()
    assert record["void"] and "training loss became nan" in record["why"]
    assert averager.calls == []  # our pseudo-gradient was never shared
    assert torch.equal(t.outer.master, master) and t.outer.round == 1
    assert all(torch.isfinite(p).all() for p in t.model.parameters())  # restored from the master
    assert not t.inner_opt.state  # poisoned AdamW moments dropped
    record = t.run_round()  # and the next round trains normally
    assert not record["void"] and math.isfinite(record["train_loss"]) and averager.calls == [1]


def test_a_completed_round_is_applied_with_its_lineage_and_earns_trust(corpus: Corpus) -> None:
    trust = Trust()
    t = trainer(corpus, Recorder(), trust)
    parent = t.outer.hash()
    record = t.run_round()
    assert not record["void"]
    assert t.outer.parent == parent and t.outer.link == "cd" * 32
    assert trust.weight("partner", 1) > 0 and trust.weight("stranger", 1) == 0


def test_a_failed_round_is_void_and_records_nothing(corpus: Corpus) -> None:
    trust = Trust()
    t = trainer(corpus, Recorder(fail=True), trust)
    before = t.outer.master.clone()
    record = t.run_round()
    assert record["void"] and record["why"] == "no group"
    assert torch.equal(t.outer.master, before) and len(trust) == 0
