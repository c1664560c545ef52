"""``peer export``: a run's latest verified checkpoint as a Hugging Face model folder, offline.

A peer keeps, per run, the spec it verified (``checkpoints/<run key>.spec.json``, written when it
joins) and its checkpoint of the outer state (``checkpoints/<run key>.ckpt``, verified against its
hash on read). ``export_run`` turns them into a folder that ``transformers`` loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. A run on a Hugging
Face model (peer/train/hf.py) exports as that model, ``save_pretrained``, with the tokenizer the peer
kept next to its checkpoint (``checkpoints/<run key>.tokenizer/``). A run on the built-in model:

- ``config.json``: a ``LlamaForCausalLM`` with the preset's sizes (untied embeddings, no biases,
  SiLU gate, one key/value head per query head);
- ``model.safetensors``: the master parameters, fp32. Our attention rotates the pairs (2i, 2i+1)
  of each head; Hugging Face's Llama rotates (i, i + head_dim / 2). Permuting the rows of the query
  and key projections per head (even rows first, then odd) makes the two compute the same
  attention scores, so the same logits (to float rounding of the rotary tables);
- ``tokenizer.json`` and friends: a byte-level tokenizer whose token i is byte i, exactly the
  tokenization the built-in presets train on (UTF-8 bytes, vocabulary 256).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch

from hivetrain.dht.identity import parse_run_key
from hivetrain.peer.config import ModelConfig, RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.state import checkpoint
from hivetrain.peer.train.diloco import copy_flat_to_params
from hivetrain.peer.train.model import Block, Llama, count_parameters

SPEC_SUFFIX = ".spec.json"
TOKENIZER_SUFFIX = ".tokenizer"  # a folder: a Hugging Face run's tokenizer, as the peer checked it


def spec_path(ckpt_dir: str, run_key: str) -> str:
    return os.path.join(ckpt_dir, f"{run_key}{SPEC_SUFFIX}")


def save_spec(ckpt_dir: str, run_key: str, spec: RunSpec) -> None:
    """Keeps the run's verified spec next to its checkpoint, so that export needs no network."""
    path = spec_path(ckpt_dir, run_key)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"run_key": run_key, "spec_hash": spec.spec_hash().hex(), "spec": spec.to_dict()}, f)
    os.replace(tmp, path)


def load_spec(ckpt_dir: str, run_key: str) -> RunSpec:
    path = spec_path(ckpt_dir, run_key)
    try:
        with open(path) as f:
            raw = json.load(f)
        spec = RunSpec.from_dict(raw["spec"])
    except FileNotFoundError:
        raise ConfigError(f"no checkpoint of run {run_key} in {os.path.dirname(ckpt_dir)}: train in it first "
                          "(peer start --join ...), or pass the --state-dir it used") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); start the peer again to rewrite it") from None
    if spec.spec_hash().hex() != raw.get("spec_hash"):
        raise ConfigError(f"{path} does not match its recorded spec hash; start the peer again to rewrite it")
    return spec


def hf_config(model: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": model.ffn_hidden, "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_heads,
        "head_dim": model.d_model // model.n_heads, "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def _pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a query/key projection (n_heads * head_dim, C): per head, even rows then odd rows."""
    rows, cols = w.shape
    per_head = w.view(n_heads, rows // n_heads // 2, 2, cols)  # (nh, hd/2, 2, C): pairs (2i, 2i+1)
    return per_head.transpose(1, 2).reshape(rows, cols).contiguous()


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face Llama names (fp32, contiguous, CPU)."""
    c = model.config
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.tok_emb.weight,
                                    "model.norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(cast(list[Block], list(model.blocks))):
        p = f"model.layers.{i}."
        q, k, v = block.attn.wqkv.weight.split(c.d_model, dim=0)  # each (C, C)
        out[p + "self_attn.q_proj.weight"] = _pairs_to_halves(q, c.n_heads)
        out[p + "self_attn.k_proj.weight"] = _pairs_to_halves(k, c.n_heads)
        out[p + "self_attn.v_proj.weight"] = v
        out[p + "self_attn.o_proj.weight"] = block.attn.wo.weight
        out[p + "mlp.gate_proj.weight"] = block.mlp.w1.weight
        out[p + "mlp.up_proj.weight"] = block.mlp.w3.weight
        out[p + "mlp.down_proj.weight"] = block.mlp.w2.weight
        out[p + "input_layernorm.weight"] = block.attn_norm.weight
        out[p + "post_attention_layernorm.weight"] = block.mlp_norm.weight
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}


def write_byte_tokenizer(out: Path, max_len: int) -> None:
    """tokenizer.json: token i is byte i (a byte-level BPE with the 256 byte symbols and no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, GPT-2's mapping
    byte_of = _bytes_to_unicode()
    vocab = {byte_of[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }, indent=1))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character mapping (what ByteLevel pre-tokenization emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_path(ckpt_dir: str, run_key: str) -> str:
    return os.path.join(ckpt_dir, f"{run_key}{TOKENIZER_SUFFIX}")


def save_tokenizer(ckpt_dir: str, run_key: str, tokenizer: Any) -> None:
    """Keeps a Hugging Face run's tokenizer (checked against the spec) next to its checkpoint, for export."""
    tokenizer.save_pretrained(tokenizer_path(ckpt_dir, run_key))


def _export_hf(spec: RunSpec, run_key: str, ckpt_dir: str, out: Path) -> dict[str, Any]:
    """A run on a Hugging Face model: its own architecture and tokenizer, the checkpoint's weights."""
    from transformers import AutoTokenizer

    from hivetrain.peer.train import hf

    model = hf.from_config(spec.hf_config)
    numel = count_parameters(model)
    snapshot = checkpoint.read(os.path.join(ckpt_dir, f"{run_key}.ckpt"), numel)
    if snapshot is None:
        raise ConfigError(f"run {run_key} has a spec but no checkpoint in {ckpt_dir}: it never finished a round here")
    folder = tokenizer_path(ckpt_dir, run_key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer of run {run_key} is missing from {folder} ({e}); start the peer again") from None
    if hf.tokenizer_hash(tokenizer) != spec.tokenizer:
        raise ConfigError(f"the tokenizer in {folder} is not run {run_key}'s; start the peer again to rewrite it")
    flat = torch.frombuffer(bytearray(snapshot.data), dtype=torch.float32)[:numel]
    with torch.no_grad():
        copy_flat_to_params(flat, model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    cast(Any, model.inner).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "hivetrain.json").write_text(json.dumps({"run_key": run_key, "round": snapshot.round,
                                                    "state_hash": snapshot.hash}, indent=1))
    return {"out": str(out), "round": snapshot.round, "state_hash": snapshot.hash, "parameters": numel}


def export_run(run_key: str, state_dir: str, out_dir: str) -> dict[str, Any]:
    """Writes the folder (see the module doc); returns what it wrote. Raises ConfigError (one line: the CLI exits 2).
    The key names files in the state folder, so it must be a run key (no ``/`` or ``..``) before
    anything is opened; keys are case-insensitive, as everywhere."""
    run_key = run_key.strip().lower() if isinstance(run_key, str) else run_key
    try:
        parse_run_key(run_key)
    except ValueError as e:
        raise ConfigError(f"--run: {e}") from None
    ckpt_dir = os.path.join(os.path.expanduser(state_dir), "checkpoints")
    spec = load_spec(ckpt_dir, run_key)
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: pass a new folder")
    if spec.hf_config:
        return _export_hf(spec, run_key, ckpt_dir, out)
    with torch.device("meta"):
        numel = count_parameters(Llama(spec.model))
    snapshot = checkpoint.read(os.path.join(ckpt_dir, f"{run_key}.ckpt"), numel)
    if snapshot is None:
        raise ConfigError(f"run {run_key} has a spec but no checkpoint in {ckpt_dir}: it never finished a round here")
    from safetensors.torch import save_file

    model = Llama(spec.model)
    flat = torch.frombuffer(bytearray(snapshot.data), dtype=torch.float32)[:numel]  # the master parameters
    with torch.no_grad():
        copy_flat_to_params(flat, model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec.model), indent=1))
    save_file(hf_state_dict(model), str(out / "model.safetensors"),
              metadata={"format": "pt", "run_key": run_key, "round": str(snapshot.round), "state_hash": snapshot.hash})
    write_byte_tokenizer(out, spec.model.max_seq_len)
    return {"out": str(out), "round": snapshot.round, "state_hash": snapshot.hash, "parameters": numel}
