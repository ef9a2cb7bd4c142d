"""Lowering the kernels for a real TPU or GPU on any host, CPU included.

`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` (or `("cuda",)`) runs the real Mosaic
or Triton lowering rules, block-shape checks included, with no accelerator present: a kernel that
does not lower here would not compile there. The interpreter cannot stand in for this, since it
checks arithmetic only. Mosaic's rules also ask which TPU they lower for. An abstract mesh on a
named chip (`TPU_DEVICE_KIND`) answers that question, and JAX's own `use_abstract_mesh` provides
it.

`lowering_matrix` lowers every entry point over every KV format, every kind of step and the
geometries of real models. Each cell lowers, is refused up front by the entry point
(`UnsupportedKernelConfig`, naming the constraint), or fails, which is a bug.
`python -m experiments.kernel_lowering` prints the matrix.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import (PAGE_FORMATS, SCALE_DTYPE, SUPPORTED_KV_FORMATS, scale_groups,
                                     storage_dtype, stored_head_dim)
from kernels_pallas.paged_attention.api import (UnsupportedKernelConfig, check_kernel_format,
                                                paged_attention,
                                                paged_prefill_attention, ragged_paged_attention)

PLATFORMS: tuple[str, ...] = ("tpu", "cuda")
_BACKEND = {"tpu": "tpu", "cuda": "gpu"}  # lowering platform -> the entry points' backend
# The chip whose limits Mosaic lowers against when no TPU is attached.
TPU_DEVICE_KIND = "TPU v5 lite"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The attention shape of a model: what a kernel's blocks depend on."""
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


GEOMETRIES: tuple[Geometry, ...] = (
    Geometry("SmolLM2-135M", num_heads=9, num_kv_heads=3, head_dim=64),
    Geometry("Llama-3-8B", num_heads=32, num_kv_heads=8, head_dim=128),
    Geometry("Phi-2", num_heads=32, num_kv_heads=32, head_dim=80),
)


@dataclasses.dataclass(frozen=True)
class StepKind:
    """One kind of attention call the engine makes: T new queries per row, causal or a tree;
    ragged: rows of up to T queries, flat (decode rows and prefill chunks in one call)."""
    name: str
    tokens: int
    tree: bool = False
    ragged: bool = False


# Verification sizes that are not powers of two on purpose: four drafts plus the bonus token,
# and a 15-node tree.
STEP_KINDS: tuple[StepKind, ...] = (
    StepKind("decode", 1),
    StepKind("prefill chunk", 16),
    StepKind("chain verify", 5),
    StepKind("tree verify", 15, tree=True),
    StepKind("mixed (ragged)", 16, ragged=True),
)

Outcome = Literal["lowers", "refused", "fails"]


@dataclasses.dataclass(frozen=True)
class Cell:
    platform: str
    kv_format: str
    step: str
    geometry: str
    outcome: Outcome
    detail: str = ""  # the refusal's or the failure's message


def _abstract_args(kind: StepKind, geometry: Geometry, kv_format: str, batch: int,
                   page_size: int, max_pages: int, num_pages: int) -> dict:
    """ShapeDtypeStructs of one call: lowering needs shapes, never values."""
    sds = jax.ShapeDtypeStruct
    K, D = geometry.num_kv_heads, geometry.head_dim
    try:
        Ds = stored_head_dim(D, kv_format)
    except ValueError:
        Ds = D  # the entry point refuses this format at this head dim; let it say so
    pages = sds((num_pages, K, page_size, Ds), storage_dtype(kv_format))
    try:
        groups = scale_groups(D, kv_format)
    except ValueError:
        groups = 1
    scales = sds((num_pages, K, page_size, groups), SCALE_DTYPE) if groups else None
    rows = sds((batch,), jnp.int32)
    q_shape = (batch, geometry.num_heads, D) if kind.tokens == 1 else (
        batch, kind.tokens, geometry.num_heads, D)
    if kind.ragged:  # one row's chunk, the other rows' single tokens
        q_shape = (kind.tokens + batch - 1, geometry.num_heads, D)
    args = dict(q=sds(q_shape, jnp.float32), k_pages=pages, v_pages=pages, lengths=rows,
                page_tables=sds((batch, max_pages), jnp.int32), k_scales=scales, v_scales=scales)
    if kind.ragged:
        args["cu_q_lens"] = sds((batch + 1,), jnp.int32)
    elif kind.tokens > 1:
        args["q_lens"] = rows
        args["tree_mask"] = sds((batch, kind.tokens, kind.tokens), jnp.bool_) if kind.tree else None
    return args


def lower(platform: str, kv_format: str, kind: StepKind, geometry: Geometry, *, batch: int = 2,
          page_size: int = 16, max_pages: int = 8, num_pages: int = 64, pages_per_block: int = 4,
          gpu_splits: int = 2) -> jax.stages.Lowered:
    """The entry point serving `kind` at `geometry`, lowered for `platform` ("tpu" or "cuda").
    Raises UnsupportedKernelConfig where the entry point refuses the configuration.

    By default each TPU grid step and each step of a GPU program's loop takes 4 pages, and the
    GPU kernel splits every sequence over 2 programs: the several-pages paths are what lower,
    not only the one-page ones (the GPU kernel's own default gives small batches one page a
    program)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    check_kernel_format(kv_format)  # as every entry point does, before its arrays exist
    args = _abstract_args(kind, geometry, kv_format, batch, page_size, max_pages, num_pages)
    entry = paged_attention if kind.tokens == 1 else paged_prefill_attention
    static = dict(kv_format=kv_format, backend=_BACKEND[platform], interpret=False,
                  pages_per_block=pages_per_block)
    if platform == "cuda":
        static["num_splits"] = gpu_splits
    if kind.ragged:
        entry, static["max_q_len"] = ragged_paged_attention, kind.tokens
    names = list(args)

    def call(*values):
        return entry(**dict(zip(names, values)), **static)

    lowering = lambda: jax.jit(call).trace(*args.values()).lower(lowering_platforms=(platform,))
    if platform != "tpu":
        return lowering()
    # Traced inside the mesh too: a trace records the abstract mesh its lowering then sees.
    device = jax.sharding.AbstractDevice(device_kind=TPU_DEVICE_KIND, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("chip",),
                                                                  abstract_device=device)):
        return lowering()


def lower_cell(platform: str, kv_format: str, kind: StepKind, geometry: Geometry) -> Cell:
    """One cell of the matrix: its outcome and, unless it lowers, why."""
    where = dict(platform=platform, kv_format=kv_format, step=kind.name, geometry=geometry.name)
    try:
        lower(platform, kv_format, kind, geometry)
    except UnsupportedKernelConfig as e:
        return Cell(**where, outcome="refused", detail=str(e))
    except Exception as e:  # noqa: BLE001 -- any other exception is the failure being reported
        first_line = str(e).splitlines()[0] if str(e) else ""
        return Cell(**where, outcome="fails", detail=f"{type(e).__name__}: {first_line}")
    return Cell(**where, outcome="lowers")


def lowering_matrix(platforms: tuple[str, ...] = PLATFORMS,
                    kv_formats: tuple[str, ...] = SUPPORTED_KV_FORMATS + PAGE_FORMATS,
                    kinds: tuple[StepKind, ...] = STEP_KINDS,
                    geometries: tuple[Geometry, ...] = GEOMETRIES) -> list[Cell]:
    """Every (platform, format, step kind, geometry) cell, lowered."""
    return [lower_cell(p, f, k, g) for p in platforms for f in kv_formats for k in kinds
            for g in geometries]


__all__ = ["PLATFORMS", "TPU_DEVICE_KIND", "Geometry", "GEOMETRIES", "StepKind", "STEP_KINDS",
           "Cell", "lower", "lower_cell", "lowering_matrix"]
