"""The inner learning-rate schedule of the run spec (peer/train/schedule.py) and its checks."""

from __future__ import annotations

import math

import pytest

from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.train.schedule import MIN_RATIO, inner_lr_at


def test_constant_is_the_spec_lr_at_every_step() -> None:
    spec = RunSpec("s", inner_lr=3e-3)
    assert {inner_lr_at(spec, s) for s in (0, 1, 999, 10**9)} == {3e-3}


def test_warmup_rises_linearly_to_the_peak_then_holds() -> None:
    spec = RunSpec("s", inner_lr=1e-3, inner_warmup=10)
    lrs = [inner_lr_at(spec, s) for s in range(12)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[4] == pytest.approx(5e-4)
    assert lrs[9] == lrs[10] == lrs[11] == 1e-3
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))


def test_cosine_decays_from_the_peak_to_the_floor_at_total_steps_and_stays() -> None:
    spec = RunSpec("s", inner_lr=2e-3, inner_warmup=100, inner_schedule="cosine", inner_total_steps=1100)
    assert inner_lr_at(spec, 100) == pytest.approx(2e-3)
    assert inner_lr_at(spec, 600) == pytest.approx(2e-3 * (MIN_RATIO + (1 - MIN_RATIO) * 0.5))
    assert inner_lr_at(spec, 1100) == pytest.approx(2e-3 * MIN_RATIO)
    assert inner_lr_at(spec, 10**6) == pytest.approx(2e-3 * MIN_RATIO)
    mid = [inner_lr_at(spec, s) for s in range(100, 1101, 50)]
    assert all(a > b for a, b in zip(mid, mid[1:], strict=False)) and all(math.isfinite(x) for x in mid)


@pytest.mark.parametrize("fields, needle", [
    (dict(inner_schedule="linear"), "inner_schedule"),
    (dict(inner_schedule="cosine"), "needs inner_total_steps"),
    (dict(inner_schedule="cosine", inner_warmup=50, inner_total_steps=50), "needs inner_total_steps"),
    (dict(inner_warmup=-1), "inner_warmup"),
    (dict(inner_total_steps=True), "inner_total_steps"),
])
def test_a_bad_schedule_is_refused_by_name(fields: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        RunSpec("s", **fields)


def test_the_schedule_travels_in_the_spec() -> None:
    spec = RunSpec("s", inner_warmup=20, inner_schedule="cosine", inner_total_steps=400)
    assert RunSpec.from_dict(spec.to_dict()) == spec


def test_the_trainer_steps_with_the_rate_of_the_runs_step() -> None:
    from bench.convergence import make_trainer
    from hivetrain.peer.train.data import load_sotu

    spec = RunSpec.from_preset("s", "tiny", sync_every=2, batch_size=2, seq_len=32, inner_warmup=4)
    trainer = make_trainer(spec, load_sotu(min_tokens=128), "w0")
    seen: list[float] = []
    step = trainer.learner.inner_opt.step

    def spy() -> None:
        seen.append(trainer.learner.inner_opt.param_groups[0]["lr"])
        step()

    trainer.learner.inner_opt.step = spy  # type: ignore[method-assign]
    trainer.inner_steps()  # round 0: the run's steps 0 and 1
    trainer.outer.round = 1  # a peer that joined at round 1 goes on from the run's step 2
    trainer.inner_steps()
    assert seen == pytest.approx([inner_lr_at(spec, s) for s in range(4)])
    assert seen[-1] == spec.inner_lr


def test_demo_passes_the_outer_step_and_warmup_to_the_owner_even_when_zero() -> None:
    from hivetrain.peer.cli import build_parser
    from hivetrain.peer.demo import _peer_cmd

    args = build_parser().parse_args(["demo", "--outer-momentum", "0", "--outer-lr", "1", "--inner-warmup", "0"])
    owner = _peer_cmd(0, "/tmp/w", args, None)
    assert owner[owner.index("--outer-momentum") + 1] == "0.0" and owner[owner.index("--inner-warmup") + 1] == "0"
    assert owner[owner.index("--outer-lr") + 1] == "1.0"
    joiner = _peer_cmd(1, "/tmp/w", args, ("demo.key", "/ip4/127.0.0.1/tcp/1/p2p/x"))
    assert "--outer-lr" not in joiner  # a joiner takes the run's spec
    plain = _peer_cmd(0, "/tmp/w", build_parser().parse_args(["demo"]), None)
    assert "--outer-lr" not in plain and "--inner-warmup" not in plain  # the preset's
