"""Robust aggregation: bounded influence of Byzantine contributions, near-mean without them."""

from __future__ import annotations

import pytest
import torch

from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.averaging.aggregation import aggregate, mean, outliers, robust_mean
from hivetrain.peer.averaging.api import reduce_parts

D = 20_000


def _honest(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g)
    return [common + 0.5 * (1 + 0.3 * i) * torch.randn(D, generator=g) for i in range(n)]


def _attack(kind: str, honest: list[torch.Tensor]) -> torch.Tensor:
    hm = mean(honest)
    if kind == "flip":
        return -1000.0 * honest[0]
    if kind == "huge":
        return 1e6 * honest[0]
    return torch.full((D,), 3.0 * float(hm.norm()) / D**0.5)  # a constant direction, 3x the norm


def _reducer(parts: list[torch.Tensor]) -> torch.Tensor:
    """What a robust reducer computes: outliers left out, then robust_mean."""
    left_out = set(outliers(parts))
    return robust_mean([p for i, p in enumerate(parts) if i not in left_out])


@pytest.mark.parametrize("kind", ["flip", "huge", "const"])
@pytest.mark.parametrize(("n", "f"), [(4, 1), (5, 2), (8, 3)])
def test_byzantine_minority_stays_within_the_stated_bound(kind: str, n: int, f: int) -> None:
    honest = _honest(n - f, seed=n * 10 + f)
    hm = mean(honest)
    spread = max(float((h - hm).norm()) for h in honest)
    parts = honest + [_attack(kind, honest) for _ in range(f)]
    robust = _reducer(parts)
    plain = mean(parts)
    assert float((robust - hm).norm()) <= 1.0 * spread  # the bound stated in SECURITY.md
    assert float((plain - hm).norm()) > 1.2 * spread  # the attack is real: the plain mean is pulled away


def test_outliers_are_named() -> None:
    honest = _honest(3, seed=1)
    assert outliers(honest + [1e6 * honest[0]]) == [3]
    assert outliers(honest) == []
    assert outliers(honest[:2]) == []  # no majority to judge with


def test_honest_only_cost_is_small_and_identical_inputs_are_exact() -> None:
    honest = _honest(5, seed=2)
    hm = mean(honest)
    spread = max(float((h - hm).norm()) for h in honest)
    assert float((robust_mean(honest) - hm).norm()) <= 0.2 * spread
    same = [honest[0].clone() for _ in range(4)]
    torch.testing.assert_close(robust_mean(same), honest[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(aggregate(honest[:2], "robust"), mean(honest[:2]))


def test_reduce_parts_robust_path_is_one_reencoding() -> None:
    codec = get_codec("int8")
    honest = _honest(3, seed=3)
    parts = [codec.encode(x) for x in honest + [_attack("flip", honest)]]
    out = codec.decode(reduce_parts(parts, D, codec, how="robust"), D)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError):
        aggregate(honest, "median-of-means")
