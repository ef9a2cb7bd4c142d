"""infer: a JAX/Flax research framework for LLM inference optimization.

The public names load lazily, so host-side modules (scheduler, allocator, prefix cache) can be
imported without paying for JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "infer.llm",
    "SamplingParams": "infer.sampling_params",
    "StructuredOutput": "infer.sampling_params",
    "TokenLogprob": "infer.engine.request",
    "RequestOutput": "infer.engine.request",
    "RequestMetrics": "infer.engine.request",
    "FinishReason": "infer.engine.request",
    "load": "infer.io.loader",
    "LlamaConfig": "infer.model.config",
    "get_config": "infer.model.config",
    "PRESETS": "infer.model.config",
    "Engine": "infer.engine.engine",
    "EngineConfig": "infer.engine.engine",
    "SpeculativeConfig": "infer.spec.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
