"""The training loop's one place for a failed round (peer/train/loop.py): a NaN loss voids the round
(nothing is shared, the parameters are restored, training goes on); a completed round is applied
with its lineage and recorded in the trust ledger."""

from __future__ import annotations

import math
import time

import pytest
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

    def average(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        self.calls.append(round_)
        if self.fail:
            raise RoundFailed("no group")
        return AverageResult(delta.clone(), ("me", "partner"), "cd" * 32)

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> Finished:
        return begin_now(self, round_, base_hash, delta)

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None, population: int = 0) -> None:
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
    assert not t.learner.inner_opt.state  # type: ignore[attr-defined]  # poisoned AdamW moments dropped
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


class Hooks:
    """State hooks that record the order of the loop's calls at a round boundary."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def catch_up(self, round_: int, state_hash: str, announce: bool = False, held: bool = True,
                 partners: tuple[str, ...] = ()) -> None:
        self.calls.append(("catch_up", round_))

    def committed(self, snapshot: object) -> None:
        pass

    def wait_for_next(self, round_: int, attesters: list[str], timeout: float) -> bool:
        return True

    def peers_seen(self) -> int | None:
        return None

    def wait_for_end(self, round_: int, peers: tuple[str, ...], until: float) -> list[str]:
        self.calls.append(("wait_for_end", (round_, peers)))
        return []


class Splitter(Recorder):
    """Round 1 fails for us while the members we did not fault may still complete it; round 2 we
    average alone while others were seen; round 3 with a partner."""

    def average(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        self.calls.append(round_)
        soon = time.monotonic() + 30
        if round_ == 1:
            raise RoundFailed("B refused our part", {"dead": "no part"}, ("B", "C"), soon)
        if round_ == 2:
            return AverageResult(delta.clone(), ("me",), "cd" * 32, awaiting=("B",), awaiting_until=soon)
        return AverageResult(delta.clone(), ("me", "B"), "cd" * 32)


def test_after_a_void_or_alone_round_fork_choice_waits_for_how_the_others_ended_it(corpus: Corpus) -> None:
    # a member that decided a group without us may still be applying the round when we void it: choosing
    # our state before it says how the round ended, we would train the next round on a lineage it left
    hooks = Hooks()
    spec = RunSpec(name="t", model=TINY, seq_len=16, batch_size=2, sync_every=2)
    splitter = Splitter()
    t = Trainer(TrainerParts(spec, "me", corpus, splitter, MetricsWriter(None), state=hooks), eval_batch_count=1,
                log=lambda _: None)
    splitter.announce = lambda r, base, eta, population=0: hooks.calls.append(("announce", (r, base is not None)))  # type: ignore[method-assign]
    t.outer.round = 1
    for _ in range(3):
        t.catch_up()
        t.run_round()
    t.catch_up()
    # before each wait it announces the next round without a base (not chosen yet), so that the others'
    # matchmaking waits for it; once it has chosen, the round's start announces it with its base
    assert hooks.calls == [("catch_up", 1), ("announce", (1, True)),
                           ("announce", (2, False)), ("wait_for_end", (1, ("B", "C"))), ("catch_up", 2),  # the void
                           ("announce", (2, True)),
                           ("announce", (3, False)), ("wait_for_end", (2, ("B",))), ("catch_up", 3),  # alone
                           ("announce", (3, True)),
                           ("catch_up", 4)]  # after a round with a partner: nothing to wait for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_a_gpu_peer_and_a_cpu_peer_agree_bit_for_bit_on_the_master_state(corpus: Corpus) -> None:
    """The inner steps run on each peer's device (bf16 autocast on a GPU); the outer step runs on the CPU
    master: given the same averaged pseudo-gradient, a CUDA peer and a CPU peer end with the same bytes."""
    from hivetrain.peer.train.diloco import state_hash

    spec = RunSpec(name="t", model=TINY, seq_len=16, batch_size=2, sync_every=2)
    gpu = Trainer(TrainerParts(spec, "a", corpus, Recorder(), MetricsWriter(None)), "cuda", 1, log=lambda _: None)
    cpu = Trainer(TrainerParts(spec, "b", corpus, Recorder(), MetricsWriter(None)), "cpu", 1, log=lambda _: None)
    assert gpu.outer.hash() == cpu.outer.hash() and gpu.outer.master.is_pinned()
    for t in (gpu, cpu):
        t.inner_steps()  # different local work, on different devices
    averaged = torch.randn(cpu.numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    for t in (gpu, cpu):
        t.outer.apply(averaged, t.model, link="ab" * 32)
    assert torch.equal(gpu.outer.master, cpu.outer.master) and gpu.outer.hash() == cpu.outer.hash()
    on_device = torch.cat([p.detach().flatten().cpu() for p in gpu.model.parameters()])
    assert torch.equal(on_device, gpu.outer.master)  # the GPU model holds the master's exact bytes
    assert state_hash(gpu.outer.round, on_device, gpu.outer.momentum, gpu.outer.parent, gpu.outer.link) == gpu.outer.hash()

