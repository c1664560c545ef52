"""The DiLoCo math (peer/diloco.py): pseudo-gradient, the outer Nesterov step, OuterState, hashing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hivetrain.peer.config import ModelConfig
from hivetrain.peer.state.snapshot import VOID_LINK, ZERO
from hivetrain.peer.train.diloco import (
    OuterState,
    applied_digest,
    copy_flat_to_params,
    copy_params_to_flat,
    flat_numel,
    nesterov_outer_step,
    pseudo_gradient,
    state_hash,
)
from hivetrain.peer.train.model import build_model

TINY_CFG = ModelConfig(256, 32, 1, 2, 64, 32)
f32 = np.float32


def _flat(model: nn.Module) -> torch.Tensor:
    params = list(model.parameters())
    return copy_params_to_flat(params, torch.empty(flat_numel(params), dtype=torch.float32))


def _as_f32_list(values: list[np.float32]) -> list[float]:
    return [float(v) for v in values]


@pytest.fixture()
def model() -> nn.Module:
    return build_model(TINY_CFG, seed=0)


# ---- pseudo-gradient ------------------------------------------------------------------------------


def test_pseudo_gradient_exact() -> None:
    master = torch.tensor([1.5, 2.0, -3.0, 0.0])
    local = torch.tensor([1.0, 2.5, -3.0, -0.25])
    delta = pseudo_gradient(master, local)
    assert delta.dtype == torch.float32
    assert delta.tolist() == [0.5, -0.5, 0.0, 0.25]


def test_pseudo_gradient_writes_into_out() -> None:
    master, local = torch.tensor([4.0, 1.0]), torch.tensor([1.0, 3.0])
    out = torch.full((2,), 99.0)
    res = pseudo_gradient(master, local, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert out.tolist() == [3.0, -2.0]
    assert master.tolist() == [4.0, 1.0] and local.tolist() == [1.0, 3.0]  # inputs untouched


# ---- outer Nesterov step --------------------------------------------------------------------------


def test_nesterov_outer_step_hand_computed_two_steps() -> None:
    """Every op rounded to float32 on its own (IEEE-754, no fused multiply-add), as the docstring's
    'every peer runs exactly the same elementwise ops' requires for bit-identical peers."""
    lr, mu = f32(0.7), f32(0.9)
    d0, d1 = f32(0.5), f32(-1.0)
    # step 1: m <- mu * 0 + delta; theta <- theta - lr * (delta + mu * m)
    m0_1 = f32(mu * f32(0.0)) + d0
    m1_1 = f32(mu * f32(0.0)) + d1
    u0_1 = d0 + f32(mu * m0_1)
    u1_1 = d1 + f32(mu * m1_1)
    t0_1 = f32(1.0) - f32(lr * u0_1)
    t1_1 = f32(2.0) - f32(lr * u1_1)
    # step 2
    m0_2 = f32(mu * m0_1) + d0
    m1_2 = f32(mu * m1_1) + d1
    u0_2 = d0 + f32(mu * m0_2)
    u1_2 = d1 + f32(mu * m1_2)
    t0_2 = t0_1 - f32(lr * u0_2)
    t1_2 = t1_1 - f32(lr * u1_2)

    master, momentum = torch.tensor([1.0, 2.0]), torch.zeros(2)
    delta = torch.tensor([0.5, -1.0])
    nesterov_outer_step(master, momentum, delta, 0.7, 0.9)
    assert momentum.tolist() == _as_f32_list([m0_1, m1_1])
    assert master.tolist() == _as_f32_list([t0_1, t1_1])
    nesterov_outer_step(master, momentum, delta, 0.7, 0.9)
    assert momentum.tolist() == _as_f32_list([m0_2, m1_2])
    assert master.tolist() == _as_f32_list([t0_2, t1_2])
    assert delta.tolist() == [0.5, -1.0]  # the averaged delta is not modified


def test_nesterov_outer_step_is_platform_independent_float32() -> None:
    """Bitwise equal to an op-by-op float32 reference on a vector long enough for the SIMD path:
    peers on CPUs with and without FMA must agree on the master bit for bit."""
    n = 4096
    gen = torch.Generator().manual_seed(1)
    master0, delta = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    lr, mu = f32(0.7), f32(0.9)
    ref_master, ref_m, d = master0.numpy().copy(), np.zeros(n, f32), delta.numpy()
    master, momentum = master0.clone(), torch.zeros(n)
    for _ in range(2):
        ref_m = (ref_m * mu).astype(f32) + d
        update = d + (mu * ref_m).astype(f32)
        ref_master = ref_master - (lr * update).astype(f32)
        nesterov_outer_step(master, momentum, delta, 0.7, 0.9)
    assert np.array_equal(momentum.numpy(), ref_m)
    mismatches = int((master.numpy() != ref_master).sum())
    assert mismatches == 0, f"{mismatches} of {n} master elements differ from plain float32 arithmetic"


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("foreach", [False, True])
def test_nesterov_outer_step_matches_torch_sgd(foreach: bool, nesterov: bool) -> None:
    delta = torch.tensor([0.5, -1.0, 0.125, 3.0])
    p = nn.Parameter(torch.tensor([1.0, 2.0, -1.0, 0.0]))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=nesterov, foreach=foreach)
    master, momentum = torch.tensor([1.0, 2.0, -1.0, 0.0]), torch.zeros(4)
    for _ in range(3):
        p.grad = delta.clone()
        opt.step()
        nesterov_outer_step(master, momentum, delta, 0.7, 0.9, nesterov)
        # the same update as torch's SGD; torch may fuse multiply-adds (1 ulp apart), we never do
        torch.testing.assert_close(master, p.detach(), rtol=2e-7, atol=0 if nesterov else 3e-8)
        torch.testing.assert_close(momentum, opt.state[p]["momentum_buffer"], rtol=0, atol=0)


# ---- flat copies ----------------------------------------------------------------------------------


def test_copy_params_flat_round_trip(model: nn.Module) -> None:
    params = list(model.parameters())
    flat = _flat(model)
    assert flat.numel() == flat_numel(params) == sum(p.numel() for p in params)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params]))

    other = build_model(TINY_CFG, seed=1)
    assert not torch.equal(_flat(other), flat)
    copy_flat_to_params(flat, other.parameters())
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_flat(other), flat)


def test_copy_params_to_flat_rejects_wrong_size(model: nn.Module) -> None:
    with pytest.raises((AssertionError, RuntimeError)):
        copy_params_to_flat(model.parameters(), torch.empty(flat_numel(model.parameters()) + 1))


# ---- OuterState -----------------------------------------------------------------------------------


def test_outer_state_starts_from_the_model(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    assert state.round == 0
    assert state.numel == flat_numel(model.parameters())
    assert torch.equal(state.master, _flat(model))
    assert torch.equal(state.momentum, torch.zeros(state.numel))


def test_outer_state_pseudo_gradient(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    delta = state.pseudo_gradient(model)
    assert torch.equal(delta, state.master)  # master - 0 is exact


def test_outer_state_apply_sets_params_to_master(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    master0 = state.master.clone()
    averaged = torch.linspace(-0.01, 0.01, state.numel)
    state.apply(averaged, model)
    assert state.round == 1
    assert not torch.equal(state.master, master0)
    assert torch.equal(state.momentum, averaged)  # first step: 0.9 * 0 + delta
    assert torch.equal(_flat(model), state.master)  # bitwise

    expected_master, expected_m = master0.clone(), torch.zeros(state.numel)
    nesterov_outer_step(expected_master, expected_m, averaged, 0.7, 0.9)
    assert torch.equal(state.master, expected_master)


def test_outer_state_apply_keeps_void_shards(model: nn.Module) -> None:
    """Shards voided by their audit keep master and momentum; the rest is the normal outer step."""
    state = OuterState(model, lr=0.7, momentum=0.9)
    state.apply(torch.full((state.numel,), 1e-3), model)  # non-zero momentum everywhere
    master0, m0 = state.master.clone(), state.momentum.clone()
    n = state.numel
    keep = [(0, n // 5), (n // 2, n // 2 + 7)]
    averaged = torch.linspace(-0.01, 0.01, n)
    state.apply(averaged, model, keep=keep)
    expected_master, expected_m = master0.clone(), m0.clone()
    nesterov_outer_step(expected_master, expected_m, averaged, 0.7, 0.9)
    for s, e in keep:
        expected_master[s:e], expected_m[s:e] = master0[s:e], m0[s:e]
    assert torch.equal(state.master, expected_master) and torch.equal(state.momentum, expected_m)
    assert torch.equal(_flat(model), state.master) and state.round == 2


def test_outer_state_void_restores_params_and_advances_round(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    state.apply(torch.full((state.numel,), 1e-3), model)
    master, momentum = state.master.clone(), state.momentum.clone()
    with torch.no_grad():  # pretend some inner steps moved the parameters
        for p in model.parameters():
            p.add_(0.5)
    assert not torch.equal(_flat(model), state.master)
    state.void(model)
    assert state.round == 2
    assert torch.equal(_flat(model), state.master)
    assert torch.equal(state.master, master)
    assert torch.equal(state.momentum, momentum)


# ---- state hash -----------------------------------------------------------------------------------


def test_state_hash_is_deterministic_and_sensitive() -> None:
    master = torch.linspace(-1.0, 1.0, 33)
    momentum = torch.linspace(0.0, 0.5, 33)
    h = state_hash(3, master, momentum)
    assert len(h) == 64 and int(h, 16) >= 0
    assert state_hash(3, master.clone(), momentum.clone()) == h

    assert state_hash(4, master, momentum) != h

    flipped = master.clone()
    flipped.view(torch.int32)[7] ^= 1  # one bit of one element
    assert not torch.equal(flipped, master)
    assert state_hash(3, flipped, momentum) != h

    m2 = momentum.clone()
    m2[0] = 1e-30
    assert state_hash(3, master, m2) != h
    assert state_hash(3, momentum, master) != h  # order of master and momentum matters
    assert state_hash(3, master, momentum, parent="1" * 64) != h  # lineage: the parent ...
    assert state_hash(3, master, momentum, link="1" * 64) != h  # ... and what was applied
    assert state_hash(3, master, momentum, parent="1" * 64) != state_hash(3, master, momentum, link="1" * 64)


def test_outer_state_hash_tracks_round_and_state(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    h0 = state.hash()
    assert h0 == state_hash(0, state.master, state.momentum)
    assert OuterState(build_model(TINY_CFG, seed=0), 0.7, 0.9).hash() == h0  # same seed, same state
    state.void(model)
    h1 = state.hash()
    assert h1 != h0
    state.apply(torch.full((state.numel,), 1e-3), model)
    assert state.hash() not in (h0, h1)


# ---- lineage --------------------------------------------------------------------------------------


def test_the_initial_state_has_no_parent_and_no_link(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    snap = state.snapshot()
    assert (snap.parent, snap.link) == (ZERO, ZERO)
    assert snap.hash == state_hash(0, state.master, state.momentum, ZERO, ZERO)


def test_apply_links_the_new_state_to_the_old_one_and_to_what_was_applied(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    h0 = state.hash()
    averaged = torch.linspace(-0.01, 0.01, state.numel)
    state.apply(averaged, model, link="ab" * 32)
    snap = state.snapshot()
    assert (snap.round, snap.parent, snap.link) == (1, h0, "ab" * 32)
    assert snap.hash == state_hash(1, state.master, state.momentum, h0, "ab" * 32)

    other = OuterState(build_model(TINY_CFG, seed=0), 0.7, 0.9)
    other.apply(averaged, model, link="cd" * 32)  # the same bytes, applied as another round's result
    assert torch.equal(other.master, state.master) and other.hash() != state.hash()


def test_apply_without_a_link_uses_the_digest_of_the_applied_bytes(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    averaged = torch.linspace(-0.01, 0.01, state.numel)
    state.apply(averaged, model, keep=[(0, 5)])
    assert state.link == applied_digest(averaged, [(0, 5)])
    assert applied_digest(averaged, [(0, 5)]) != applied_digest(averaged) != applied_digest(averaged * 2)


def test_apply_refuses_a_malformed_link(model: nn.Module) -> None:
    state = OuterState(model, lr=0.7, momentum=0.9)
    with pytest.raises(ValueError, match="link"):
        state.apply(torch.zeros(state.numel), model, link="AB" * 32)
    assert state.round == 0  # nothing applied


def test_void_links_to_the_old_state_and_two_voids_agree(model: nn.Module) -> None:
    a = OuterState(model, lr=0.7, momentum=0.9)
    b = OuterState(build_model(TINY_CFG, seed=0), 0.7, 0.9)
    h0 = a.hash()
    a.void(model)
    b.void(model)
    assert (a.round, a.parent, a.link) == (1, h0, VOID_LINK)
    assert a.hash() == b.hash() != h0  # every peer that voids the same state lands on the same hash


def test_load_inherits_the_snapshots_lineage(model: nn.Module) -> None:
    a = OuterState(model, lr=0.7, momentum=0.9)
    a.apply(torch.full((a.numel,), 1e-3), model, link="ef" * 32)
    snap = a.snapshot()
    b = OuterState(build_model(TINY_CFG, seed=1), 0.7, 0.9)
    b.load(snap, model)
    assert (b.round, b.parent, b.link, b.hash()) == (1, snap.parent, "ef" * 32, snap.hash)
    b.void(model)
    assert b.parent == snap.hash
