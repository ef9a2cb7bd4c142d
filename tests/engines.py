"""Engines the tests build on the tiny random model."""

from __future__ import annotations

from infer.engine.engine import Engine, EngineConfig
from infer.model.llama import Llama


def tiny_engine(model: Llama, **overrides) -> Engine:
    config = dict(max_num_seqs=4, max_prefill_tokens=16, max_model_len=64, page_size=4)
    config.update(overrides)
    return Engine(model, None, EngineConfig(**config))
