"""The sparse codec (kernels/sparse.py): what it keeps, its exact wire layout, what it refuses, the
reducers' result codec, error feedback over rounds, and the audit of a sparse shard."""

from __future__ import annotations

import struct

import pytest
import torch

from hivetrain.kernels import sparse
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec, get_codec
from hivetrain.peer.averaging.reduce import FindingKind, ShardInputs, audit_shard, reduce_shard

CODEC = get_codec("sparse")
CHUNK, K = sparse.SPARSE_CHUNK, sparse.SPARSE_K
NUMEL = 2 * CHUNK + 1000  # two whole chunks and a short one


def _x(seed: int = 0, numel: int = NUMEL) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g)


def test_keeps_the_k_largest_of_every_chunk_rounded_to_a_127th_of_the_largest() -> None:
    x = _x()
    payload = CODEC.encode(x)
    assert len(payload) == CODEC.encoded_nbytes(NUMEL) == 4 * 3 + 3 * 3 * K
    y = CODEC.decode(payload, NUMEL)
    for start in range(0, NUMEL, CHUNK):
        c, d = x[start : start + CHUNK], y[start : start + CHUNK]
        top = c.abs().topk(K).indices
        assert set(d.nonzero()[:, 0].tolist()) == set(top.tolist())
        step = float(c.abs().max()) / 127
        assert float((d[top] - c[top]).abs().max()) <= 0.5 * step * (1 + 1e-6)
    assert torch.equal(CODEC.decode(CODEC.encode(y), NUMEL), y)  # a decoded vector re-encodes to itself


def test_the_wire_layout_is_scales_then_codes_then_uint16_indices() -> None:
    x = torch.zeros(10)
    x[3], x[7] = -2.0, 1.0
    payload = get_codec("sparse", 8, 2).encode(x)  # chunks of 8 and 2; two values kept in each
    scales = struct.unpack("<2f", payload[:8])
    codes = struct.unpack("<4b", payload[8:12])
    index = struct.unpack("<4H", payload[12:])
    assert scales == (struct.unpack("<f", struct.pack("<f", 2.0 / 127))[0], 0.0)
    assert codes == (-127, 64, 0, 0) and index == (3, 7, 0, 1)  # 1 / (2 / 127) = 63.5: half to even


def test_ties_go_to_the_lower_index_on_every_machine() -> None:
    x = torch.ones(3 * CHUNK)
    x[CHUNK + 5] = 2.0
    y = CODEC.decode(CODEC.encode(x), x.numel())
    assert y[:CHUNK].nonzero()[:, 0].tolist() == list(range(K))
    assert y[CHUNK : 2 * CHUNK].nonzero()[:, 0].tolist() == list(range(K))  # the 2.0 at 5 and 63 ties
    zeros = CODEC.decode(CODEC.encode(torch.zeros(NUMEL)), NUMEL)
    assert not zeros.any()


def test_short_vectors_and_a_k_larger_than_the_tail() -> None:
    for numel in (0, 1, 63, 64, 65, CHUNK, CHUNK + 1):
        x = _x(numel, numel)
        x = x.sign() * (1.0 + x.abs())  # no value rounds to code 0
        y = CODEC.decode(CODEC.encode(x), numel)
        assert len(CODEC.encode(x)) == CODEC.encoded_nbytes(numel)
        assert int((y != 0).sum()) == min(numel, K) + min(max(0, numel - CHUNK), K), numel


def _corrupt(payload: bytes, offset: int, fmt: str, value: float | int) -> bytes:
    bad = bytearray(payload)
    struct.pack_into(fmt, bad, offset, value)
    return bytes(bad)


def test_malformed_payloads_are_refused() -> None:
    payload = CODEC.encode(_x())
    n, values = 3, 3 * K
    codes, index = 4 * n, 4 * n + values
    bad = {
        "short": payload[:-1],
        "long": payload + b"\0",
        "nan scale": _corrupt(payload, 0, "<f", float("nan")),
        "negative scale": _corrupt(payload, 4, "<f", -1.0),
        "huge scale": _corrupt(payload, 8, "<f", 1e37),
        "code -128": _corrupt(payload, codes + 5, "<b", -128),
        "index out of its chunk": _corrupt(payload, index + 2 * (values - 1), "<H", 1000),
        "repeated index": _corrupt(payload, index + 2, "<H", struct.unpack_from("<H", payload, index)[0]),
        "decreasing index": _corrupt(payload, index, "<H", CHUNK - 1),
    }
    for what, p in bad.items():
        with pytest.raises(CodecError):
            CODEC.decode(p, NUMEL)
        acc = torch.ones(NUMEL)
        with pytest.raises(CodecError):
            CODEC.decode_accumulate(p, NUMEL, acc)
        assert torch.equal(acc, torch.ones(NUMEL)), what


def test_encode_refuses_what_is_not_a_finite_fp32_vector() -> None:
    for x in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]), torch.zeros(2, 2),
              torch.zeros(3, dtype=torch.float64)):
        with pytest.raises(ValueError):
            CODEC.encode(x)
    for chunk, k in ((0, 1), (1 << 17, 1), (8, 9), (8, -1), (8, 0)):
        with pytest.raises(CodecError):
            get_codec("sparse", chunk, k)
    with pytest.raises(CodecError, match="sparse"):
        get_codec("int8", 1024, 64)
    assert get_codec("sparse", k=128) == Codec("sparse", CHUNK, 128) and get_codec("sparse", 1024).k == K


def test_results_have_room_for_every_part_else_are_dense_int8() -> None:
    assert CODEC.for_results(1) == CODEC
    assert CODEC.for_results(4) == Codec("sparse", CHUNK, 4 * K)
    assert CODEC.for_results(21).name == "sparse" and CODEC.for_results(22).name == "int8"
    assert get_codec("int8").for_results(8) == get_codec("int8")
    for members in (2, 5, 8):  # the mean of the parts: every part's values survive, each within half a step
        parts = [CODEC.decode(CODEC.encode(_x(s)), NUMEL) for s in range(members)]
        mean = torch.stack(parts).mean(0)
        codec = CODEC.for_results(members)
        got = codec.decode(codec.encode(mean), NUMEL)
        assert not bool(((got != 0) & (mean == 0)).any())
        for start in range(0, NUMEL, CHUNK):
            step = float(mean[start : start + CHUNK].abs().max()) / 127
            assert float((got - mean)[start : start + CHUNK].abs().max()) <= 0.5 * step * (1 + 1e-6)


def test_error_feedback_sends_what_top_k_left_out_in_later_rounds() -> None:
    """A constant delta: without feedback the same 64 positions per chunk are all that is ever sent;
    with it every position is sent in turn and the sum sent tracks the sum of deltas."""
    numel, rounds = CHUNK, 1024
    delta = 0.01 + 0.001 * _x(1, numel).abs()
    ef = ErrorFeedback(numel)
    sent_ef, sent_plain = torch.zeros(numel), torch.zeros(numel)
    for _ in range(rounds):
        to_send = ef.compensate(delta)
        decoded = CODEC.decode(CODEC.encode(to_send), numel)
        ef.sent(to_send, decoded)
        ef.commit()
        sent_ef += decoded
        sent_plain += CODEC.decode(CODEC.encode(delta), numel)
    true = delta * rounds
    assert int((sent_plain != 0).sum()) == K
    assert bool((sent_ef != 0).all())
    assert torch.allclose(sent_ef + ef.residual, true, rtol=1e-4)  # nothing lost: the rest is still to send
    assert float((sent_ef - true).norm() / true.norm()) < 0.1
    assert float((sent_plain - true).norm() / true.norm()) > 0.9


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_a_sparse_shard_is_audited_like_an_int8_one(how: str) -> None:
    order = ("a", "b", "c", "d")
    parts = {p: CODEC.encode(_x(i) * (1 + i)) for i, p in enumerate(order)}
    inputs = ShardInputs(parts, {}, order, NUMEL, CODEC, how)
    shard = reduce_shard(inputs)
    result_codec = CODEC.for_results(len(order))
    assert len(shard.result) == result_codec.encoded_nbytes(NUMEL)
    assert audit_shard(shard.result, shard.digests, inputs) is None
    decoded = result_codec.decode(shard.result, NUMEL)
    filled = decoded != 0
    step = torch.zeros(NUMEL)
    for start in range(0, NUMEL, CHUNK):
        step[start : start + CHUNK] = float(shard.fp32[start : start + CHUNK].abs().max()) / 127
    # a cheater moving only the values the result holds, by half a step one way: a bias over those values
    half = result_codec.encode(torch.where(filled, shard.fp32 + 0.5 * step, shard.fp32))
    finding = audit_shard(half, shard.digests, inputs)
    assert finding is not None and finding.kind is FindingKind.WRONG_AGGREGATE, finding
    # a cheater filling spare slots with new values
    extra = shard.fp32.clone()
    extra[~filled] = 0.0
    spare = (~filled).nonzero()[:100, 0]
    extra[spare] = step[spare] * 40
    finding = audit_shard(result_codec.encode(extra), shard.digests, inputs)
    assert finding is not None and finding.kind is FindingKind.WRONG_AGGREGATE, finding


def test_the_run_spec_names_the_codec_and_whether_peers_keep_a_residual() -> None:
    from hivetrain.peer.config import RunSpec

    spec = RunSpec("r", compression="sparse", sparse_k=128)
    assert spec.codec() == Codec("sparse", CHUNK, 128) and spec.carries_residual
    assert RunSpec("r").codec() == get_codec("int8", 65536) and not RunSpec("r").carries_residual
    assert RunSpec("r", error_feedback=True).carries_residual
    assert not RunSpec("r", compression="fp32", error_feedback=True).carries_residual
