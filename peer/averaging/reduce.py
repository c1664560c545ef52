"""A reducer's work on one shard, and the auditor's check of it. Pure: bytes in, bytes out.

Every part of shard k goes to its reducer (member k of the group order) and to its auditor (member
k + 1). The reducer validates the parts, combines the valid ones (peer/aggregation.py), re-encodes
the result once and sends it to every member together with a commitment: the digest of every part
as it received it. The auditor holds its own copies of the same parts, so it can check that

1. the parts it received are the ones the reducer committed to (a mismatch means that a member sent
   different bytes to the two, or that the reducer misreports what it got: the shard cannot be
   verified and is void, nobody is blamed on one side's word), and
2. recomputing the shard from those parts gives the reducer's result: bit-identical bytes, or at most
   one quantization step per chunk away (robust aggregation takes norms and medians whose float
   order may differ between CPUs; a step is the codec's own error, so a cheater gains nothing).

Sybil brake: the reducer gives weight 0 to members it never completed a round with (probation),
names them in its result, and the auditor recomputes with the same claims (bounded, see
:func:`audit_shard`).

A reducer that fails (2) returned a wrong aggregate: the shard is void for the round and the auditor
never groups with it again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.aggregation import OUTLIER, aggregate, outliers
from hivetrain.peer.errors import RoundFailed

DIGEST_HEX = 32  # hex characters of a part digest (128 bits of SHA-256)
WRONG_AGGREGATE = "wrong aggregate"  # the verdict prefix that bans the reducer (see module doc)
UNVERIFIABLE = "unverifiable"  # the verdict prefix for parts that differ between reducer and auditor


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


def reduce_shard(received: Mapping[str, bytes], invalid: Mapping[str, str], order: Sequence[str], numel: int,
                 codec: Codec, how: str, probation: Collection[str] = (), digests: list[str] | None = None) -> Shard:
    """Combines the members' parts of one shard of ``numel`` values.

    ``received`` maps members to the parts that arrived with the right length; ``invalid`` maps
    members whose part was refused on arrival to the reason; valid parts of ``probation`` members
    get weight 0 (are left out) unless that would leave nothing. ``digests``: the parts' digests when
    the caller has them already (:func:`part_digests`). Raises RoundFailed if half or more
    of the parts are invalid (no majority left to combine)."""
    decoded: dict[str, torch.Tensor] = {}
    excluded: dict[str, str] = {}
    for peer in order:
        if peer in invalid:
            excluded[peer] = invalid[peer]
            continue
        try:
            decoded[peer] = codec.decode(received[peer], numel)
        except CodecError as err:
            excluded[peer] = f"invalid part: {err}"[:200]
    if how == "robust":
        peers = list(decoded)
        for i in outliers([decoded[p] for p in peers]):
            excluded[peers[i]] = f"part norm more than {OUTLIER:g}x the group median"
            del decoded[peers[i]]
    if 2 * len(decoded) <= len(order) and excluded:
        raise RoundFailed(f"only {len(decoded)} of {len(order)} parts are valid", excluded)
    on_probation = [p for p in decoded if p in probation]
    if len(on_probation) < len(decoded):
        for p in on_probation:
            del decoded[p]
    else:
        on_probation = []
    combined = aggregate(list(decoded.values()), how)  # (numel,) fp32
    if digests is None:
        digests = part_digests(received, invalid, order)
    return Shard(codec.encode(combined), combined, excluded, digests, on_probation)


def audit_shard(result: bytes, committed: Sequence[str], received: Mapping[str, bytes],
                invalid: Mapping[str, str], order: Sequence[str], numel: int, codec: Codec, how: str,
                probation: Sequence[str] = ()) -> str | None:
    """The auditor's check of a reducer's ``result`` for one shard; None if it holds, else why.

    ``committed`` are the reducer's part digests (in group order) and ``probation`` the members it
    says it gave weight 0; ``received``/``invalid`` are the auditor's own copies of the parts, as for
    :func:`reduce_shard`. Probation is the reducer's own history, which the auditor cannot know:
    it accepts the claims when they are distinct members of the group and fewer than half of it."""
    if len(committed) != len(order):
        return f"{UNVERIFIABLE}: {len(committed)} part digests for a group of {len(order)}"
    if len(set(probation)) != len(probation) or not set(probation) <= set(order) or 2 * len(probation) >= len(order):
        return f"{WRONG_AGGREGATE}: probation claimed for {len(probation)} of {len(order)} members"
    mine = part_digests(received, invalid, order)
    differ = [p for p, a, b in zip(order, mine, committed, strict=True) if a != b]
    if differ:
        return f"{UNVERIFIABLE}: parts of {', '.join(differ)} differ between reducer and auditor"[:300]
    try:
        expected = reduce_shard(received, invalid, order, numel, codec, how, probation, mine)
    except RoundFailed:
        return f"{WRONG_AGGREGATE}: the committed parts leave no valid majority, yet a result was sent"
    if result == expected.result:
        return None
    try:
        got = codec.decode(result, numel)  # (numel,) fp32
    except CodecError as err:
        return f"{WRONG_AGGREGATE}: malformed result ({err})"[:300]
    worst = worst_step_ratio(got, expected.fp32, expected.result, numel, codec)
    if worst > 1.0:
        return f"{WRONG_AGGREGATE}: {worst:.3g} quantization steps from the recomputed shard"
    return None


def worst_step_ratio(got: torch.Tensor, expected: torch.Tensor, expected_bytes: bytes, numel: int,
                     codec: Codec) -> float:
    """Largest |got - expected| in units of the chunk's quantization step (max of the round-trip error
    of ``expected_bytes`` and a float slack), over all chunks. <= 1.0 means "the same up to the codec"."""
    chunk = getattr(codec, "chunk_size", numel) or numel
    roundtrip = codec.decode(expected_bytes, numel)  # (numel,) what encoding the right answer gives
    n_chunks = -(-numel // chunk)
    pad = n_chunks * chunk - numel

    def rows(t: torch.Tensor) -> torch.Tensor:  # (n_chunks, chunk), zero padded
        return torch.nn.functional.pad(t, (0, pad)).view(n_chunks, chunk)

    scale = rows(expected).abs().amax(dim=1)  # (n_chunks,)
    step = 2 * rows(roundtrip - expected).abs().amax(dim=1) + 1e-6 * scale + 1e-30  # (n_chunks,)
    err = rows(got - expected).abs().amax(dim=1)  # (n_chunks,)
    ratio = err / step
    return float(ratio.max()) if bool(torch.isfinite(ratio).all()) else float("inf")
