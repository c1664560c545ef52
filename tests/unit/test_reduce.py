"""The reducer's shard work and the auditor's check of it (peer/averaging/reduce.py)."""

from __future__ import annotations

import pytest
import torch

from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.averaging import aggregation
from hivetrain.peer.averaging.reduce import (
    BIAS_TOL,
    MAX_REASON,
    RMS_TOL,
    Finding,
    FindingKind,
    ShardInputs,
    audit_shard,
    digest,
    probation_claims,
    reduce_shard,
)
from hivetrain.peer.errors import RoundFailed

CODEC = get_codec("int8", 1024)
ORDER = ("a", "b", "c", "d")
NUMEL = 5000  # five chunks, the last one short (904 values)


def _parts(seed: int = 0) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    return {p: CODEC.encode(torch.randn(NUMEL, generator=g) * (1 + i)) for i, p in enumerate(ORDER)}


def _inputs(parts: dict[str, bytes], how: str, invalid: dict[str, str] | None = None,
            order: tuple[str, ...] = ORDER) -> ShardInputs:
    return ShardInputs(parts, invalid or {}, order, NUMEL, CODEC, how)


def _steps(x: torch.Tensor) -> torch.Tensor:
    """(NUMEL,) the quantization step of each value's chunk: (max - min) / 255 of the chunk."""
    out = torch.empty_like(x)
    for s in range(0, NUMEL, CODEC.chunk_size):
        c = x[s : s + CODEC.chunk_size]
        out[s : s + CODEC.chunk_size] = float(c.max() - c.min()) / 255
    return out


def _is(finding: Finding | None, kind: FindingKind) -> bool:
    return finding is not None and finding.kind is kind


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_honest_reducer_passes_its_audit(how: str) -> None:
    parts = _parts()
    shard = reduce_shard(_inputs(parts, how))
    assert shard.digests == [digest(parts[p]) for p in ORDER]
    assert shard.excluded == {}
    assert audit_shard(shard.result, shard.digests, _inputs(parts, how)) is None


def _fp64_row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.double(), dim=1).float()


@pytest.mark.parametrize("variant", ["reversed", "fp64_norms", "one_thread"])
def test_honest_float_jitter_of_another_cpu_passes_the_robust_audit(variant: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Another CPU may sum norms and means in another order: its bytes differ, its audit passes."""
    parts = _parts(1)
    shard = reduce_shard(_inputs(parts, "robust"))
    decoded = [CODEC.decode(parts[p], NUMEL) for p in ORDER]
    if variant == "reversed":
        other = aggregation.robust_mean(decoded[::-1])
    elif variant == "fp64_norms":
        monkeypatch.setattr(aggregation, "row_norms", _fp64_row_norms)
        other = aggregation.robust_mean(decoded)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            other = aggregation.robust_mean(decoded)
        finally:
            torch.set_num_threads(threads)
    jittered = CODEC.encode(other)
    assert audit_shard(jittered, shard.digests, _inputs(parts, "robust")) is None
    assert audit_shard(CODEC.encode(shard.fp32 * (1 + 3e-7)), shard.digests, _inputs(parts, "robust")) is None


@pytest.mark.parametrize("shift", [0.25, -0.25, 0.5, -0.5])
@pytest.mark.parametrize("how", ["mean", "robust"])
def test_a_directional_shift_of_a_fraction_of_a_step_is_caught(shift: float, how: str) -> None:
    """Every value moved by ``shift`` steps one way: within a step per value, but a bias."""
    parts = _parts(2)
    shard = reduce_shard(_inputs(parts, how))
    biased = CODEC.encode(shard.fp32 + shift * _steps(shard.fp32))
    got = CODEC.decode(biased, NUMEL) - CODEC.decode(shard.result, NUMEL)
    assert float((got / _steps(shard.fp32)).abs().max()) < 1.0  # each value is less than one step off
    finding = audit_shard(biased, shard.digests, _inputs(parts, how))
    assert _is(finding, FindingKind.WRONG_AGGREGATE), finding
    if how == "robust":
        assert "tolerance of its signed mean" in finding.reason  # type: ignore[union-attr]


def test_the_smallest_bias_caught_is_the_stated_tolerance() -> None:
    parts = _parts(3)
    shard = reduce_shard(_inputs(parts, "robust"))
    for shift, caught in [(0.5 * BIAS_TOL, False), (1.5 * BIAS_TOL, True), (-1.5 * BIAS_TOL, True)]:
        biased = CODEC.encode(shard.fp32 + shift * _steps(shard.fp32))
        assert (audit_shard(biased, shard.digests, _inputs(parts, "robust")) is not None) == caught, shift


def test_a_zero_mean_pattern_of_one_step_changes_is_caught_by_the_rms() -> None:
    """+1 step where the cheater wants up, -1 where it wants down: no bias, but a chosen direction."""
    parts = _parts(4)
    shard = reduce_shard(_inputs(parts, "robust"))
    g = torch.Generator().manual_seed(0)
    pattern = (torch.rand(NUMEL, generator=g) < 2 * RMS_TOL**2).float() * torch.sign(torch.randn(NUMEL, generator=g))
    x = shard.fp32 + pattern * _steps(shard.fp32)
    finding = audit_shard(CODEC.encode(x), shard.digests, _inputs(parts, "robust"))
    assert _is(finding, FindingKind.WRONG_AGGREGATE) and "tolerance of its rms" in finding.reason  # type: ignore[union-attr]
    few = torch.zeros(NUMEL)
    few[[10, 2000, 4500]] = 1.0  # a few boundary values one code away, as honest jitter makes them
    ok = CODEC.encode(shard.fp32 + few * _steps(shard.fp32))
    assert audit_shard(ok, shard.digests, _inputs(parts, "robust")) is None


@pytest.mark.parametrize("shift", [3.0, -5.0, 50.0])
def test_wrong_aggregate_is_caught(shift: float) -> None:
    parts = _parts(5)
    shard = reduce_shard(_inputs(parts, "robust"))
    wrong = CODEC.encode(shard.fp32 + shift * _steps(shard.fp32))
    finding = audit_shard(wrong, shard.digests, _inputs(parts, "robust"))
    assert _is(finding, FindingKind.WRONG_AGGREGATE), finding


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_one_value_one_step_off(how: str) -> None:
    """``mean`` is audited on exact bytes: one code one step away is a wrong aggregate. ``robust``
    allows a few values on a rounding boundary, but not a targeted change of several steps."""
    parts = _parts(6)
    shard = reduce_shard(_inputs(parts, how))
    codes = bytearray(shard.result)
    at = 8 * 5 + 4321  # 5 chunks: 5 scales and 5 offsets of 4 bytes, then one int8 code per value
    codes[at] = (codes[at] + 1) % 256 if codes[at] != 127 else 126
    finding = audit_shard(bytes(codes), shard.digests, _inputs(parts, how))
    if how == "mean":
        assert _is(finding, FindingKind.WRONG_AGGREGATE) and "mean result differs" in finding.reason  # type: ignore[union-attr]
    else:
        assert finding is None
        x = shard.fp32.clone()
        x[4321] += 4 * float(_steps(x)[4321])
        assert _is(audit_shard(CODEC.encode(x), shard.digests, _inputs(parts, how)), FindingKind.WRONG_AGGREGATE)


def test_a_mean_result_a_few_ulps_away_is_a_wrong_aggregate() -> None:
    parts = _parts(7)
    shard = reduce_shard(_inputs(parts, "mean"))
    jittered = CODEC.encode(shard.fp32 * (1 + 3e-7))
    assert jittered != shard.result
    assert _is(audit_shard(jittered, shard.digests, _inputs(parts, "mean")), FindingKind.WRONG_AGGREGATE)


def test_parts_that_differ_make_the_shard_unverifiable_without_blaming_the_reducer() -> None:
    parts = _parts(8)
    shard = reduce_shard(_inputs(parts, "mean"))
    auditors_copy = {**parts, "c": CODEC.encode(torch.ones(NUMEL))}  # "c" sent the two something different
    finding = audit_shard(shard.result, shard.digests, _inputs(auditors_copy, "mean"))
    assert _is(finding, FindingKind.UNVERIFIABLE) and "c" in finding.reason  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", ["nan_scale", "wrong_length"])
def test_invalid_parts_are_left_out_alike_by_reducer_and_auditor(bad: str) -> None:
    parts = _parts(9)
    invalid = {}
    if bad == "nan_scale":  # decodes to an error on both sides
        parts["b"] = b"\x00\x00\xc0\x7f" + parts["b"][4:]
    else:  # refused on arrival by both
        invalid = {"b": "wrong length"}
    shard = reduce_shard(_inputs(parts, "robust", invalid))
    assert set(shard.excluded) == {"b"}
    assert (shard.digests[1] == "") == (bad == "wrong_length")
    assert audit_shard(shard.result, shard.digests, _inputs(parts, "robust", invalid)) is None


def test_no_majority_of_valid_parts_fails_the_shard() -> None:
    parts = _parts(10)
    invalid = {"a": "x", "b": "y"}
    with pytest.raises(RoundFailed) as e:
        reduce_shard(_inputs(parts, "mean", invalid))
    assert set(e.value.excluded) == {"a", "b"}
    commits = ["", "", digest(parts["c"]), digest(parts["d"])]
    finding = audit_shard(CODEC.encode(torch.zeros(NUMEL)), commits, _inputs(parts, "mean", invalid))
    assert _is(finding, FindingKind.WRONG_AGGREGATE)


def test_every_member_needs_a_part_or_a_reason() -> None:
    parts = _parts(11)
    del parts["c"]
    with pytest.raises(ValueError, match="'c'"):
        reduce_shard(_inputs(parts, "mean"))


def test_commitments_of_the_wrong_size_are_unverifiable() -> None:
    parts = _parts(12)
    shard = reduce_shard(_inputs(parts, "mean"))
    finding = audit_shard(shard.result, shard.digests[:3], _inputs(parts, "mean"))
    assert _is(finding, FindingKind.UNVERIFIABLE)


def test_malformed_result_is_a_wrong_aggregate() -> None:
    parts = _parts(13)
    shard = reduce_shard(_inputs(parts, "robust"))
    finding = audit_shard(b"\xff\xff\xff\xff" + shard.result[4:], shard.digests, _inputs(parts, "robust"))
    assert _is(finding, FindingKind.WRONG_AGGREGATE) and "malformed" in finding.reason  # type: ignore[union-attr]


def test_probation_gives_newcomers_weight_zero_and_the_auditor_follows_the_claims() -> None:
    parts = _parts(14)
    claims = probation_claims(ORDER, {"d"})
    assert claims == ["d"]
    shard = reduce_shard(_inputs(parts, "mean"), claims)
    assert shard.probation == ["d"] and shard.excluded == {}
    without_d = reduce_shard(_inputs({p: parts[p] for p in "abc"}, "mean", order=ORDER[:3]))
    assert shard.result == without_d.result  # exactly the mean of the others
    assert audit_shard(shard.result, shard.digests, _inputs(parts, "mean"), claims) is None
    # the same result without the claim does not pass: the auditor recomputes with what is claimed
    assert _is(audit_shard(shard.result, shard.digests, _inputs(parts, "mean"), []), FindingKind.WRONG_AGGREGATE)


def test_probation_for_half_the_group_or_more_is_neither_claimed_nor_accepted() -> None:
    assert probation_claims(ORDER, {"a", "b"}) == []  # no established majority: equal weights
    assert probation_claims(ORDER, {"a", "zz"}) == ["a"]
    parts = _parts(15)
    shard = reduce_shard(_inputs(parts, "mean"), ["a", "b"])  # a cheater claiming two
    finding = audit_shard(shard.result, shard.digests, _inputs(parts, "mean"), ["a", "b"])
    assert _is(finding, FindingKind.WRONG_AGGREGATE) and "probation" in finding.reason  # type: ignore[union-attr]
    for bad in (["a", "a"], ["x"]):
        assert audit_shard(shard.result, shard.digests, _inputs(parts, "mean"), bad) is not None


def test_finding_reasons_are_one_bounded_line_and_inputs_are_checked() -> None:
    f = Finding(FindingKind.UNVERIFIABLE, "x\ny " * 200)
    assert len(f.reason) == MAX_REASON and "\n" not in f.reason and f.reason.endswith("...")
    assert FindingKind.WRONG_AGGREGATE.value == "wrong aggregate" and FindingKind.UNVERIFIABLE.value == "unverifiable"
    with pytest.raises(ValueError, match="median-of-means"):
        ShardInputs({}, {}, ORDER, NUMEL, CODEC, "median-of-means")


def test_fp32_codec_audits_too() -> None:
    fp32 = get_codec("fp32", 1024)
    g = torch.Generator().manual_seed(16)
    parts = {p: fp32.encode(torch.randn(NUMEL, generator=g)) for p in ORDER}
    inputs = ShardInputs(parts, {}, ORDER, NUMEL, fp32, "robust")
    shard = reduce_shard(inputs)
    assert audit_shard(shard.result, shard.digests, inputs) is None
    assert audit_shard(fp32.encode(shard.fp32 * (1 + 3e-7)), shard.digests, inputs) is None
    assert _is(audit_shard(fp32.encode(shard.fp32 + 1e-3), shard.digests, inputs), FindingKind.WRONG_AGGREGATE)
