"""The averaging seam (peer/averager.py): shards, group order, the reducer, the in-memory hub."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
import torch

from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.averaging.api import (
    AverageResult,
    InMemoryHub,
    group_hash,
    group_order,
    reduce_parts,
    shard_bounds,
)
from hivetrain.peer.errors import RoundFailed

FP32 = get_codec("fp32")
INT8 = get_codec("int8")
BASE = "ab" * 32
PEERS = ["peer-a", "peer-b", "peer-c", "peer-d"]


def _call(hub: InMemoryHub, peer: str, round_: int, base: str, delta: torch.Tensor) -> Callable[[], AverageResult]:
    return lambda: hub.averager(peer).average(round_, base, delta)


def _run_threads(fns: dict[str, Callable[[], AverageResult]]) -> dict[str, AverageResult | BaseException]:
    """Runs each fn on its own thread; returns each result or the exception it raised."""
    out: dict[str, AverageResult | BaseException] = {}

    def wrap(name: str, fn: Callable[[], AverageResult]) -> None:
        try:
            out[name] = fn()
        except BaseException as e:  # collected and asserted on by the test
            out[name] = e

    threads = [threading.Thread(target=wrap, args=(n, f), daemon=True) for n, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "an averager thread hung"
    return out


# ---- shard_bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 64, 100, 1001])
@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 8, 13])
def test_shard_bounds_cover_contiguously_and_evenly(numel: int, group_size: int) -> None:
    bounds = shard_bounds(numel, group_size)
    assert len(bounds) == group_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, e0), (s1, _) in itertools.pairwise(bounds):
        assert e0 == s1
    sizes = [e - s for s, e in bounds]
    assert all(s >= 0 for s in sizes)
    assert sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1


def test_shard_bounds_exact_values() -> None:
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


# ---- group_order / group_hash ---------------------------------------------------------------------


def test_group_order_is_a_permutation_independent_of_input_order() -> None:
    order = group_order(PEERS, 5, BASE)
    assert sorted(order) == sorted(PEERS)
    for perm in itertools.permutations(PEERS):
        assert group_order(list(perm), 5, BASE) == order
    assert group_order(PEERS + ["peer-a"], 5, BASE) == order  # duplicates collapse


def test_group_order_rotates_with_round_and_base() -> None:
    orders = {group_order(PEERS, r, BASE) for r in range(10)}
    assert len(orders) > 1
    assert group_order(PEERS, 0, BASE) != group_order(PEERS, 1, BASE)
    assert len({group_order(PEERS, 0, c * 64) for c in "0123456789"}) > 1


def test_group_hash_depends_on_everything() -> None:
    h = group_hash(PEERS, 1, BASE)
    assert group_hash(PEERS, 1, BASE) == h
    assert group_hash(PEERS, 2, BASE) != h
    assert group_hash(PEERS, 1, "cd" * 32) != h
    assert group_hash(PEERS[:3], 1, BASE) != h
    assert group_hash(list(reversed(PEERS)), 1, BASE) != h  # the order is part of the group


# ---- reduce_parts ---------------------------------------------------------------------------------


def test_reduce_parts_fp32_exact_mean() -> None:
    parts = [FP32.encode(torch.tensor([1.0, 2.0])), FP32.encode(torch.tensor([3.0, 4.0]))]
    out = FP32.decode(reduce_parts(parts, 2, FP32), 2)
    assert out.tolist() == [2.0, 3.0]


def test_reduce_parts_fp32_four_parts_exact() -> None:
    values = [[1.0, -2.0, 0.5], [3.0, 2.0, 0.5], [5.0, 0.0, 1.5], [7.0, 4.0, 1.5]]
    parts = [FP32.encode(torch.tensor(v)) for v in values]
    out = FP32.decode(reduce_parts(parts, 3, FP32), 3)
    assert out.tolist() == [4.0, 1.0, 1.0]


def test_reduce_parts_int8_close_to_mean() -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(500, generator=gen) for _ in range(3)]
    out = INT8.decode(reduce_parts([INT8.encode(x) for x in xs], 500, INT8), 500)
    mean = torch.stack(xs).mean(0)
    assert float((out - mean).norm() / mean.norm()) < 0.03


# ---- InMemoryHub ----------------------------------------------------------------------------------


def test_all_reduce_fp32_exact() -> None:
    hub = InMemoryHub(2, FP32)
    order, out = hub.all_reduce(0, BASE, {"a": torch.tensor([1.0, 2.0, 5.0]), "b": torch.tensor([3.0, 4.0, 7.0])})
    assert sorted(order) == ["a", "b"]
    assert out.tolist() == [2.0, 3.0, 6.0]


def test_all_reduce_int8_four_peers_within_3_percent() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = {p: torch.randn(1000, generator=gen) * (i + 1) * 0.01 for i, p in enumerate(PEERS)}
    hub = InMemoryHub(4, INT8)
    order, out = hub.all_reduce(7, BASE, deltas)
    assert order == group_order(PEERS, 7, BASE)
    assert out.dtype == torch.float32 and out.shape == (1000,)
    mean = torch.stack(list(deltas.values())).double().mean(0)
    rel = float((out.double() - mean).norm() / mean.norm())
    assert rel < 0.03, rel


def test_threaded_average_gives_identical_results() -> None:
    gen = torch.Generator().manual_seed(1)
    ids = ["p0", "p1", "p2"]
    deltas = {p: torch.randn(300, generator=gen) for p in ids}
    hub = InMemoryHub(3, INT8, timeout=10.0)
    results = _run_threads({p: _call(hub, p, 4, BASE, deltas[p]) for p in ids})
    assert all(isinstance(r, AverageResult) for r in results.values()), results
    res = [r for r in results.values() if isinstance(r, AverageResult)]
    for r in res[1:]:
        assert torch.equal(r.averaged, res[0].averaged)
        assert r.group == res[0].group
    assert sorted(res[0].group) == ids
    assert res[0].group == group_order(ids, 4, BASE)
    _, single = InMemoryHub(3, INT8).all_reduce(4, BASE, deltas)
    assert torch.equal(res[0].averaged, single)  # same semantics as the single-threaded entry


def test_threaded_average_results_do_not_alias() -> None:
    hub = InMemoryHub(2, FP32, timeout=10.0)
    results = _run_threads({p: _call(hub, p, 0, BASE, torch.ones(4)) for p in ("x", "y")})
    rx, ry = results["x"], results["y"]
    assert isinstance(rx, AverageResult) and isinstance(ry, AverageResult)
    rx.averaged.add_(1.0)
    assert ry.averaged.tolist() == [1.0] * 4


def test_fail_rounds_fails_every_member() -> None:
    hub = InMemoryHub(3, FP32, timeout=10.0)
    hub.fail_rounds.add(2)
    results = _run_threads({p: _call(hub, p, 2, BASE, torch.ones(8)) for p in ("a", "b", "c")})
    assert all(isinstance(r, RoundFailed) for r in results.values()), results
    # the next round works again
    results = _run_threads({p: _call(hub, p, 3, BASE, torch.ones(8)) for p in ("a", "b", "c")})
    assert all(isinstance(r, AverageResult) for r in results.values()), results


def test_different_base_hashes_fail_every_member() -> None:
    hub = InMemoryHub(3, FP32, timeout=10.0)
    bases = {"a": BASE, "b": BASE, "c": "cd" * 32}
    results = _run_threads({p: _call(hub, p, 1, bases[p], torch.ones(8)) for p in bases})
    assert all(isinstance(r, RoundFailed) for r in results.values()), results


def test_different_rounds_fail_every_member() -> None:
    """Members disagreeing on the round must each get RoundFailed (the Averager contract), nothing else."""
    hub = InMemoryHub(2, FP32, timeout=10.0)
    rounds = {"a": 1, "b": 2}
    results = _run_threads({p: _call(hub, p, rounds[p], BASE, torch.ones(8)) for p in rounds})
    assert all(isinstance(r, RoundFailed) for r in results.values()), results


def test_missing_member_times_out_with_round_failed() -> None:
    hub = InMemoryHub(2, FP32, timeout=0.2)
    with pytest.raises(RoundFailed):
        hub.averager("alone").average(0, BASE, torch.ones(4))
