"""A tiny Llama-architecture Hugging Face model folder, made by a test (random weights, a byte-level
BPE tokenizer trained on the test's own text), saved with ``save_pretrained`` as anyone's would be."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20 + "peers train together and average their work. " * 20)


def make_tiny_hf(folder: Path, weights: bool = True, seed: int = 1234, vocab_size: int = 320) -> Path:
    """config.json, tokenizer files and (``weights``) model.safetensors of a ~30k-parameter Llama. The
    weights are not what ``hf.from_config`` (seed 0) builds from the config alone, as a trained model's
    would not be: a peer without them holds another state and must sync."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if weights:
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, docs: list[str]) -> Path:
    with open(path, "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    return path
