"""Fixtures the training-loop unit tests share: a tiny model and a synthetic corpus."""

from __future__ import annotations

import pytest
import torch

from hivetrain.peer.config import ModelConfig
from hivetrain.peer.train.data import Corpus, split_documents

TINY = ModelConfig(256, 16, 1, 2, 32, 16)  # a few thousand parameters: a Trainer in milliseconds


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    gen = torch.Generator().manual_seed(0)
    docs = [bytes(torch.randint(97, 123, (300,), generator=gen).tolist()) for _ in range(20)]
    return split_documents(docs, "synthetic", min_tokens=64)
