"""A CPU kernel for products of a few activation rows with a weight (XLA FFI custom call).

Why: decode and verify steps multiply a few rows by every weight, so they are bound by reading
the weights, and XLA:CPU reads them slowly outside one case. On the development machine (AMD
EPYC, 2 cores, `python -m experiments.dense_cpu`, figures in the README), through SmolLM2's MLP
weights, XLA streams one float32 row at 23-29 GB/s (its GEMV) but 2-8 float32 rows at 13-18
GB/s, and bfloat16 weights, half the bytes, at 10-14 GB/s at any row count: a bfloat16 decode
step was barely faster than a float32 one. The kernel reads 1-5 rows at 23-46 GB/s in either
dtype.

`dense.cc` streams each weight once and multiplies every row against it, with float32
accumulation; bfloat16 pairs are multiplied by VDPBF16PS where the CPU has it, else widened in
registers, and batched bfloat16 products (TILES_FROM rows or more) on AMX tiles where the CPU
has them. It is built on first use (`kernels_cpu.build`); without AVX-512 or a compiler,
`available()` is False and `infer.model.llama.dense` keeps XLA's product.
`INFER_CPU_KERNELS=0` turns it off, to measure XLA's product against it;
`INFER_BATCH_INVARIANT=1` gives it every product (`rows_for`).

Each output element is summed in an order fixed by K and the layout alone, so a row's result
does not depend on which other rows share the call (batch invariance), except that on AMX a
bfloat16 row differs between calls of fewer and of TILES_FROM or more rows
(`INFER_BATCH_INVARIANT=1` turns the tiles off).

An [in, out] weight can be stored in the kernel's layout once, at load (`pack`;
`infer.model.llama.tile_weights` packs a model's projections, the engine does it on one CPU
device; `packs` says which weights; INFER_TILED_WEIGHTS=0 keeps them as they are):
- bfloat16, where the AMX tiles run, in the tiles' layout: the tiles read it as stored, at every
  row count, with no packing per call; a row's bits through it are the same in a product of
  any number of rows;
- float32 as strips of 32 output columns, each strip's rows contiguous: the register tiles of
  batched products read it without a page per weight row, at every row count. Its products
  are the kernel's products of the [in, out] weight, bit for bit (past ROWS, where XLA would
  multiply the [in, out] weight, they differ in the last bits).

`reference` is the jnp product it must equal, `multiply` the kernel (`multiply_group`: one
activation against several weights in one call), `ROWS` the products `dense` hands it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.build import Kernel, cpu_flags

TARGET = "infer_dense_cpu"
SOURCE = Path(__file__).with_name("dense.cc")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LAYOUTS = ("kn", "nk")


KERNEL = Kernel(SOURCE, "InferDenseCpu", TARGET)


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (`kernels_cpu.build`). False,
    and XLA's product is used, when INFER_CPU_KERNELS=0, off x86-64, or when the build fails."""
    return KERNEL.available()


# Row counts per (layout, weight dtype) for which the kernel beat XLA:CPU's product, measured
# by `python -m experiments.dense_cpu` on each kind of machine it has run on. XLA:CPU hands its
# dots to YNNPACK, which multiplies bfloat16 on AMX tiles where the CPU has them (the flag
# amx_bf16): there XLA's bfloat16 GEMMs passed the kernel's VDPBF16PS register tiles from 14
# rows of a layer's [in, out] products and from 5 rows of the vocabulary projection, until the
# kernel used AMX tiles itself (TILES_FROM).
#
# AMD EPYC (Zen 4, AVX512-BF16, no AMX): `--rows=1,8,12,16,32,64,128,256 --layouts=kn` after
# the register tiles, the [N, K] rows and 2-7 [in, out] rows from earlier runs. [in, out]
# products of 9 rows or more run on the kernel's register tiles, ahead of XLA's GEMMs up to 128
# rows; at 256 (a prefill chunk) the two tie and XLA keeps it. The [N, K] vocabulary
# projection's dot products stayed ahead up to 32 rows.
ROWS_AVX512 = {("kn", jnp.dtype(jnp.float32)): range(1, 129),
               ("kn", jnp.dtype(jnp.bfloat16)): range(1, 129),
               ("nk", jnp.dtype(jnp.float32)): range(1, 33),
               ("nk", jnp.dtype(jnp.bfloat16)): range(1, 33)}
# Intel Xeon with AMX-BF16 (2 cores; 2026-12-05, `--layouts=layer,nk`, rows 1-128): kernel over
# XLA time, bfloat16 vocabulary projection 0.67 at 4 rows, 1.3 at 5, 1.6 at 8 (with AMX tiles
# from TILES_AMX rows 0.37-0.88 at 1-128 rows); float32 vocabulary projection 0.95 at 20 rows,
# 1.03 at 24, 1.12 at 32; float32 layers ahead or tied up to 128 rows. bfloat16 layers: 0.97 at 12 rows, 3.1 at 128 with the VDPBF16PS tiles alone;
# with AMX tiles from TILES_AMX rows (`--variants=no_amx`, results/dense_cpu_amx_tiles.jsonl),
# 0.66-0.83 from 9 to 48 rows, 0.88 at 64, 0.99 at 128, 0.97 at 192, 1.06 at 256.
ROWS_AMX = {("kn", jnp.dtype(jnp.float32)): range(1, 129),
            ("kn", jnp.dtype(jnp.bfloat16)): range(1, 193),
            ("nk", jnp.dtype(jnp.float32)): range(1, 21),
            ("nk", jnp.dtype(jnp.bfloat16)): range(1, 129)}


# Every row count to the kernel: a row's bits then never depend on the step it is in (the kernel
# sums each output in an order fixed by K alone), at the cost of XLA's faster GEMMs on batched
# steps where it has them.
ROWS_INVARIANT = {key: range(1, 1 << 31) for key in ROWS_AVX512}
BATCH_INVARIANT = os.environ.get("INFER_BATCH_INVARIANT", "0") == "1"


def _has_amx(flags: str) -> bool:
    """Whether /proc/cpuinfo's flags list AMX-BF16 (the flag itself, not a prefix of another)."""
    return "amx_bf16" in flags.split()


def rows_for(flags: str, batch_invariant: bool = False) -> dict[tuple[str, jnp.dtype], range]:
    """The ROWS table for a CPU with these /proc/cpuinfo flags. Where the fastest products mix
    the kernel and XLA by row count, a token's logits in a decode step (few rows, the kernel)
    and in a verify or prefill step (more rows, XLA) differ in their last bits, and greedy
    speculative output can differ from plain greedy output at near-ties; `batch_invariant`
    (INFER_BATCH_INVARIANT=1) gives the kernel every product instead. That holds where the
    kernel runs at all: on one device (under a mesh XLA keeps every product) with the kernel
    built."""
    if batch_invariant:
        return ROWS_INVARIANT
    return ROWS_AMX if _has_amx(flags) else ROWS_AVX512


ROWS = rows_for(cpu_flags(), BATCH_INVARIANT)

# The row counts from which bfloat16 products go to AMX tiles, per layout. [in, out]: 9, where
# the VDPBF16PS path turns multiply-bound (measured: the two tie at 8 rows, tiles 1.3x at 10 and
# 1.8x at 24; at 1-4 rows tiles are 1.4-1.9x slower, because packing the weight into tile pairs
# reads it at about half the speed of the few-row passes). [N, K]: 4, where the tiles, which
# read the weight's rows as stored, pass the VDPBF16PS dot products (1.2x at 4 rows, 2.2x at
# 8, 4.8x at 32, results/dense_cpu_amx_tiles.jsonl; 0.97x at 1 row and 0.82x at 2 in a scratch
# run with tiles from 1 row).
TILES_AMX = {"kn": 9, "nk": 4}


def tiles_from_for(flags: str, batch_invariant: bool = False) -> dict[str, int]:
    """The `tiles_from` the kernel is called with, per layout: TILES_AMX where /proc/cpuinfo
    lists amx_bf16, else 0 (never). AMX tiles round a pair's sum their own way, so a row's bits
    then differ between products of fewer rows and of the layout's tiles_from or more;
    `batch_invariant` keeps the VDPBF16PS paths (0)."""
    if batch_invariant or not _has_amx(flags):
        return {layout: 0 for layout in LAYOUTS}
    return dict(TILES_AMX)


TILES_FROM = tiles_from_for(cpu_flags(), BATCH_INVARIANT)


# The tiles' weight layout: 16 output columns a tile, each row a pair of weight rows
# ([N / 16, K / 2, 16, 2]; kernels_cpu/dense.cc, `kn_packed`).
TILE_COLUMNS = 16
# The float32 strips' layout: 32 output columns a strip ([N / 32, K, 32]; `kn_strips_packed`).
STRIP_COLUMNS = 32
TILED_WEIGHTS = os.environ.get("INFER_TILED_WEIGHTS", "1") == "1"


@functools.cache
def _tiles_permitted() -> bool:
    return available() and bool(KERNEL.library().InferDenseTilesPermitted())


def packs(w: jax.Array | np.ndarray) -> bool:
    """Whether `pack` should store this [in, out] weight in the kernel's layout, unless
    INFER_TILED_WEIGHTS=0: bfloat16 with K and N multiples of 32 on a CPU whose tiles the kernel
    runs (TILES_FROM, so not under INFER_BATCH_INVARIANT=1) and may use (Linux's permission,
    asked of the kernel); float32 with N a multiple of 32 wherever the kernel runs."""
    if not (TILED_WEIGHTS and w.ndim == 2 and jax.default_backend() == "cpu"):
        return False
    if jnp.dtype(w.dtype) == jnp.float32:
        return w.shape[1] % STRIP_COLUMNS == 0 and available()
    return (TILES_FROM["kn"] > 0 and jnp.dtype(w.dtype) == jnp.bfloat16
            and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0 and _tiles_permitted())


def _is_strips(w: jax.Array | np.ndarray) -> bool:
    return w.ndim == 3 and w.shape[2] == STRIP_COLUMNS and jnp.dtype(w.dtype) == jnp.float32


def is_packed(w: jax.Array | np.ndarray) -> bool:
    """Whether w is an [in, out] weight in the kernel's layout (`pack`'s output)."""
    return (w.ndim == 4 and w.shape[2:] == (TILE_COLUMNS, 2)) or _is_strips(w)


def pack(w: jax.Array) -> jax.Array:
    """[K, N] -> the kernel's layout. bfloat16: the tiles' [N / 16, K / 2, 16, 2],
    packed[t, q, j, h] = w[2q + h, 16t + j], each 16 output columns' pairs of weight rows
    contiguous (K and N multiples of 32). float32: strips [N / 32, K, 32], packed[t, k, j] =
    w[k, 32t + j] (N a multiple of 32)."""
    if w.ndim == 2 and jnp.dtype(w.dtype) == jnp.float32:
        if w.shape[1] % STRIP_COLUMNS:
            raise ValueError(f"pack needs a float32 [K, N] weight with N a multiple of 32, got "
                             f"{w.shape}")
        k, n = w.shape
        return w.reshape(k, n // STRIP_COLUMNS, STRIP_COLUMNS).transpose(1, 0, 2)
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.bfloat16 or w.shape[0] % 32 or w.shape[1] % 32:
        raise ValueError(f"pack needs a float32 [K, N] weight, or a bfloat16 one with K and N "
                         f"multiples of 32, got {w.dtype} {w.shape}")
    k, n = w.shape
    return w.reshape(k // 2, 2, n // TILE_COLUMNS, TILE_COLUMNS).transpose(2, 0, 3, 1)


def unpack(packed: jax.Array) -> jax.Array:
    """`pack`'s inverse: the [K, N] weight."""
    if not is_packed(packed):
        raise ValueError(f"not a packed weight: {packed.shape}")
    if _is_strips(packed):
        strips, k, _ = packed.shape
        return packed.transpose(1, 0, 2).reshape(k, strips * STRIP_COLUMNS)
    tiles, pairs = packed.shape[:2]
    return packed.transpose(1, 3, 0, 2).reshape(2 * pairs, tiles * TILE_COLUMNS)


def takes(rows: int, w: jax.Array, layout: str) -> bool:
    """Whether the kernel should run this product: on CPU, a 2-D weight and a row count in
    ROWS, or a packed weight at any row count (XLA would unpack it first, a copy of the weight
    every call); and the kernel available."""
    if is_packed(w):
        return (layout == "kn" and jax.default_backend() == "cpu"
                and (available() if _is_strips(w) else _tiles_permitted()))
    return (rows in ROWS.get((layout, jnp.dtype(w.dtype)), ()) and w.ndim == 2
            and jax.default_backend() == "cpu" and available())


def _check(x: jax.Array, w: jax.Array, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if is_packed(w) and layout != "kn":
        raise ValueError(f"a packed weight is [in, out] (layout \"kn\"), got {layout!r}")
    if x.ndim != 2 or (w.ndim != 2 and not is_packed(w)):
        raise ValueError(f"x must be [M, K] and w 2-D or packed, got {x.shape} and {w.shape}")
    k = w.shape[1] if layout == "nk" else _shape(w)[0]
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} ({layout}) disagree on K")
    if jnp.dtype(w.dtype) not in DTYPES or x.dtype != w.dtype:
        raise ValueError(f"x and w must both be float32 or both bfloat16, got {x.dtype}, "
                         f"{w.dtype}")


def _shape(w: jax.Array) -> tuple[int, int]:
    """The weight's [K, N] (or [N, K]) shape, packed or not."""
    if _is_strips(w):
        return w.shape[1], STRIP_COLUMNS * w.shape[0]
    if is_packed(w):
        return 2 * w.shape[1], TILE_COLUMNS * w.shape[0]
    return w.shape


def reference(x: jax.Array, w: jax.Array, layout: str) -> jax.Array:
    """x [M, K] times w ([K, N] or packed for "kn", [N, K] for "nk") -> [M, N] float32, by
    jnp."""
    _check(x, w, layout)
    if is_packed(w):
        w = unpack(w)
    equation = "mk,nk->mn" if layout == "nk" else "mk,kn->mn"
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _call(x: jax.Array, weights: Sequence[jax.Array], layout: str, target: str = TARGET,
          tiles_from: int | None = None) -> tuple[jax.Array, ...]:
    """The kernel's custom call, x times each weight in one call; `target` names another build
    (`KERNEL.register(flags)`); bfloat16 products of `tiles_from` rows or more go to AMX tiles
    where the build has them (0: never; default TILES_FROM[layout])."""
    if not available():
        raise RuntimeError("the CPU dense kernel is not available here (see kernels_cpu/dense.py)")
    if len({is_packed(w) for w in weights}) != 1:
        raise ValueError("a group's weights are all packed or none")
    outs = tuple(jax.ShapeDtypeStruct((x.shape[0], _shape(w)[0 if layout == "nk" else 1]),
                                      jnp.float32) for w in weights)
    tiles_from = TILES_FROM[layout] if tiles_from is None else tiles_from
    return tuple(jax.ffi.ffi_call(target, outs, vmap_method="sequential")(
        x, *weights, nk=layout == "nk", tiles_from=np.int64(tiles_from)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def multiply_group(x: jax.Array, weights: tuple[jax.Array, ...], layout: str
                   ) -> tuple[jax.Array, ...]:
    """x [M, K] times each weight (all [K, N_i] for "kn" or [N_i, K] for "nk", one dtype) ->
    one [M, N_i] float32 product each, by the kernel in one call: the weights share the threads
    as one piece of work (a layer's query, key and value projections), and each product's bits
    are those of `multiply` alone. Differentiable as `multiply`."""
    if not weights:
        raise ValueError("multiply_group needs at least one weight")
    for w in weights:
        _check(x, w, layout)
    return _call(x, tuple(weights), layout)


def _forward(x, weights, layout):
    return multiply_group(x, weights, layout), (x, weights)


def _backward(layout, residuals, grads):
    x, weights = residuals
    _, pullback = jax.vjp(lambda a, ws: tuple(reference(a, w, layout) for w in ws), x, weights)
    return pullback(grads)


multiply_group.defvjp(_forward, _backward)


def multiply(x: jax.Array, w: jax.Array, layout: str) -> jax.Array:
    """x [M, K] times w ([K, N] for "kn", [N, K] for "nk") -> [M, N] float32, by the kernel.
    Differentiable: the backward pass is jnp's (training never needs the kernel's speed)."""
    return multiply_group(x, (w,), layout)[0]
