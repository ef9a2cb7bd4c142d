"""KV-cache memory accounting for real model configs: bytes per token, GQA saving, and how many
tokens and users fit beside the weights on a set of GPUs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from infer.cache import kivi
from infer.model.config import LlamaConfig
from kernels_pallas.kv_quant import KV_FORMAT_ALIASES, bytes_per_token_per_head, resolve_kv_format

GB = 1e9  # GPU memory is sold in decimal gigabytes (A100-80GB: 80e9 bytes)


KIVI_PAGE_SIZE = 32  # int4_kivi's page in the budget: its keys' codes cost 2 D / G per token


def kv_format_name(kv_format: str) -> str:
    """The canonical name of a KV format or alias (the kernels' one table)."""
    return resolve_kv_format(kv_format, page_formats=True)


def kv_bytes_per_token(config: LlamaConfig, kv_format: str = "bfloat16",
                       include_scales: bool = True, page_size: int = KIVI_PAGE_SIZE) -> int:
    """Bytes one token's keys and values take over all layers (2 * L * K * D * bytes, plus the
    quantization scales unless include_scales is False). int4_kivi's depend on the page size
    (its keys' codes are per page), and leave out its per-sequence windows
    (`kivi.window_bytes`)."""
    name = kv_format_name(kv_format)
    if name == kivi.KIVI_FORMAT:
        kivi.check_geometry(config.head_dim, page_size)
        both = sum(kivi.bytes_per_token(config.head_dim, page_size))
        per_head = both / 2 if include_scales else config.head_dim / 2
        return int(2 * config.num_layers * config.num_kv_heads * per_head)
    per_head = bytes_per_token_per_head(config.head_dim, name)
    if not include_scales:
        per_head = config.head_dim * dtype_bits(name) // 8
    return 2 * config.num_layers * config.num_kv_heads * per_head


def dtype_bits(name: str) -> int:
    """Bits per element of a dtype or its alias ("bf16", "fp8"): a sub-byte dtype (int4,
    float4) has an itemsize of 1 in numpy, so bytes are counted from this, never itemsize."""
    dtype = jnp.dtype(KV_FORMAT_ALIASES.get(name, name))
    return (jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)).bits


def gqa_saving(config: LlamaConfig) -> float:
    """How many times smaller the KV cache is than with one KV head per query head."""
    return config.num_heads / config.num_kv_heads


def weight_bytes(config: LlamaConfig, weight_dtype: str = "bfloat16") -> int:
    return -(-config.num_params * dtype_bits(weight_dtype) // 8)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    model: str
    kv_format: str
    gpu_memory_bytes: float  # all GPUs together
    weight_bytes: float
    overhead_bytes: float  # activations, workspace, fragmentation reserve
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int = 0  # held per sequence whatever its length (int4_kivi's window)

    @property
    def kv_bytes_available(self) -> float:
        return self.gpu_memory_bytes - self.weight_bytes - self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.kv_bytes_available > 0

    @property
    def max_cached_tokens(self) -> int:
        return max(0, int(self.kv_bytes_available // self.kv_bytes_per_token))

    def max_users(self, context_len: int) -> int:
        """Concurrent sequences of `context_len` tokens whose KV fits."""
        if context_len <= 0:
            raise ValueError(f"context_len must be positive, got {context_len}")
        each = context_len * self.kv_bytes_per_token + self.kv_bytes_per_sequence
        return max(0, int(self.kv_bytes_available // each))


def memory_budget(config: LlamaConfig, *, gpu_memory_gb: float, num_gpus: int = 1,
                  weight_dtype: str = "bfloat16", kv_format: str = "bfloat16",
                  overhead_fraction: float = 0.1) -> MemoryBudget:
    """What is left for the KV cache once the weights and a reserve (a fraction of GPU memory)
    are set aside, in the manner of vLLM's gpu_memory_utilization."""
    if not 0 <= overhead_fraction < 1:
        raise ValueError(f"overhead_fraction must be in [0, 1), got {overhead_fraction}")
    total = gpu_memory_gb * GB * num_gpus
    return MemoryBudget(model=config.name, kv_format=kv_format_name(kv_format),
                        gpu_memory_bytes=total, weight_bytes=weight_bytes(config, weight_dtype),
                        overhead_bytes=overhead_fraction * total,
                        kv_bytes_per_token=kv_bytes_per_token(config, kv_format),
                        kv_bytes_per_sequence=kv_bytes_per_sequence(config, kv_format))


def kv_bytes_per_sequence(config: LlamaConfig, kv_format: str,
                          page_size: int = KIVI_PAGE_SIZE) -> int:
    """Bytes a sequence holds beside its pages, over all layers: int4_kivi's bfloat16 window of
    its two newest pages; 0 for every other format."""
    if kv_format_name(kv_format) != kivi.KIVI_FORMAT:
        return 0
    return config.num_layers * config.num_kv_heads * kivi.window_bytes(config.head_dim,
                                                                        page_size)
