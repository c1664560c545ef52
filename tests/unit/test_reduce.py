"""The reducer's shard work and the auditor's check of it (peer/reduce.py)."""

from __future__ import annotations

import pytest
import torch

from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.averaging.reduce import (
    UNVERIFIABLE,
    WRONG_AGGREGATE,
    audit_shard,
    digest,
    probation_claims,
    reduce_shard,
)
from hivetrain.peer.errors import RoundFailed

CODEC = get_codec("int8", 1024)
ORDER = ("a", "b", "c", "d")
NUMEL = 5000  # five chunks, the last one short


def _parts(seed: int = 0) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    return {p: CODEC.encode(torch.randn(NUMEL, generator=g) * (1 + i)) for i, p in enumerate(ORDER)}


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_honest_reducer_passes_its_audit(how: str) -> None:
    parts = _parts()
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, how)
    assert shard.digests == [digest(parts[p]) for p in ORDER]
    assert shard.excluded == {}
    assert audit_shard(shard.result, shard.digests, parts, {}, ORDER, NUMEL, CODEC, how) is None


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_float_jitter_of_another_cpu_passes(how: str) -> None:
    """Norms and medians may round differently on another CPU: a result a few ulps away is fine."""
    parts = _parts(1)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, how)
    jittered = CODEC.encode(shard.fp32 * (1 + 3e-7))
    assert audit_shard(jittered, shard.digests, parts, {}, ORDER, NUMEL, CODEC, how) is None


@pytest.mark.parametrize("shift", [3.0, -5.0, 50.0])
def test_wrong_aggregate_is_caught(shift: float) -> None:
    parts = _parts(2)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "robust")
    step = float(shard.fp32.abs().max()) * 2 / 255  # about one quantization step of the widest chunk
    wrong = CODEC.encode(shard.fp32 + shift * step)
    why = audit_shard(wrong, shard.digests, parts, {}, ORDER, NUMEL, CODEC, "robust")
    assert why is not None and why.startswith(WRONG_AGGREGATE), why


def test_small_targeted_change_in_one_chunk_is_caught() -> None:
    """A cheater moving a single value by a few steps is caught: the bound is per chunk, per value."""
    parts = _parts(3)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean")
    x = shard.fp32.clone()
    x[4321] += 4 * float(x[4096:].max() - x[4096:].min()) / 255
    why = audit_shard(CODEC.encode(x), shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean")
    assert why is not None and why.startswith(WRONG_AGGREGATE)


def test_parts_that_differ_make_the_shard_unverifiable_without_blaming_the_reducer() -> None:
    parts = _parts(4)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean")
    auditors_copy = {**parts, "c": CODEC.encode(torch.ones(NUMEL))}  # "c" sent the two something different
    why = audit_shard(shard.result, shard.digests, auditors_copy, {}, ORDER, NUMEL, CODEC, "mean")
    assert why is not None and why.startswith(UNVERIFIABLE) and "c" in why


@pytest.mark.parametrize("bad", ["nan_scale", "wrong_length"])
def test_invalid_parts_are_left_out_alike_by_reducer_and_auditor(bad: str) -> None:
    parts = _parts(5)
    invalid = {}
    if bad == "nan_scale":  # decodes to an error on both sides
        parts["b"] = b"\x00\x00\xc0\x7f" + parts["b"][4:]
    else:  # refused on arrival by both
        invalid = {"b": "wrong length"}
    shard = reduce_shard(parts, invalid, ORDER, NUMEL, CODEC, "robust")
    assert set(shard.excluded) == {"b"}
    assert (shard.digests[1] == "") == (bad == "wrong_length")
    assert audit_shard(shard.result, shard.digests, parts, invalid, ORDER, NUMEL, CODEC, "robust") is None


def test_no_majority_of_valid_parts_fails_the_shard() -> None:
    parts = _parts(6)
    invalid = {"a": "x", "b": "y"}
    with pytest.raises(RoundFailed) as e:
        reduce_shard(parts, invalid, ORDER, NUMEL, CODEC, "mean")
    assert set(e.value.excluded) == {"a", "b"}
    commits = ["", "", digest(parts["c"]), digest(parts["d"])]
    why = audit_shard(CODEC.encode(torch.zeros(NUMEL)), commits, parts, invalid, ORDER, NUMEL, CODEC, "mean")
    assert why is not None and why.startswith(WRONG_AGGREGATE)


def test_commitments_of_the_wrong_size_are_unverifiable() -> None:
    parts = _parts(7)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean")
    why = audit_shard(shard.result, shard.digests[:3], parts, {}, ORDER, NUMEL, CODEC, "mean")
    assert why is not None and why.startswith(UNVERIFIABLE)


def test_malformed_result_is_a_wrong_aggregate() -> None:
    parts = _parts(8)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean")
    why = audit_shard(b"\xff\xff\xff\xff" + shard.result[4:], shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean")
    assert why is not None and why.startswith(WRONG_AGGREGATE)


def test_probation_gives_newcomers_weight_zero_and_the_auditor_follows_the_claims() -> None:
    parts = _parts(9)
    claims = probation_claims(ORDER, {"d"})
    assert claims == ["d"]
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean", claims)
    assert shard.probation == ["d"] and shard.excluded == {}
    without_d = reduce_shard({p: parts[p] for p in "abc"}, {}, ORDER[:3], NUMEL, CODEC, "mean")
    assert shard.result == without_d.result  # exactly the mean of the others
    assert audit_shard(shard.result, shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean", claims) is None
    # the same result without the claim does not pass: the auditor recomputes with what is claimed
    why = audit_shard(shard.result, shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean", [])
    assert why is not None and why.startswith(WRONG_AGGREGATE)


def test_probation_for_half_the_group_or_more_is_neither_claimed_nor_accepted() -> None:
    assert probation_claims(ORDER, {"a", "b"}) == []  # no established majority: equal weights
    assert probation_claims(ORDER, {"a", "zz"}) == ["a"]
    parts = _parts(10)
    shard = reduce_shard(parts, {}, ORDER, NUMEL, CODEC, "mean", ["a", "b"])  # a cheater claiming two
    why = audit_shard(shard.result, shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean", ["a", "b"])
    assert why is not None and why.startswith(WRONG_AGGREGATE) and "probation" in why
    for bad in (["a", "a"], ["x"]):
        assert audit_shard(shard.result, shard.digests, parts, {}, ORDER, NUMEL, CODEC, "mean", bad) is not None
