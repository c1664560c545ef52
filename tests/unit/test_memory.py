"""The memory plan (peer/train/memory.py) and gradient accumulation (Trainer micro-batches)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.throughput import _NoAverager
from hivetrain.peer.app import fits
from hivetrain.peer.config import PRESETS, ModelConfig, PeerOptions, RunSpec
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


# SmolLM2-135M's sizes as the spec records them (peer/config.py hf_summary of its config.json), and the
# batch a run on a Hugging Face model has by default (peer/app.py HF_DEFAULTS): 8 sequences of 512 tokens
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, ffn_hidden=1536, max_seq_len=8192,
                      rope_theta=100000.0)


def _chosen(device: str, gib: float, batch: int = 8, seq_len: int = 512) -> tuple[int, bool]:
    p = memory.choose(SMOLLM2, batch, seq_len, device, int(gib * GIB))
    assert p.needed <= memory.MARGIN * gib * GIB
    return p.micro_batch, p.checkpointing


def test_the_plan_chooses_what_fits_smollm2_under_8_and_16_gib() -> None:
    # a GPU: 16 GiB takes the whole batch; 8 GiB the largest micro-batch that fits (2 x 4: 2048 tokens each)
    assert _chosen("cuda", 16) == (8, False)
    assert _chosen("cuda", 8) == (4, False)
    # below that, micro-batches of 1 or 2 sequences would fit but leave the GPU idle: checkpointing instead
    assert _chosen("cuda", 6) == (8, True)
    assert _chosen("cuda", 5) == (4, True)
    # the CPU holds the outer state and the snapshots too (one memory): 16 GiB takes 2 micro-batches of 4 ...
    assert _chosen("cpu", 24) == (8, False)
    assert _chosen("cpu", 16) == (4, False)
    # ... and, where not even one sequence fits without it, checkpointing (micro-batches before it on a CPU)
    assert _chosen("cpu", 9.5, 4, 128) == (2, True)
    assert _chosen("cpu", 9.75, 4, 128) == (1, False)
    line = memory.choose(SMOLLM2, 8, 512, "cpu", 16 * GIB).describe(16 * GIB)
    assert "\n" not in line and line.startswith("memory plan on cpu: ") and "13.50 GiB of 16.00 GiB (one memory)" in line
    assert ("; chose 2 micro-batches of 4 (the same mean gradient): the run's batch of 8 at once needs 19.13 GiB, "
            "over the 13.60 GiB (85%) a plan may use; --micro-batch and --activation-checkpointing choose "
            "otherwise") in line, line
    ckpt = memory.choose(SMOLLM2, 8, 512, "cuda", 5 * GIB).describe(5 * GIB)
    assert "chose activation checkpointing (about a third more compute) and 2 micro-batches of 4" in ckpt, ckpt
    assert "without it only micro-batches of 2 fit (1024 tokens: too few to keep a GPU busy)" in ckpt, ckpt
    whole = memory.choose(SMOLLM2, 8, 512, "cuda", 16 * GIB)  # nothing to choose: nothing said about it
    assert whole.why == "" and "chose" not in whole.describe(16 * GIB)


def test_when_nothing_fits_the_refusal_says_what_would() -> None:
    # 8 GiB of CPU: the parameters, AdamW, outer state and snapshots alone are 7.87 GiB, over 85% of it
    with pytest.raises(ConfigError) as e:
        memory.choose(SMOLLM2, 8, 512, "cpu", 8 * GIB)
    assert str(e.value) == (
        "this model will not fit cpu: even with activation checkpointing and micro-batches of 1 it needs about "
        "8.13 GiB (parameters, gradients, AdamW, outer state and snapshots: 7.87 GiB) and 85% of the device is "
        "6.80 GiB; use a device with more memory or join a run of a smaller model")
    with pytest.raises(ConfigError, match=r"^this model will not fit cuda: .* \(parameters, gradients, AdamW: "
                                          r"2\.62 GiB\) .*join a run of a smaller model$"):
        memory.choose(SMOLLM2, 8, 512, "cuda", 2 * GIB)


def test_the_users_own_micro_batch_or_checkpointing_is_kept_or_refused_with_advice() -> None:
    # what the user passed is what the plan is, even where the plan would have chosen otherwise
    assert _plan(micro_batch=2) == (2, False) and _plan(checkpointing=True) == (8, True)
    assert _plan(micro_batch=4, checkpointing=True) == (4, True)
    with pytest.raises(ConfigError) as e:  # the whole batch, asked for, on 16 GiB of CPU: refused, not replaced
        memory.choose(SMOLLM2, 8, 512, "cpu", 16 * GIB, micro_batch=8)
    line = str(e.value)
    assert line.startswith("this model will not fit cpu with --micro-batch 8: it needs about 19.13 GiB"), line
    assert "pass --micro-batch 4 (gradient accumulation" in line and "or --activation-checkpointing (" in line, line
    assert line.endswith("; or drop --micro-batch 8 and the plan chooses"), line
    with pytest.raises(ConfigError, match=r"^this model will not fit cuda with --activation-checkpointing: .*pass "
                                          r"--micro-batch 2 .*; or drop --activation-checkpointing and the plan chooses$"):
        memory.choose(SMOLLM2, 8, 512, "cuda", 4 * GIB, checkpointing=True)


def _plan(micro_batch: int = 0, checkpointing: bool = False) -> tuple[int, bool]:
    p = memory.choose(SMOLLM2, 8, 512, "cuda", 16 * GIB, micro_batch, checkpointing)
    return p.micro_batch, p.checkpointing


def test_the_peer_trains_with_the_plan_it_chose() -> None:
    """peer/app.py ``fits``: the plan said in one line is the one returned (and given to the learner)."""
    medium = RunSpec.from_preset("mp", "medium")  # batch 32 x 512; 1.16 GiB before activations
    said: list[str] = []
    p = fits(medium, PeerOptions(device="cpu", memory_limit_gib=2.0), said.append)
    assert (p.micro_batch, p.checkpointing) == (1, False) and said == [p.describe(2 * GIB)] and "; chose 32 " in said[0]
    with pytest.raises(ConfigError, match="will not fit cpu with --activation-checkpointing: "):
        fits(medium, PeerOptions(device="cpu", memory_limit_gib=2.0, checkpointing=True), said.append)
    assert len(said) == 1  # a refusal says nothing else
