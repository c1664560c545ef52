"""The group arithmetic every member derives from shared data (peer/averaging/api.py): shards,
order, group hash."""

from __future__ import annotations

import itertools

import pytest

from hivetrain.peer.averaging.api import MAX_PIECES, group_hash, group_order, pieces_per_member, shard_bounds

BASE = "ab" * 32
PEERS = ["peer-a", "peer-b", "peer-c", "peer-d"]


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


def test_pieces_per_member_exact_values_and_cap() -> None:
    assert pieces_per_member(6000, 3, 1024) == 2  # 2000 values each: two pieces of 1000
    assert pieces_per_member(6000, 3, 2000) == 1
    assert pieces_per_member(6001, 3, 2000) == 2  # 2001 values do not fit one piece
    assert pieces_per_member(25_000_000, 3, 1 << 21) == 4
    # a share is cut in at least 4 pieces where each keeps 128K values: 8M values over 8 members is 4
    # pieces of 250K, not one of 1M (a share in one piece is not pipelined); below 2 x 128K, one piece
    assert pieces_per_member(8_000_000, 8, 1 << 21) == 4
    assert pieces_per_member(869_504, 3, 1 << 21) == 2  # the tiny preset in a group of 3
    assert pieces_per_member(200_000, 1, 1 << 21) == 1
    assert pieces_per_member(0, 3, 1024) == 1 and pieces_per_member(5, 8, 1024) == 1
    assert pieces_per_member(10**10, 64, 1024) == MAX_PIECES // 64  # bounded: at most MAX_PIECES in a round
    assert pieces_per_member(10**10, 3, 1024) * 3 <= MAX_PIECES


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
    # which members are closed (outbound-only) decides the roles: members that disagree on it must not match
    assert group_hash(PEERS, 1, BASE, closed=[PEERS[1]]) != h
    assert group_hash(PEERS, 1, BASE, closed=[PEERS[1]]) != group_hash(PEERS, 1, BASE, closed=[PEERS[2]])
    assert group_hash(PEERS, 1, BASE, closed=[PEERS[2], PEERS[1]]) == group_hash(PEERS, 1, BASE,
                                                                               closed=[PEERS[1], PEERS[2]])
