"""bench/convergence.py: the simulated DDP step, the DiLoCo wiring, the shared data order, the byte counts."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.convergence import (
    DdpSim,
    DilocoSim,
    build_config,
    ddp_step,
    diloco_round_bytes,
    worker_seed,
)
from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.config import ModelConfig, RunSpec
from hivetrain.peer.train.data import Corpus, ShardSampler
from hivetrain.peer.train.diloco import copy_params_to_flat, flat_numel
from hivetrain.peer.train.loop import ring_allreduce_bytes
from hivetrain.peer.train.model import build_model

TINY_CFG = ModelConfig(256, 16, 1, 2, 32, 16)


class LinearRegression(nn.Module):
    """``model(x, y) -> (prediction, mean squared error)``, the interface ddp_step expects."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[0.5, -1.0, 0.25], [1.5, 0.0, -0.5]]))
            self.lin.bias.copy_(torch.tensor([0.1, -0.2]))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        out = self.lin(x)
        return out, F.mse_loss(out, y)


BATCHES = [  # worker 0: 2 samples, worker 1: 2 samples
    (torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 2.0]]), torch.tensor([[1.0, 0.0], [0.5, 2.0]])),
    (torch.tensor([[2.0, 0.5, -1.0], [1.0, 1.0, 1.0]]), torch.tensor([[-1.0, 1.0], [0.0, 0.0]])),
]


def _hand_gradient(w: Tensor, b: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """d/d(w, b) of mean((x w^T + b - y)^2) over the B x 2 outputs, written out."""
    r = x @ w.T + b - y  # (B, 2) residuals
    scale = 2.0 / r.numel()
    return scale * r.T @ x, scale * r.sum(0)


def _hand_mean_gradient(model: LinearRegression) -> tuple[Tensor, Tensor]:
    w, b = model.lin.weight.detach().clone(), model.lin.bias.detach().clone()
    grads = [_hand_gradient(w, b, x, y) for x, y in BATCHES]
    return (grads[0][0] + grads[1][0]) / 2, (grads[0][1] + grads[1][1]) / 2


def test_ddp_step_uses_the_mean_gradient_and_takes_one_sgd_step() -> None:
    model = LinearRegression()
    w0, b0 = model.lin.weight.detach().clone(), model.lin.bias.detach().clone()
    gw, gb = _hand_mean_gradient(model)
    losses = [float(F.mse_loss(x @ w0.T + b0, y)) for x, y in BATCHES]
    loss = ddp_step(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCHES, grad_clip=0.0)
    assert loss == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert model.lin.weight.grad is not None and model.lin.bias.grad is not None
    torch.testing.assert_close(model.lin.weight.grad, gw)
    torch.testing.assert_close(model.lin.bias.grad, gb)
    torch.testing.assert_close(model.lin.weight.detach(), w0 - 0.1 * gw)
    torch.testing.assert_close(model.lin.bias.detach(), b0 - 0.1 * gb)


def test_ddp_step_first_adamw_update_matches_the_formula() -> None:
    model = LinearRegression()
    w0, b0 = model.lin.weight.detach().clone(), model.lin.bias.detach().clone()
    gw, gb = _hand_mean_gradient(model)
    lr, wd, eps, (b1, b2) = 0.01, 0.1, 1e-8, (0.9, 0.95)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(b1, b2), eps=eps)
    ddp_step(model, opt, BATCHES, grad_clip=0.0)

    def adamw_first(p: Tensor, g: Tensor) -> Tensor:
        m_hat = (1 - b1) * g / (1 - b1)  # bias-corrected first moment after one step: g
        v_hat = (1 - b2) * g * g / (1 - b2)  # bias-corrected second moment: g^2
        return p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)

    torch.testing.assert_close(model.lin.weight.detach(), adamw_first(w0, gw))
    torch.testing.assert_close(model.lin.bias.detach(), adamw_first(b0, gb))


def test_ddp_step_clips_the_mean_gradient() -> None:
    model = LinearRegression()
    gw, gb = _hand_mean_gradient(model)
    norm = torch.cat([gw.flatten(), gb]).norm()
    assert norm > 0.5
    ddp_step(model, torch.optim.SGD(model.parameters(), lr=0.0), BATCHES, grad_clip=0.5)
    assert model.lin.weight.grad is not None and model.lin.bias.grad is not None
    torch.testing.assert_close(model.lin.weight.grad, gw * (0.5 / norm), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.lin.bias.grad, gb * (0.5 / norm), rtol=1e-5, atol=1e-6)


# ---- DiLoCo wiring on a tiny Llama and a synthetic corpus --------------------------------------------



def _spec(**overrides: object) -> RunSpec:
    base: dict[str, object] = dict(name="t", model=TINY_CFG, seq_len=16, batch_size=2, sync_every=1, init_seed=3)
    base.update(overrides)
    return RunSpec(**base)  # type: ignore[arg-type]


def _flat(model: nn.Module) -> Tensor:
    params = list(model.parameters())
    return copy_params_to_flat(params, torch.empty(flat_numel(params), dtype=torch.float32))


def test_diloco_h1_lr1_no_momentum_is_the_average_of_the_local_steps(corpus: Corpus) -> None:
    spec, workers, seed = _spec(outer_lr=1.0, outer_momentum=0.0, aggregation="mean"), 3, 5
    sim = DilocoSim(dataclasses.replace(spec, compression="fp32"), corpus, workers, seed)
    # the reference: each worker's own model, AdamW (the peers' settings) and sampler; average after each step
    models = [build_model(TINY_CFG, spec.init_seed) for _ in range(workers)]
    opts = [torch.optim.AdamW(m.parameters(), lr=spec.inner_lr, weight_decay=spec.inner_weight_decay,
                              betas=(0.9, 0.95)) for m in models]
    samplers = [ShardSampler(corpus.train, spec.seq_len, spec.batch_size, worker_seed(seed, i)) for i in range(workers)]
    for round_ in range(2):
        for m, opt, s in zip(models, opts, samplers, strict=True):
            x, y = s.next_batch()
            _, loss = m(x, y)
            assert loss is not None
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), spec.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        average = torch.stack([_flat(m) for m in models]).mean(0)
        for m in models:  # every worker continues from the average, with its own AdamW state
            with torch.no_grad():
                for p, v in zip(m.parameters(), average.split([p.numel() for p in m.parameters()]), strict=True):
                    p.copy_(v.view_as(p))
        sim.run_round()
        assert sim.round == round_ + 1
        for t in sim.trainers:
            torch.testing.assert_close(_flat(t.model), average)
    sim.close()


def test_diloco_int8_workers_stay_identical_and_learn(corpus: Corpus) -> None:
    sim = DilocoSim(_spec(sync_every=3, compression="int8"), corpus, 2, 0)
    before = _flat(sim.model)
    for _ in range(2):
        sim.run_round()  # raises if any worker's state differs from the others'
    assert sim.round == 2
    assert not torch.equal(_flat(sim.model), before)
    assert len({t.outer.hash() for t in sim.trainers}) == 1
    sim.close()


def test_ddp_and_diloco_share_initialisation_and_data_order(corpus: Corpus) -> None:
    spec = _spec()
    ddp, diloco = DdpSim(spec, corpus, 2, 7), DilocoSim(dataclasses.replace(spec, compression="fp32"), corpus, 2, 7)
    torch.testing.assert_close(_flat(ddp.model), _flat(diloco.model), rtol=0, atol=0)
    for sampler, trainer in zip(ddp.samplers, diloco.trainers, strict=True):
        for _ in range(3):
            (x1, y1), (x2, y2) = sampler.next_batch(), trainer.learner.sampler.next_batch()  # type: ignore[attr-defined]
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(ddp.samplers[0].next_batch()[0], ddp.samplers[1].next_batch()[0])
    assert worker_seed(0, 1) != worker_seed(1, 0)
    diloco.close()


def test_round_bytes() -> None:
    # fp32 over 4 workers: exactly the ring all-reduce of the whole vector
    assert diloco_round_bytes(10, 4, get_codec("fp32")) == ring_allreduce_bytes(10, 4) == 60
    # int8: each shard carries its own scale and offset (8 bytes) plus one byte per value
    assert diloco_round_bytes(10, 2, get_codec("int8")) == 2 * 1 * (2 * (8 + 5)) / 2
    n = 869_504
    ratio = diloco_round_bytes(n, 4, get_codec("int8")) / diloco_round_bytes(n, 4, get_codec("fp32"))
    assert 0.25 < ratio < 0.2505
    assert diloco_round_bytes(n, 1, get_codec("int8")) == 0.0
    # audits: every part also goes to its shard's auditor, 1.5x the plain all-reduce
    assert diloco_round_bytes(n, 4, get_codec("int8"), audit=True) == 1.5 * diloco_round_bytes(n, 4, get_codec("int8"))
    # sparse: parts of 4 + 3 x 64 bytes per 4096 values, results with room for 4 members' values
    sparse = get_codec("sparse")
    shard = n // 4  # 217,376 values: 53 whole chunks and one of 288
    part, result = 53 * (4 + 3 * 64) + 4 + 3 * 64, 53 * (4 + 3 * 256) + 4 + 3 * 256
    assert sparse.encoded_nbytes(shard) == part and sparse.for_results(4).encoded_nbytes(shard) == result
    assert diloco_round_bytes(n, 4, sparse, audit=True) == 3 * 4 * (2 * part + result) / 4
    assert diloco_round_bytes(n, 4, get_codec("int8"), audit=True) / diloco_round_bytes(n, 4, sparse, audit=True) > 6


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(quick=False, preset="tiny", workers=None, seeds=None, H=None, steps=None,
                                   batch_size=None, seq_len=None, eval_batches=None, threads=1, aggregation="robust")
    base.update(kw)
    return argparse.Namespace(**base)


def test_config_defaults_and_validation() -> None:
    full = build_config(_args())
    assert (full.workers, full.seeds, full.hs, full.steps) == (4, (0, 1, 2), (10, 25, 50), 400)
    assert full.batch_size * full.workers == 16  # ddp's global batch is the preset's batch
    quick = build_config(_args(quick=True))
    assert (quick.workers, len(quick.seeds), quick.hs) == (2, 2, (5, 10)) and quick.steps % 10 == 0
    assert [v.name for v in quick.variants()] == ["ddp", "diloco_fp32_H5", "diloco_int8_H5", "diloco_fp32_H10",
                                                  "diloco_int8_H10", "sparse_H10", "default"]
    sparse = quick.variants()[-2]
    assert (sparse.h, sparse.codec, sparse.shipped) == (10, "sparse", False)
    assert build_config(_args(quick=True, no_sparse=True)).sparse_hs == ()
    assert build_config(_args(quick=True, sparse_H=(5, 10))).sparse_hs == (5, 10)
    with pytest.raises(SystemExit, match="--sparse-H"):
        build_config(_args(quick=True, steps=40, sparse_H=(15,)))
    default = quick.variants()[-1]
    assert (default.h, default.codec, default.shipped) == (20, "int8", True)  # the tiny preset's H, the spec's codec
    swept = build_config(_args(quick=True, H=(10,), inner_lrs=(1e-3, 2e-3), outer_lrs=(0.7,), outer_momenta=(0.8, 0.9),
                               no_default=True))
    assert [v.name for v in swept.variants()] == [
        "ddp_lr0.001", "ddp_lr0.002", "diloco_fp32_H10_lr0.001_om0.8", "diloco_fp32_H10_lr0.001_om0.9",
        "diloco_fp32_H10_lr0.002_om0.8", "diloco_fp32_H10_lr0.002_om0.9", "diloco_int8_H10_lr0.001_om0.8",
        "diloco_int8_H10_lr0.001_om0.9", "diloco_int8_H10_lr0.002_om0.8", "diloco_int8_H10_lr0.002_om0.9", "sparse_H10"]
    assert (swept.variants()[-1].inner_lr, swept.variants()[-1].outer_lr) == (None, 0.7)  # one value: it is used
    spec = swept.spec(3, swept.variants()[-2])
    assert (spec.inner_lr, spec.outer_lr, spec.outer_momentum, spec.sync_every, spec.init_seed) == (2e-3, 0.7, 0.9, 10, 3)
    with pytest.raises(SystemExit, match="preset's H 20"):
        build_config(_args(H=(10,), steps=30))  # the variant 'default' runs H 20
    with pytest.raises(SystemExit, match="--warmup"):
        build_config(_args(quick=True, schedule="cosine", warmup=40, steps=40))
    with pytest.raises(SystemExit):
        build_config(_args(H=(10, 25), steps=60))  # not a multiple of 25
    with pytest.raises(SystemExit):
        build_config(_args(workers=1))
    smol = build_config(_args(preset="smollm2-135m", H=(5,), steps=20, no_default=True))  # a Hugging Face run's defaults
    assert (smol.default_h, smol.eval_batch_size, smol.seq_len, smol.batch_size) == (50, 8, 512, 2)
    with pytest.raises(SystemExit, match="smollm2-135m"):
        build_config(_args(preset="huge"))


def test_the_real_runs_verdict_compares_the_simulated_mean_with_their_spread() -> None:
    from bench.convergence_real import compare

    sim = {"final_eval_loss_mean": 1.90, "final_eval_loss_std": 0.01}
    inside = compare(sim, [1.88, 1.91, 1.93])
    assert inside["simulation_within_real_spread"] and inside["simulation_within_real_range"]
    assert abs(inside["gap"] - (1.906666 - 1.90)) < 1e-4 and inside["real_min"] == 1.88
    outside = compare(sim, [1.95, 1.96, 1.97])
    assert not outside["simulation_within_real_spread"] and not outside["simulation_within_real_range"]
    assert outside["gap_pct"] > 0
    assert compare(sim, [1.90])["real_std"] == 0.0  # one run: no spread to be inside of, unless exactly equal
