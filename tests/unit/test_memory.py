"""The memory plan (peer/train/memory.py) and gradient accumulation (Trainer micro-batches)."""

from __future__ import annotations

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
