"""KV-cache memory accounting for real model configs: bytes per token, GQA saving, and how many
tokens and users fit beside the weights on a set of GPUs, per device as tensor parallelism lays
the heads out."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp

from infer.cache import kivi
from infer.model.config import LlamaConfig
from kernels_pallas.kv_quant import KV_FORMAT_ALIASES, bytes_per_token_per_head, resolve_kv_format

if TYPE_CHECKING:
    from infer.parallel.heads import HeadLayout

GB = 1e9  # GPU memory is sold in decimal gigabytes (A100-80GB: 80e9 bytes)


KIVI_PAGE_SIZE = 32  # int4_kivi's page in the budget: its keys' codes cost 2 D / G per token
ENGINE_PAGE_SIZE = 16  # the engine's default page (EngineConfig.page_size)


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


def laid_out(config: LlamaConfig, tensor_parallel: int = 1
             ) -> tuple["HeadLayout", LlamaConfig]:
    """(layout, the config with its heads laid out) over T tensor-parallel devices, as
    `infer.parallel.heads` places them: split, replicate or, where nothing else splits, pad
    (`pad_heads`). ValueError (head_layout's) when the FFN or the vocabulary does not split.
    Idempotent: a laid-out config lays out as itself."""
    from infer.parallel.heads import head_layout

    layout = head_layout(config, tensor_parallel, pad_heads=True)
    return layout, config.replace(num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)


def norm_bytes(config: LlamaConfig, weight_dtype: str = "bfloat16") -> int:
    """The RMSNorm scales: two per layer and the final one, whole on every device."""
    # In bits, as weight_bytes counts the total they are taken from (int4: half a byte each).
    return -(-(2 * config.num_layers + 1) * config.hidden_size * dtype_bits(weight_dtype) // 8)


def weight_bytes_per_device(config: LlamaConfig, tensor_parallel: int = 1,
                            weight_dtype: str = "bfloat16") -> int:
    """Weight bytes each of a replica's T devices holds: the laid-out model's (replicated or
    zero heads included) split T ways, but for the RMSNorm scales, which every device holds."""
    _, wide = laid_out(config, tensor_parallel)
    whole = norm_bytes(wide, weight_dtype)
    sharded = weight_bytes(wide, weight_dtype) - whole
    if sharded % tensor_parallel:
        raise ValueError(f"{config.name}: {sharded} sharded bytes do not split over "
                         f"{tensor_parallel} devices")
    return sharded // tensor_parallel + whole


def kv_bytes_per_token_per_device(config: LlamaConfig, tensor_parallel: int = 1,
                                  kv_format: str = "bfloat16", include_scales: bool = True,
                                  page_size: int = KIVI_PAGE_SIZE) -> int:
    """KV bytes one token takes on each of T devices: pages split on KV heads, counted after the
    head layout (a replicated or zero KV head costs as much as a real one)."""
    _, wide = laid_out(config, tensor_parallel)
    total = kv_bytes_per_token(wide, kv_format, include_scales=include_scales,
                               page_size=page_size)
    if total % tensor_parallel:
        raise ValueError(f"{config.name}: {total} KV bytes per token do not split over "
                         f"{tensor_parallel} devices")
    return total // tensor_parallel


def kv_bytes_per_sequence_per_device(config: LlamaConfig, tensor_parallel: int = 1,
                                     kv_format: str = "bfloat16",
                                     page_size: int = KIVI_PAGE_SIZE) -> int:
    """`kv_bytes_per_sequence` on each of T devices: int4_kivi's window split by KV head, its
    ring's tags whole (they live on one device, which is then the fullest)."""
    _, wide = laid_out(config, tensor_parallel)
    tags = ring_tag_bytes(config, kv_format)
    return (kv_bytes_per_sequence(wide, kv_format, page_size) - tags) // tensor_parallel + tags


def ring_tag_bytes(config: LlamaConfig, kv_format: str) -> int:
    """Bytes of a sequence's int4_kivi ring tags, over all layers (one device holds them
    whole); 0 for every other format."""
    if kv_format_name(kv_format) != kivi.KIVI_FORMAT:
        return 0
    return config.num_layers * kivi.WINDOW_TAG_BYTES


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What a replica's KV cache can hold. The arithmetic is per device: each of a
    tensor-parallel replica's `devices` holds its share of the weights and of every token's KV,
    and a sequence fits only if its share fits on each. The replica's totals (`weight_bytes`,
    `kv_bytes_per_token`, ...) are `devices` times a device's."""

    model: str
    kv_format: str
    device_memory_bytes: float
    device_weight_bytes: float
    device_overhead_bytes: float  # activations, workspace, fragmentation reserve
    device_kv_bytes_per_token: int
    device_kv_bytes_per_sequence: int = 0  # held whatever the length (int4_kivi's window)
    # Of those, what one device holds for the whole replica (the ring's tags): the fullest
    # device's share, counted once in the replica's total.
    sequence_bytes_held_whole: int = 0
    devices: int = 1
    page_size: int = 1  # tokens per page: a sequence holds whole pages
    layout: str = "split"  # how the heads split over the devices (infer.parallel.heads)

    @property
    def device_kv_bytes_available(self) -> float:
        return self.device_memory_bytes - self.device_weight_bytes - self.device_overhead_bytes

    @property
    def gpu_memory_bytes(self) -> float:
        return self.devices * self.device_memory_bytes

    @property
    def weight_bytes(self) -> float:
        return self.devices * self.device_weight_bytes

    @property
    def overhead_bytes(self) -> float:
        return self.devices * self.device_overhead_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.devices * self.device_kv_bytes_per_token

    @property
    def kv_bytes_per_sequence(self) -> int:
        whole = self.sequence_bytes_held_whole
        return self.devices * (self.device_kv_bytes_per_sequence - whole) + whole

    @property
    def kv_bytes_available(self) -> float:
        return self.devices * self.device_kv_bytes_available

    @property
    def fits(self) -> bool:
        return self.device_kv_bytes_available > 0

    @property
    def max_cached_tokens(self) -> int:
        return max(0, int(self.device_kv_bytes_available // self.device_kv_bytes_per_token))

    def tokens_held(self, context_len: int) -> int:
        """Token slots a sequence of `context_len` tokens holds: its pages, the last one partly
        empty (vLLM's concurrency figure rounds up to blocks alike)."""
        if context_len <= 0:
            raise ValueError(f"context_len must be positive, got {context_len}")
        return -(-context_len // self.page_size) * self.page_size

    def max_users(self, context_len: int) -> int:
        """Concurrent sequences of `context_len` tokens whose KV fits."""
        each = (self.tokens_held(context_len) * self.device_kv_bytes_per_token
                + self.device_kv_bytes_per_sequence)
        return max(0, int(self.device_kv_bytes_available // each))


def memory_budget(config: LlamaConfig, *, gpu_memory_gb: float, num_gpus: int = 1,
                  weight_dtype: str = "bfloat16", kv_format: str = "bfloat16",
                  overhead_fraction: float = 0.1, page_size: int | None = None) -> MemoryBudget:
    """What is left for the KV cache of one replica tensor-parallel over `num_gpus` GPUs, once
    each GPU's weights and a reserve (a fraction of its memory, in the manner of vLLM's
    gpu_memory_utilization) are set aside. The heads are laid out as the engine places them:
    KV heads replicated or padded to split over the GPUs cost memory here too. Sequences hold
    whole pages of `page_size` tokens (default: the engine's, int4_kivi's own). ValueError when
    the model does not split over `num_gpus`."""
    if not 0 <= overhead_fraction < 1:
        raise ValueError(f"overhead_fraction must be in [0, 1), got {overhead_fraction}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
    name = kv_format_name(kv_format)
    if page_size is None:
        page_size = KIVI_PAGE_SIZE if name == kivi.KIVI_FORMAT else ENGINE_PAGE_SIZE
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    layout, _ = laid_out(config, num_gpus)
    memory = gpu_memory_gb * GB
    return MemoryBudget(
        model=config.name, kv_format=name, device_memory_bytes=memory,
        device_weight_bytes=weight_bytes_per_device(config, num_gpus, weight_dtype),
        device_overhead_bytes=overhead_fraction * memory,
        device_kv_bytes_per_token=kv_bytes_per_token_per_device(config, num_gpus, name,
                                                                page_size=page_size),
        device_kv_bytes_per_sequence=kv_bytes_per_sequence_per_device(config, num_gpus, name,
                                                                      page_size),
        sequence_bytes_held_whole=ring_tag_bytes(config, name),
        devices=num_gpus, layout=layout.way, page_size=page_size)


def kv_bytes_per_sequence(config: LlamaConfig, kv_format: str,
                          page_size: int = KIVI_PAGE_SIZE) -> int:
    """Bytes a sequence holds beside its pages, over all layers: int4_kivi's bfloat16 window of
    its two newest pages and the ring's tags; 0 for every other format."""
    if kv_format_name(kv_format) != kivi.KIVI_FORMAT:
        return 0
    window = config.num_kv_heads * kivi.window_bytes(config.head_dim, page_size)
    return config.num_layers * window + ring_tag_bytes(config, kv_format)
