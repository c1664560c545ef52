"""Hugging Face models in a run (peer/train/hf.py, peer/config.py): the spec's architecture, start and
tokenizer are checked; the model trains through the same interface and loss as the built-in one;
the corpus is tokenized alike everywhere; JSON-lines and Parquet data come through ``datasets``."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from hivetrain.peer.config import RunSpec, hf_summary
from hivetrain.peer.errors import ConfigError, DataError
from hivetrain.peer.train import hf
from hivetrain.peer.train.data import load_text_files, split_documents
from hivetrain.peer.train.learner import checkpoint_blocks
from tests.hfmodel import make_tiny_hf, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> hf.Source:
    return hf.load_folder(str(make_tiny_hf(tmp_path_factory.mktemp("m") / "model")), say=lambda _: None)


def _spec(source: hf.Source, **kw: object) -> RunSpec:
    fields = dict(name="hf", model=source.summary, hf_config=source.config_json, init_hash=hf.initial_hash(source.model),
                  tokenizer=source.tokenizer_hash, seq_len=32)
    return RunSpec(**{**fields, **kw})  # type: ignore[arg-type]


def test_a_spec_on_a_hf_model_round_trips_and_checks_its_fields(source: hf.Source) -> None:
    spec = _spec(source)
    assert RunSpec.from_dict(spec.to_dict()) == spec
    raw = json.loads(source.config_json)
    for bad, why in (
        (dict(model=dataclasses.replace(source.summary, d_model=64)), "does not match the sizes"),
        (dict(init_hash="x"), "init_hash"),
        (dict(tokenizer="bytes"), "spec.tokenizer"),
        (dict(pretrained="gpt-5"), "spec.pretrained"),
        (dict(hf_config=json.dumps({**raw, "model_type": "bert"})), "model type 'bert' is not supported"),
        (dict(hf_config="{" * 20000), "at most 16384"),
        (dict(hf_config=json.dumps({k: v for k, v in raw.items() if k != "hidden_size"})), "lacks hidden_size"),
    ):
        with pytest.raises(ConfigError, match=why):
            RunSpec.from_dict({**spec.to_dict(), **{k: (dataclasses.asdict(v) if k == "model" else v)
                                                     for k, v in bad.items()}})
    with pytest.raises(ConfigError, match="belong to a Hugging Face model"):
        RunSpec(name="plain", init_hash="0" * 64)


def test_the_canonical_config_ignores_file_details(tmp_path: Path, source: hf.Source) -> None:
    bare = hf.load_folder(str(make_tiny_hf(tmp_path / "bare", weights=False)), say=lambda _: None)
    assert not bare.has_weights and source.has_weights
    assert bare.config_json == source.config_json and bare.tokenizer_hash == source.tokenizer_hash
    assert "transformers_version" not in source.config_json and "architectures" not in source.config_json
    assert hf_summary(source.config_json).vocab_size == 320


def test_the_model_trains_through_the_built_in_interface_with_the_same_loss(source: hf.Source) -> None:
    idx = torch.randint(0, 320, (2, 16))
    y = torch.randint(0, 320, (2, 16))
    logits, loss = source.model(idx, y)
    expected = torch.nn.functional.cross_entropy(source.model.inner(input_ids=idx).logits.view(32, -1), y.view(32))
    assert logits.shape == (2, 16, 320) and loss is not None and torch.allclose(loss, expected)
    assert hf.initial_hash(source.model) == hf.initial_hash(source.model)
    rebuilt = hf.from_config(source.config_json)
    assert [p.shape for p in rebuilt.parameters()] == [p.shape for p in source.model.parameters()]


def test_tokenizing_is_deterministic_and_keeps_the_document_split(source: hf.Source) -> None:
    docs = [f"document {i}: peers train together.\n\nthe quick brown fox {i}".encode() for i in range(30)]
    corpus = split_documents(docs, "t", min_tokens=64)
    a, b = hf.tokenize_corpus(corpus, source, say=lambda _: None), hf.tokenize_corpus(corpus, source, say=lambda _: None)
    assert a.train.dtype == torch.int32 and torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.digest == corpus.digest and a.n_docs_heldout == corpus.n_docs_heldout == 3
    assert source.tokenizer.decode(a.heldout.tolist()) == bytes(corpus.heldout.numpy()).decode()


def test_jsonl_parquet_and_glob_data_read_the_text_field_in_order(tmp_path: Path) -> None:
    docs = [f"row {i} " + "text " * 100 for i in range(40)]
    jl = load_text_files(str(write_jsonl(tmp_path / "d.jsonl", docs)), min_tokens=64)
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "1.parquet", docs[:20])
    write_parquet(tmp_path / "pq" / "2.parquet", docs[20:])
    (tmp_path / "pq" / "notes.bin").write_bytes(b"\0\1")
    pq = load_text_files(str(tmp_path / "pq" / "*.parquet"), min_tokens=64)
    folder = load_text_files(str(tmp_path / "pq"), min_tokens=64)
    assert jl.digest == pq.digest == folder.digest == split_documents([d.encode() for d in docs], "x", 64).digest
    assert pq.n_files == 2 and folder.skipped == (("notes.bin", "binary: NUL bytes"),)


def test_record_files_without_text_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="'text'"):
        load_text_files(str(tmp_path / "a.jsonl"), min_tokens=8)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(DataError, match="row 0's 'text' is a int"):
        load_text_files(str(tmp_path / "b.jsonl"), min_tokens=8)
    (tmp_path / "c.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="cannot read .*c.jsonl as json"):
        load_text_files(str(tmp_path / "c.jsonl"), min_tokens=8)
    with pytest.raises(DataError, match="matches no files"):
        load_text_files(str(tmp_path / "none" / "*.parquet"), min_tokens=8)


def test_tokenized_corpora_are_kept_and_a_damaged_cache_is_redone(tmp_path: Path, source: hf.Source) -> None:
    docs = [f"document {i}: peers train together, the quick brown fox {i}".encode() for i in range(30)]
    corpus = split_documents(docs, "t", min_tokens=64)
    first = hf.tokenize_corpus(corpus, source, lambda _: None, str(tmp_path))
    (cached,) = tmp_path.glob("*.tokens")

    class Refuses:  # the second time, the tokenizer is never called
        backend_tokenizer = source.tokenizer.backend_tokenizer

        def __call__(self, *a: object, **kw: object) -> None:
            raise AssertionError("tokenized again")

    again = hf.tokenize_corpus(corpus, dataclasses.replace(source, tokenizer=Refuses()), lambda _: None, str(tmp_path))
    assert torch.equal(first.train, again.train) and torch.equal(first.heldout, again.heldout)
    data = bytearray(cached.read_bytes())
    data[20] ^= 1  # one flipped bit: the checksum fails, the corpus is tokenized afresh
    cached.write_bytes(bytes(data))
    redone = hf.tokenize_corpus(corpus, source, lambda _: None, str(tmp_path))
    assert torch.equal(first.train, redone.train) and cached.read_bytes() != bytes(data)


def test_a_peer_holds_the_runs_start_exactly_when_its_weights_make_that_state(source: hf.Source) -> None:
    from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts
    from tests.unit.test_trainer_round import Recorder

    docs = [f"document {i}: peers train together, the quick brown fox {i}".encode() for i in range(30)]
    corpus = hf.tokenize_corpus(split_documents(docs, "t", min_tokens=64), source, lambda _: None)
    spec = _spec(source, batch_size=2, sync_every=1, seq_len=16)

    def trainer(model: torch.nn.Module) -> Trainer:
        return Trainer(TrainerParts(spec, "p", corpus, Recorder(), MetricsWriter(None), model=model), eval_batch_count=1,
                       log=lambda _: None)

    assert trainer(source.model).held  # its own folder's weights: the start the spec names
    assert not trainer(hf.from_config(source.config_json)).held  # built from the config alone: another state


def test_activation_checkpointing_of_a_hf_model_gives_the_same_gradient_and_no_warning(source: hf.Source) -> None:
    """The memory plan may choose checkpointing by itself (step 15): a Hugging Face model takes it
    under transformers' current name, silently, and its gradient is unchanged."""
    idx, y = torch.randint(0, 320, (2, 16)), torch.randint(0, 320, (2, 16))
    plain, ckpt = hf.from_config(source.config_json), hf.from_config(source.config_json)
    ckpt.load_state_dict(plain.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint_blocks(ckpt)
    assert getattr(ckpt.inner, "is_activation_checkpointing", None) or ckpt.inner.is_gradient_checkpointing
    for model in (plain, ckpt):
        model.train()
        model(idx, y)[1].backward()
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6)
