"""infer: a JAX/Flax research framework for LLM inference optimization.

The public names load lazily, so host-side modules (scheduler, allocator, prefix cache) can be
imported without paying for JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "infer.llm",
    "SamplingParams": "infer.sampling",
    "RequestOutput": "infer.request",
    "RequestMetrics": "infer.request",
    "FinishReason": "infer.request",
    "load": "infer.loader",
    "LlamaConfig": "infer.config",
    "get_config": "infer.config",
    "PRESETS": "infer.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
