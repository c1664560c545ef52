"""A reducer's work on one shard, and the auditor's check of it. Pure: bytes in, bytes out.

Every part of shard k goes to its reducer (member k of the group order) and to its auditor (member
k + 1). The reducer validates the parts, combines the valid ones (peer/averaging/aggregation.py),
re-encodes the result once and sends it to every member together with a commitment: the digest of
every part as it received it. The auditor holds its own copies of the same parts, so it can check that

1. the parts it received are the ones the reducer committed to (a mismatch means that a member sent
   different bytes to the two, or that the reducer misreports what it got: the shard cannot be
   verified and is void, nobody is blamed on one side's word), and
2. recomputing the shard from those parts gives the reducer's result:
   - ``mean``: the very same bytes. The mean is elementwise fp32 adds in the group's order and one
     multiply, and the codec is deterministic (C kernel and reference bit-identical, no FMA), so any
     difference is a wrong aggregate;
   - ``robust``: norms, medians and means over the stack may round differently on another CPU, so
     the auditor compares per chunk of the codec, in units of that chunk's quantization step, and
     bounds three things (:data:`VALUE_TOL`, :data:`BIAS_TOL`, :data:`RMS_TOL`): every value (a value on
     a rounding boundary may land one code away), the signed mean error (honest jitter averages to
     zero; a cheater's shift points one way and would build up through momentum), and the mean
     squared error (a zero-mean pattern of one-step changes in a chosen direction).

Sybil brake: the reducer gives weight 0 to members it never completed a round with (probation),
names them in its result, and the auditor recomputes with the same claims (bounded, see
:func:`audit_shard`).

A reducer that fails (2) returned a wrong aggregate: the shard is void for the round and the auditor
never groups with it again.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.kernels.sparse import LEVELS as SPARSE_LEVELS
from hivetrain.peer.averaging.aggregation import AGGREGATIONS, OUTLIER, aggregate, outliers
from hivetrain.peer.errors import RoundFailed

DIGEST_HEX = 32  # hex characters of a part digest (128 bits of SHA-256)
MAX_REASON = 280  # characters of a Finding's reason

# Robust audit thresholds, per chunk, in units of the chunk's quantization step (int8: (max - min) / 255
# of the auditor's recomputed chunk; sparse: its largest magnitude / 127; fp32: FP32_STEP x the
# chunk's largest magnitude). Sparse results: the signed mean and rms are over the positions either
# result fills (a chunk is mostly zeros, which would dilute them), and results are compared decoded, so
# which near-zero positions fill a result's spare slots does not matter.
# Honest jitter, measured with `python -m bench.robust --jitter` (3-16 members, two honest models, int8
# chunks of 4096 and 65536, fp32; 2 threads): recomputing with the parts in reverse order, with float64
# norms, all in float64, or on 1 thread moved a value by at most 1.0 step (a value on a rounding
# boundary one code away), the signed mean by at most 9.8e-4 step and the rms by at most 0.032 step
# (at most 0.1 % of a chunk's values one code away), before the ALLOWED_FLIPS allowance; no audit
# failed. (With torch's one-pass fp32 vector_norm instead of aggregation.row_norms the same
# recomputations moved the signed mean by up to 0.067 step and the rms by 0.26: hence row_norms.)
# A shift of s steps moves the signed mean by s: BIAS_TOL catches s > 0.03 step (+ 2 / L in a chunk of
# L values), 30x the honest jitter and 8x below a quarter step. Moving a fraction k of a chunk's values by one step gives an rms
# of sqrt(k): RMS_TOL catches k >= 6.25 %, 8x the honest rms (60x the fraction).
VALUE_TOL = 1.05  # a rounding-boundary value is one step off, plus float slack
BIAS_TOL = 0.03
RMS_TOL = 0.25
ALLOWED_FLIPS = 2  # however short the chunk, this many values may be one step off (a 1-value tail chunk)
FP32_STEP = 2.0**-16  # fp32 codec: the unit is this fraction of the chunk's largest magnitude


class FindingKind(enum.Enum):
    WRONG_AGGREGATE = "wrong aggregate"  # the reducer's result is not what its committed parts give
    UNVERIFIABLE = "unverifiable"  # the parts differ between reducer and auditor: nobody blamed


@dataclass(frozen=True)
class Finding:
    """What an audit found wrong. ``reason`` is made one line of at most MAX_REASON characters."""

    kind: FindingKind
    reason: str

    def __post_init__(self) -> None:
        text = " ".join(str(self.reason).split())
        if len(text) > MAX_REASON:
            text = text[: MAX_REASON - 3] + "..."
        object.__setattr__(self, "reason", text)


@dataclass(frozen=True)
class ShardInputs:
    """What a reducer or an auditor holds of one shard. ValueError on an unknown ``how``."""

    received: Mapping[str, bytes]  # member -> its part as received (right length)
    invalid: Mapping[str, str]  # member -> why its part was refused on arrival
    order: Sequence[str]  # the group's fixed order
    numel: int  # values in this shard
    codec: Codec
    how: str  # "mean" or "robust"

    @property
    def result_codec(self) -> Codec:
        """How the reducer encodes the combination (kernels/int8.py Codec.for_results)."""
        return self.codec.for_results(len(self.order))

    def __post_init__(self) -> None:
        if self.how not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.how!r}; choose one of {AGGREGATIONS}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:DIGEST_HEX]


def result_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Shard:
    result: bytes  # the re-encoded combination of the valid parts
    fp32: torch.Tensor  # (numel,) the combination before re-encoding
    excluded: dict[str, str]  # member -> why its part was left out (invalid or an outlier)
    digests: list[str]  # per member in group order: digest of the part as received, "" if none arrived
    probation: list[str]  # members whose valid parts had weight 0 (Sybil brake, see probation_claims)


def part_digests(received: Mapping[str, bytes], invalid: Mapping[str, str], order: Sequence[str]) -> list[str]:
    """Per member in group order: the digest of its part as received, "" where none arrived valid."""
    return [digest(received[p]) if p in received and p not in invalid else "" for p in order]


def probation_claims(order: Sequence[str], candidates: Collection[str]) -> list[str]:
    """The members the reducer puts on probation: ``candidates`` (peers it never completed a round
    with), in group order, unless they are half the group or more: probation dilutes newcomers among
    established peers; without such a majority it would hand the shard to a few (and the auditor
    refuses claims for half the group or more, so a reducer cannot drop an honest majority)."""
    claims = [p for p in order if p in candidates]
    return claims if 2 * len(claims) < len(order) else []


def reduce_shard(inputs: ShardInputs, probation: Collection[str] = (), digests: list[str] | None = None) -> Shard:
    """Combines the members' parts of one shard (``inputs``; any thread).

    Valid parts of ``probation`` members get weight 0 (are left out) unless that would leave
    nothing. ``digests``: the parts' digests when the caller has them already (:func:`part_digests`).
    Every member of ``inputs.order`` must be in ``received`` or ``invalid`` (ValueError otherwise).
    Raises RoundFailed if half or more of the parts are invalid (no majority left to combine)."""
    decoded: dict[str, torch.Tensor] = {}  # member -> (numel,) fp32
    excluded: dict[str, str] = {}
    for peer in inputs.order:
        if peer in inputs.invalid:
            excluded[peer] = inputs.invalid[peer]
            continue
        if peer not in inputs.received:
            raise ValueError(f"no part of {peer!r} in the shard inputs: every member needs a part or a reason")
        try:
            decoded[peer] = inputs.codec.decode(inputs.received[peer], inputs.numel)
        except CodecError as err:
            excluded[peer] = f"invalid part: {err}"[:200]
    if inputs.how == "robust":
        peers = list(decoded)
        for i in outliers([decoded[p] for p in peers]):
            excluded[peers[i]] = f"part norm more than {OUTLIER:g}x the group median"
            del decoded[peers[i]]
    if 2 * len(decoded) <= len(inputs.order) and excluded:
        raise RoundFailed(f"only {len(decoded)} of {len(inputs.order)} parts are valid", excluded)
    on_probation = [p for p in decoded if p in probation]
    if len(on_probation) < len(decoded):
        for p in on_probation:
            del decoded[p]
    else:
        on_probation = []
    combined = aggregate(list(decoded.values()), inputs.how)  # (numel,) fp32
    if digests is None:
        digests = part_digests(inputs.received, inputs.invalid, inputs.order)
    return Shard(inputs.result_codec.encode(combined), combined, excluded, digests, on_probation)


def audit_shard(result: bytes, committed: Sequence[str], inputs: ShardInputs,
                probation: Sequence[str] = (), recomputed: Shard | None = None) -> Finding | None:
    """The auditor's check of a reducer's ``result`` for one shard; None if it holds (any thread).

    ``committed`` are the reducer's part digests (in group order) and ``probation`` the members it
    says it gave weight 0; ``inputs`` are the auditor's own copies of the parts. Probation is the
    reducer's own history, which the auditor cannot know: it accepts the claims when they are
    distinct members of the group and fewer than half of it. ``mean`` must match byte for byte;
    ``robust`` within the module's per-chunk tolerances (see the module doc). ``recomputed``: our
    ``reduce_shard`` of exactly these inputs with exactly this ``probation``, done ahead (the
    caller vouches for that); else it is recomputed here."""
    order = inputs.order
    if len(committed) != len(order):
        return Finding(FindingKind.UNVERIFIABLE, f"{len(committed)} part digests for a group of {len(order)}")
    if len(set(probation)) != len(probation) or not set(probation) <= set(order) or 2 * len(probation) >= len(order):
        return Finding(FindingKind.WRONG_AGGREGATE, f"probation claimed for {len(probation)} of {len(order)} members")
    mine = part_digests(inputs.received, inputs.invalid, order)
    differ = [p for p, a, b in zip(order, mine, committed, strict=True) if a != b]
    if differ:
        return Finding(FindingKind.UNVERIFIABLE, f"parts of {', '.join(differ)} differ between reducer and auditor")
    try:
        expected = recomputed if recomputed is not None else reduce_shard(inputs, probation, mine)
    except RoundFailed:
        return Finding(FindingKind.WRONG_AGGREGATE, "the committed parts leave no valid majority, yet a result was sent")
    if result == expected.result:
        return None
    try:
        got = inputs.result_codec.decode(result, inputs.numel)  # (numel,) fp32
    except CodecError as err:
        return Finding(FindingKind.WRONG_AGGREGATE, f"malformed result ({err})")
    off = chunk_errors(got, inputs.result_codec.decode(expected.result, inputs.numel), expected.fp32,
                       inputs.result_codec)
    where = (f"worst value {off.worst_value:.3g} steps, signed mean {off.worst_bias:+.3g}, "
             f"rms {off.worst_rms:.3g} (chunks {off.value_chunk}, {off.bias_chunk}, {off.rms_chunk})")
    if inputs.how == "mean":
        return Finding(FindingKind.WRONG_AGGREGATE, f"mean result differs from the recomputed bytes: {where}")
    failing = off.failing()
    if failing:
        return Finding(FindingKind.WRONG_AGGREGATE, f"robust result beyond the audit tolerance of its {', '.join(failing)}: {where}")
    return None


@dataclass(frozen=True)
class ChunkErrors:
    """The worst chunk of each robust-audit statistic, in quantization steps (see the module doc).
    ``*_chunk`` is that chunk's index; bias and rms are already net of the ALLOWED_FLIPS allowance."""

    worst_value: float
    value_chunk: int
    worst_bias: float  # signed: the chunk whose |mean error| is largest beyond the allowance
    bias_chunk: int
    worst_rms: float
    rms_chunk: int

    def failing(self) -> list[str]:
        """The statistics beyond their tolerance: "value", "signed mean", "rms" (empty: it passes)."""
        return [name for name, bad in (("value", not self.worst_value <= VALUE_TOL),
                                       ("signed mean", not abs(self.worst_bias) <= BIAS_TOL),
                                       ("rms", not self.worst_rms <= RMS_TOL)) if bad]


def chunk_errors(got: torch.Tensor, expected: torch.Tensor, expected_fp32: torch.Tensor, codec: Codec) -> ChunkErrors:
    """Per-chunk errors of ``got`` against ``expected`` (both decoded, (numel,) fp32), in units of the
    chunk's quantization step computed from ``expected_fp32`` (the auditor's combination before
    encoding). A chunk of L values may hold ALLOWED_FLIPS one-step values for free: its mean and
    mean square are reduced by ALLOWED_FLIPS / L before the tolerances apply."""
    numel = expected.numel()
    chunk = codec.chunk_size
    n_chunks = max(1, -(-numel // chunk))
    pad = n_chunks * chunk - numel

    def rows(t: torch.Tensor) -> torch.Tensor:  # (n_chunks, chunk), zero padded
        return torch.nn.functional.pad(t.double(), (0, pad)).view(n_chunks, chunk)

    lengths = torch.full((n_chunks,), float(chunk), dtype=torch.float64)  # (n_chunks,)
    lengths[-1] = numel - (n_chunks - 1) * chunk if numel else 1.0
    x = rows(expected_fp32)
    magnitude = x.abs().amax(dim=1)  # (n_chunks,)
    if codec.name == "int8":  # padding zeros must not widen the last chunk's range
        last = int(lengths[-1])
        lo, hi = x.amin(dim=1), x.amax(dim=1)
        if last < chunk and numel:
            lo[-1], hi[-1] = x[-1, :last].min(), x[-1, :last].max()
        step = (hi - lo) / 255.0
    elif codec.name == "sparse":  # symmetric: max |x| / 127
        step = magnitude / float(SPARSE_LEVELS)
    else:
        step = FP32_STEP * magnitude
    step = step + 2.0**-20 * magnitude + 1e-30  # a constant chunk (range 0) still has float slack
    g, r = rows(got), rows(expected)
    e = (g - r) / step[:, None]  # (n_chunks, chunk) in steps (float64: no overflow)
    if codec.name == "sparse":  # the statistics are over the positions either side fills, not the zeros around
        lengths = ((g != 0) | (r != 0)).sum(dim=1).double().clamp_min(1.0)
    value = e.abs().amax(dim=1)  # (n_chunks,)
    allow = ALLOWED_FLIPS / lengths  # (n_chunks,)
    mean = e.sum(dim=1) / lengths
    bias = mean.sign() * (mean.abs() - allow).clamp_min(0.0)
    rms = ((e * e).sum(dim=1) / lengths - allow).clamp_min(0.0).sqrt()
    vi, bi, ri = int(value.argmax()), int(bias.abs().argmax()), int(rms.argmax())
    return ChunkErrors(float(value[vi]), vi, float(bias[bi]), bi, float(rms[ri]), ri)
