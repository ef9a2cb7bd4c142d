"""The paged KV cache: a pool of fixed-size pages per layer, read through per-sequence page tables.

Layout per layer: head-major `[P, K, G, Ds]` pages (P pages, K kv heads, G tokens, Ds stored head
dim: D, or D/2 for int4), plus `[P, K, G, groups]` bfloat16 scales for the quantized formats.
Head-major because a page's tokens of one head are then one contiguous [G, Ds] tile: the block a
TPU kernel fetches (Mosaic tiles the last two dims), and the run the reference gather copies. Which
pages a sequence owns is the host's business (`infer.page_allocator`); on device a sequence is a
row of `meta.page_tables`, and new tokens are written through the slot mapping
`page * G + offset` that the metadata implies.

Attention backends:
  reference  gather the row's pages into head-major `[B, K, n*G, D]`, dequantize, and run the same
             masked attention as the contiguous cache (plain XLA); on CPU, steps without a
             tree mask (decode, verify, prefill chunks) over float32 and bfloat16 caches go to
             `kernels_cpu.attention`, which reads each row's visible tokens in place
  pallas     the Pallas kernels of `kernels_pallas` (compiled on GPU/TPU, interpreted on CPU)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache import attention, kivi
from infer.cache.metadata import AttentionMetadata, MixedMetadata
from infer.cache.protocol import WriteThenAttend
from infer.model.sharding import BATCH, DEFAULT_RULES, HEAD_DIM, HEADS, KV_HEADS, SEQ, per_shard
from kernels_cpu import attention as cpu_attention
from kernels_pallas import kv_quant
from kernels_pallas.paged_attention import (paged_attention, paged_prefill_attention,
                                            ragged_paged_attention)

ATTENTION_BACKENDS = ("reference", "pallas")

# Pages [P, K, G, Ds] and their scales split over KV heads, as the k and v projections' outputs
# are under tensor parallelism: each device writes and reads its own heads' pages alone.
PAGE_AXES = (None, KV_HEADS, None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(WriteThenAttend):
    k: tuple[jax.Array, ...]  # L x [P, K, G, Ds]
    v: tuple[jax.Array, ...]
    k_scales: tuple[jax.Array, ...] | None  # L x [P, K, G, groups] for scaled formats
    v_scales: tuple[jax.Array, ...] | None
    # int4_kivi only (`infer.cache.kivi`): L x [R * W, K, G, D] bfloat16 keys and values of each
    # of R sequences' newest W = kivi.WINDOW_PAGES pages (window slot s, page j at ring entry
    # s * W + j % W), and L x [R * W, 2] int32 (sequence tag, page index) of what each entry holds
    k_window: tuple[jax.Array, ...] | None = None
    v_window: tuple[jax.Array, ...] | None = None
    window_tags: tuple[jax.Array, ...] | None = None
    kv_format: str = dataclasses.field(default="float32", metadata=dict(static=True))
    backend: str = dataclasses.field(default="reference", metadata=dict(static=True))
    rotate: bool = dataclasses.field(default=False, metadata=dict(static=True))  # see create

    @staticmethod
    def create(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, kv_format: str = "float32", backend: str = "reference",
               rotate: bool | None = None, mesh: jax.sharding.Mesh | None = None,
               num_windows: int = 0, device: jax.sharding.Sharding | None = None
               ) -> "PagedKVCache":
        """A zeroed pool. Zero pages matter: attention gives masked slots probability 0, and
        0 * garbage must stay 0, so unused slots must never hold NaN or inf.

        rotate (default: on for the quantized formats): store keys and values multiplied by an
        orthonormal Hadamard matrix H, rotate queries by H, and rotate attention outputs back.
        Scores q.k and the output are unchanged in exact arithmetic, but H spreads the few
        outlier channels of each head over all channels, so a per-vector scale fits far more
        of them. On SmolLM2 it raised int8's top-1 agreement with the float32 cache from 98.0%
        to 99.6% and int4's from 79% to 87% (512 tokens, symmetric int4). A head dim that is not
        a power of two gets a block-diagonal H (see `_hadamard`); rotate=True on an odd head dim
        raises here. kv_format may be an alias ("fp8"); the cache holds the canonical name.

        mesh: allocate the pool split over KV heads on it (`PAGE_AXES`), never whole on one
        device. device (without a mesh): allocate it there, committed, beside weights put on
        that device explicitly (`infer.model.binding.committed_device`).

        num_windows: int4_kivi's bfloat16 windows, one per sequence that holds pages at once
        (`PageAllocator(num_windows=)` hands them out). Rotation there is of values alone: keys
        are quantized per channel, which a rotation would smear.
        """
        kv_format = kv_quant.resolve_kv_format(kv_format, page_formats=True)
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got num_pages="
                             f"{num_pages}, page_size={page_size}")
        if kv_format == kivi.KIVI_FORMAT:
            return PagedKVCache._create_kivi(num_layers, num_pages, page_size, num_kv_heads,
                                             head_dim, backend, rotate, mesh, num_windows,
                                             device)
        shape = (num_pages, num_kv_heads, page_size, kv_quant.stored_head_dim(head_dim, kv_format))
        dtype = kv_quant.bits_dtype(kv_quant.storage_dtype(kv_format))
        if mesh is not None:
            device = jax.sharding.NamedSharding(mesh, DEFAULT_RULES.spec(PAGE_AXES))
        zeros = lambda shape, dtype: jnp.zeros(shape, dtype, device=device)
        pages = lambda: tuple(zeros(shape, dtype) for _ in range(num_layers))
        groups = kv_quant.scale_groups(head_dim, kv_format)
        scale_dtype = kv_quant.bits_dtype(kv_quant.SCALE_DTYPE)
        scales = (lambda: tuple(zeros(shape[:3] + (groups,), scale_dtype)
                                for _ in range(num_layers))) if groups else (lambda: None)
        if rotate is None:
            rotate = groups > 0 and head_dim % 2 == 0
        if rotate:
            _hadamard(head_dim)  # an unsupported head dim fails now, not inside the first write
        return PagedKVCache(k=pages(), v=pages(), k_scales=scales(), v_scales=scales(),
                            kv_format=kv_format, backend=backend, rotate=rotate)

    @staticmethod
    def _create_kivi(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int, backend: str, rotate: bool | None,
                     mesh: jax.sharding.Mesh | None, num_windows: int,
                     device: jax.sharding.Sharding | None) -> "PagedKVCache":
        kivi.check_geometry(head_dim, page_size)
        kivi.check_backend(backend)
        if num_windows < 1:
            raise ValueError(f"{kivi.KIVI_FORMAT} keeps each sequence's newest pages in a "
                             "bfloat16 window: num_windows must be >= 1 (the most sequences "
                             f"holding pages at once), got {num_windows}")
        tags_device = device  # on a mesh, the tags stay whole on the default device
        if mesh is not None:
            device = jax.sharding.NamedSharding(mesh, DEFAULT_RULES.spec(PAGE_AXES))
            tags_device = None
        zeros = lambda shape, dtype: tuple(jnp.zeros(shape, dtype, device=device)
                                           for _ in range(num_layers))
        page = (num_pages, num_kv_heads, page_size)
        entries = num_windows * kivi.WINDOW_PAGES
        window = (entries, num_kv_heads, page_size, head_dim)
        bf16 = kv_quant.bits_dtype(jnp.bfloat16)
        tags = tuple(jnp.full((entries, 2), -1, jnp.int32, device=tags_device)
                     for _ in range(num_layers))
        if rotate is None:
            rotate = True
        if rotate:
            _hadamard(head_dim)
        return PagedKVCache(
            k=zeros(page + (head_dim // 2,), jnp.uint8), v=zeros(page + (head_dim // 2,), jnp.uint8),
            k_scales=zeros(page + (kivi.key_codes(head_dim, page_size),), jnp.uint8),
            v_scales=zeros(page + (kivi.value_codes(head_dim),), jnp.uint8),
            k_window=zeros(window, bf16), v_window=zeros(window, bf16), window_tags=tags,
            kv_format=kivi.KIVI_FORMAT, backend=backend, rotate=rotate)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_bytes(self) -> int:
        arrays = self.k + self.v + (self.k_scales or ()) + (self.v_scales or ()) + (
            self.k_window or ()) + (self.v_window or ()) + (self.window_tags or ())
        return sum(a.nbytes for a in arrays)

    @property
    def _rotates_keys(self) -> bool:
        return self.rotate and self.kv_format != kivi.KIVI_FORMAT

    def _slots(self, meta: AttentionMetadata) -> jax.Array:
        """[B, T] flat slot (page * G + offset) of each new token; padding, and any token past
        the row's table, points past the pool (dropped) rather than onto a page it does not own."""
        return self._flat_slots(meta.page_tables, *meta.new_token_slots())

    def _flat_slots(self, page_tables: jax.Array, slots: jax.Array, valid: jax.Array
                    ) -> jax.Array:
        """[B, T] flat slot (page * G + offset) of each row's sequence slot slots [B, T]; where
        not valid, or outside [0, the row's table), one past the pool (a scatter drops it)."""
        g, width = self.page_size, page_tables.shape[1]
        index = slots // g
        inside = valid & (index >= 0) & (index < width)
        page = jnp.take_along_axis(page_tables, jnp.clip(index, 0, width - 1), axis=1)
        return jnp.where(inside, page * g + slots % g, self.num_pages * g)

    def write(self, layer: int, k: jax.Array, v: jax.Array,
              meta: AttentionMetadata | MixedMetadata) -> "PagedKVCache":
        """Stores the new tokens' keys and values through the page tables. A slot past a row's
        table raises when called eagerly; jitted callers, which alone know how many of the
        table's pages a row really holds, check first (`check_writes`)."""
        if isinstance(meta, MixedMetadata):
            cache = self
            for part, k_part, v_part in zip(meta.parts, meta.split(k), meta.split(v)):
                cache = cache.write(layer, k_part, v_part, part)
            return cache
        if self.kv_format == kivi.KIVI_FORMAT:
            return self._write_kivi(layer, k, v, meta)[0]
        meta.check_eager_writes(meta.page_tables.shape[1] * self.page_size)
        slots = self._slots(meta)

        def update(pools: tuple[jax.Array, ...] | None, new: jax.Array | None):
            if pools is None:
                return None
            return pools[:layer] + (_put_tokens(pools[layer], slots, new),) + pools[layer + 1:]

        if self.rotate:
            k, v = hadamard_rotate(k), hadamard_rotate(v)
        k_data, k_scale = kv_quant.quantize(k, self.kv_format)
        v_data, v_scale = kv_quant.quantize(v, self.kv_format)
        return dataclasses.replace(self, k=update(self.k, k_data), v=update(self.v, v_data),
                                   k_scales=update(self.k_scales, k_scale),
                                   v_scales=update(self.v_scales, v_scale))

    def move_tokens(self, page_tables: jax.Array, src: jax.Array, dst: jax.Array,
                    valid: jax.Array) -> "PagedKVCache":
        """Copies single token slots of each row's sequence to other slots of it, in every layer:
        tree speculation's compaction, which moves the accepted path's nodes from their tree
        slots to the consecutive slots after the cache.

        page_tables [B, n] int32; src, dst [B, T] int32 slots within each row's sequence
        (0-based positions, translated through the row's table: page_tables[b, s // G] * G +
        s % G); valid [B, T] bool. Where valid, the k, v (and k_scales, v_scales) rows of slot
        src[b, t] are copied to dst[b, t]. The rows move as stored (bits and scales, never
        dequantized and quantized again), so every per-token format moves exactly. Everything
        is gathered before anything is written, since a node may move onto a slot another one
        leaves; dst must be distinct among a row's valid entries (a scatter to one slot twice
        keeps either). Invalid entries, and a src or dst past the row's table, write nothing.

        int4_kivi raises: its keys are quantized per channel over whole pages (and held exact
        in the sequence's window), so a single token's stored key cannot move alone."""
        if self.kv_format == kivi.KIVI_FORMAT:
            raise ValueError(f"{kivi.KIVI_FORMAT} cannot move single tokens: its keys are "
                             "quantized per channel over whole pages and kept in per-sequence "
                             "windows of whole pages, so one token's stored key is no row of "
                             "its own")
        g = self.page_size
        inside = lambda slots: self._flat_slots(page_tables, slots, valid) < self.num_pages * g
        ok = inside(src) & inside(dst)
        # Reading a row of the pool at a clipped in-range slot is harmless: its write is dropped.
        source = jnp.minimum(self._flat_slots(page_tables, src, ok), self.num_pages * g - 1)
        target = self._flat_slots(page_tables, dst, ok)

        def move(pools: tuple[jax.Array, ...] | None) -> tuple[jax.Array, ...] | None:
            if pools is None:
                return None
            # Gather every layer's rows (as [B, T, K, X]) before the scatter writes any of them.
            rows = [pool[source // g, :, source % g] for pool in pools]
            return tuple(_put_tokens(pool, target, new) for pool, new in zip(pools, rows))

        return dataclasses.replace(self, k=move(self.k), v=move(self.v),
                                   k_scales=move(self.k_scales), v_scales=move(self.v_scales))

    def attend(self, layer: int, q: jax.Array, meta: AttentionMetadata | MixedMetadata
               ) -> jax.Array:
        return self._attend_rotated(layer, q, meta)

    def write_and_attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                         meta: AttentionMetadata | MixedMetadata
                         ) -> tuple["PagedKVCache", jax.Array]:
        """write, then attend; int4_kivi's queries read the pages this write touched as the
        exact values it quantized them from, not quantized: a prompt chunk attends its own
        tokens in full precision (KIVI's prefill), and only later steps read what is stored."""
        if self.kv_format != kivi.KIVI_FORMAT:
            return super().write_and_attend(layer, q, k, v, meta)
        if isinstance(meta, MixedMetadata):
            cache, outs = self, []
            for q_part, k_part, v_part, part in zip(meta.split(q), meta.split(k), meta.split(v),
                                                    meta.parts):
                cache, out = cache.write_and_attend(layer, q_part, k_part, v_part, part)
                outs.append(out)
            return cache, meta.packed(outs)
        cache, written = self._write_kivi(layer, k, v, meta)
        return cache, cache._attend_rotated(layer, q, meta, written)

    def _attend_rotated(self, layer: int, q: jax.Array, meta: AttentionMetadata | MixedMetadata,
                        written: "_KiviWrite | None" = None) -> jax.Array:
        if self._rotates_keys:
            q = hadamard_rotate(q)
        out = self._attend(layer, q, meta, written)
        return hadamard_rotate(out, inverse=True) if self.rotate else out

    def pages(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """Layer `layer`'s (keys, values, key scales, value scales) as the format stores them
        (the cache may hold them as their bits: `kv_quant.bits_dtype`)."""
        data = lambda x: kv_quant.from_bits(x, kv_quant.storage_dtype(self.kv_format))
        scale = lambda x: None if x is None else kv_quant.from_bits(x[layer], kv_quant.SCALE_DTYPE)
        return data(self.k[layer]), data(self.v[layer]), scale(self.k_scales), scale(self.v_scales)

    def _attend(self, layer: int, q: jax.Array, meta: AttentionMetadata | MixedMetadata,
                written: "_KiviWrite | None" = None) -> jax.Array:
        if isinstance(meta, MixedMetadata):
            if self.backend == "pallas":
                return self._attend_ragged(layer, q, meta)
            return meta.packed([self._attend(layer, q_part, part)
                                for q_part, part in zip(meta.split(q), meta.parts)])
        if self.kv_format == kivi.KIVI_FORMAT:
            k, v = self._gather_kivi(layer, meta, attention.compute_dtype(q.dtype), written)
            return attention.masked_attention(q, k, v,
                                              attention.visibility_mask(meta, k.shape[2]))
        pools = self.pages(layer)
        if self.backend == "pallas":
            fmt = self.kv_format
            if q.shape[1] == 1 and meta.tree_mask is None:
                def decode(q, pools, lengths, page_tables):
                    k, v, k_scales, v_scales = pools
                    return paged_attention(q, k, v, lengths, page_tables, k_scales=k_scales,
                                           v_scales=v_scales, kv_format=fmt)
                out = per_shard(decode, ((BATCH, HEADS, HEAD_DIM), PAGE_AXES, None, None),
                                (BATCH, HEADS, HEAD_DIM))(q[:, 0], pools, meta.lengths,
                                                          meta.page_tables)
                return out[:, None]

            def prefill(q, pools, lengths, q_lens, page_tables, tree_mask):
                k, v, k_scales, v_scales = pools
                return paged_prefill_attention(q, k, v, lengths, q_lens, page_tables,
                                               tree_mask=tree_mask, k_scales=k_scales,
                                               v_scales=v_scales, kv_format=fmt)
            q_axes = (BATCH, SEQ, HEADS, HEAD_DIM)
            return per_shard(prefill, (q_axes, PAGE_AXES, None, None, None, None), q_axes)(
                q, pools, meta.lengths, meta.q_lens, meta.page_tables, meta.tree_mask)
        k_pages, v_pages, k_scales, v_scales = pools
        if (meta.tree_mask is None and jax.sharding.get_abstract_mesh().empty
                and reads_in_place(self.kv_format, self.backend, q.dtype, q.shape[-1])):
            # On CPU each row's visible tokens are read in place, from the pages as held
            # (bfloat16 as its bits).
            return cpu_attention.attend(q, self.k[layer], self.v[layer], meta.lengths,
                                        meta.q_lens, meta.page_tables,
                                        page_dtype=kv_quant.storage_dtype(self.kv_format))
        # Dequantized straight into the dtype attention computes in: one pass over the pages.
        work = attention.compute_dtype(q.dtype)
        k = self._gather(k_pages, k_scales, meta.page_tables, work)
        v = self._gather(v_pages, v_scales, meta.page_tables, work)
        return attention.masked_attention(q, k, v, attention.visibility_mask(meta, k.shape[2]))

    def _attend_ragged(self, layer: int, q: jax.Array, meta: MixedMetadata) -> jax.Array:
        """Every part's rows in one ragged kernel call: the packed tokens (each part's rows
        padded to its T_i) are moved so that rows sit back to back, padding last, as
        `ragged_paged_attention` reads them, and moved back after."""
        if any(p.tree_mask is not None for p in meta.parts):
            raise ValueError("a mixed step's parts are causal; tree masks are not supported")
        n = q.shape[1]
        q_lens = jnp.concatenate([p.q_lens for p in meta.parts])
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
        # Destination of each packed token: its row's offset plus its index in the row.
        dest, row = [], 0
        for p in meta.parts:
            b, t = p.positions.shape
            index = jnp.arange(t, dtype=jnp.int32)[None, :]
            real = index < p.q_lens[:, None]
            dest.append(jnp.where(real, cu[row:row + b, None] + index, n).reshape(-1))
            row += b
        dest = jnp.concatenate(dest)
        packed = jnp.zeros_like(q[0]).at[dest].set(q[0], mode="drop")
        max_q_len, fmt = max(p.positions.shape[1] for p in meta.parts), self.kv_format

        def ragged(packed, pools, lengths, cu, page_tables):
            k, v, k_scales, v_scales = pools
            return ragged_paged_attention(packed, k, v, lengths, cu, page_tables,
                                          max_q_len=max_q_len, k_scales=k_scales,
                                          v_scales=v_scales, kv_format=fmt)
        q_axes = (SEQ, HEADS, HEAD_DIM)
        out = per_shard(ragged, (q_axes, PAGE_AXES, None, None, None), q_axes)(
            packed, self.pages(layer), jnp.concatenate([p.lengths for p in meta.parts]), cu,
            jnp.concatenate([p.page_tables for p in meta.parts]))
        return jnp.where((dest < n)[:, None, None], out[jnp.minimum(dest, n - 1)], 0)[None]

    def _windows(self, meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """[B] window slot and [B] sequence tag of each row (`AttentionMetadata.windows`)."""
        if meta.windows is not None:
            return meta.windows[:, 0], meta.windows[:, 1]
        rows = jnp.arange(meta.positions.shape[0], dtype=jnp.int32)
        return rows, -2 - rows  # never a tag the allocator gives (those are >= 0)

    def _ring_entry(self, slot: jax.Array, index: jax.Array) -> jax.Array:
        """Ring entries of window slots `slot` at indices `index` (< WINDOW_PAGES), broadcast;
        the entry just past the pool for a slot outside it (the metadata's "no window" slot,
        int32 max, times WINDOW_PAGES wrapped to -2, which read and wrote the last sequence's
        window)."""
        entries = self.k_window[0].shape[0]
        inside = (slot >= 0) & (slot < entries // kivi.WINDOW_PAGES)
        return jnp.where(inside, slot * kivi.WINDOW_PAGES + index, entries)

    def _ring(self, slot: jax.Array) -> jax.Array:
        """[B, W] ring entries of window slots [B] (entries past the pool for slots past it)."""
        return self._ring_entry(slot[:, None], jnp.arange(kivi.WINDOW_PAGES, dtype=slot.dtype))

    def _window_pages(self, layer: int, slot: jax.Array, tag: jax.Array) -> jax.Array:
        """[B, W] page index whose exact keys and values each ring entry of row b's window holds;
        -1 where it holds none of this sequence's (another sequence's, or no window slot)."""
        tags = jnp.take(self.window_tags[layer], self._ring(slot), axis=0, mode="fill",
                        fill_value=-1)
        return jnp.where(tags[..., 0] == tag[:, None], tags[..., 1], -1)

    def _read_window(self, pool: jax.Array, slot: jax.Array) -> jax.Array:
        """Row b's ring [B, W, K, G, D] as float32 (zeros past the slots)."""
        bits = jnp.take(pool, self._ring(slot), axis=0, mode="fill", fill_value=0)
        return kv_quant.from_bits(bits, jnp.bfloat16).astype(jnp.float32)

    def _dequantized_pages(self, layer: int, page_ids: jax.Array, first: jax.Array,
                           dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Keys and values of pages page_ids [B, n] as [B, n, K, G, D]; first [B, n] marks
        page index 0 of its sequence (keys per token)."""
        keys = kivi.dequantize_key_pages(self.k[layer][page_ids], self.k_scales[layer][page_ids],
                                         first, dtype)
        values = kivi.dequantize_values(self.v[layer][page_ids], self.v_scales[layer][page_ids],
                                        dtype)
        return keys, values

    def _gather_kivi(self, layer: int, meta: AttentionMetadata, dtype: jnp.dtype,
                     written: "_KiviWrite | None" = None) -> tuple[jax.Array, jax.Array]:
        """The row's pages as head-major [B, K, n * G, D] keys and values: dequantized, the
        pages its window holds read from the window instead, and the pages `written` touched
        (when given) as its exact values."""
        b, n = meta.page_tables.shape
        first = jnp.broadcast_to(jnp.arange(n) == 0, (b, n))
        keys, values = self._dequantized_pages(layer, meta.page_tables, first, dtype)
        slot, tag = self._windows(meta)
        held = self._window_pages(layer, slot, tag)  # [B, W]
        g = self.page_size

        def overlay(pages: jax.Array, window: jax.Array, exact: jax.Array | None) -> jax.Array:
            # pages [B, n, K, G, D], window [B, W, K, G, D], exact [B, span, K, G, D]
            # -> [B, K, n * G, D]
            index = jnp.arange(n)[None, :, None, None, None]
            for entry in range(kivi.WINDOW_PAGES):
                pages = jnp.where(index == held[:, entry, None, None, None, None],
                                  window[:, entry, None].astype(dtype), pages)
            if exact is not None:
                at = jnp.where(written.inside, written.page_index, n)  # n: dropped
                pages = pages.at[jnp.arange(b)[:, None], at].set(exact.astype(dtype),
                                                                  mode="drop")
            _, _, k, _, d = pages.shape
            return pages.transpose(0, 2, 1, 3, 4).reshape(b, k, n * g, d)

        return (overlay(keys, self._read_window(self.k_window[layer], slot),
                        None if written is None else written.keys),
                overlay(values, self._read_window(self.v_window[layer], slot),
                        None if written is None else written.values))

    def _write_kivi(self, layer: int, k: jax.Array, v: jax.Array, meta: AttentionMetadata
                    ) -> tuple["PagedKVCache", "_KiviWrite"]:
        """Writes the new tokens of each row. Keys on a per-channel page are quantized again
        over the whole page, from its exact values (the window's, for the tokens before this
        write in its first page; the page's own, dequantized, when the window no longer holds
        it, as after a rollback past both pages it holds); what is quantized per token (values,
        and keys on page 0) is quantized for the new tokens alone, at their slots, since an
        earlier token's codes would come out the same. The last W pages touched go to the
        window's ring. So a page's keys are quantized per channel over every token it holds,
        exactly, once its last token is written. Returns the new cache and the exact pages
        the write touched (values rotated when the cache rotates)."""
        meta.check_eager_writes(meta.page_tables.shape[1] * self.page_size)
        if self.rotate:  # values only: keys are quantized per channel, which rotation smears
            v = hadamard_rotate(v)
        g = self.page_size
        b, t = meta.positions.shape
        width = meta.page_tables.shape[1]
        span = -(-t // g) + 1  # pages a write of t tokens can touch
        starts, ends = meta.starts, meta.lengths
        first_page = starts // g
        offset = starts % g
        slot, tag = self._windows(meta)
        index = first_page[:, None] + jnp.arange(span)[None, :]  # [B, span] page indices
        inside = (index < width) & (meta.q_lens[:, None] > 0) & (index <= (ends[:, None] - 1) // g)
        page_ids = jnp.take_along_axis(meta.page_tables, jnp.clip(index, 0, width - 1), axis=1)

        # The exact tokens before the write in its first page: the window's when it holds that
        # page, else the page dequantized.
        head = page_ids[:, :1]
        old_k, old_v = self._dequantized_pages(layer, head, first_page[:, None] == 0, jnp.float32)
        w = kivi.WINDOW_PAGES
        entry = first_page % w
        held = jnp.take_along_axis(self._window_pages(layer, slot, tag), entry[:, None],
                                   axis=1)[:, 0] == first_page
        window = lambda pool, old: jnp.where(
            held[:, None, None, None],
            jnp.take_along_axis(self._read_window(pool, slot),
                                entry[:, None, None, None, None], axis=1)[:, 0], old[:, 0])
        prior_k = window(self.k_window[layer], old_k)  # [B, K, G, D]
        prior_v = window(self.v_window[layer], old_v)

        def buffer(new: jax.Array, prior: jax.Array) -> jax.Array:
            # [B, span, K, G, D]: buffer slot j is position first_page * g + j.
            j = jnp.arange(span * g)[None, :]
            source = jnp.clip(j - offset[:, None], 0, t - 1)
            fresh = jnp.take_along_axis(new.astype(jnp.float32), source[:, :, None, None], axis=1)
            is_new = (j >= offset[:, None]) & (j < offset[:, None] + meta.q_lens[:, None])
            before = jnp.pad(prior.transpose(0, 2, 1, 3), ((0, 0), (0, (span - 1) * g),
                                                           (0, 0), (0, 0)))
            out = jnp.where(is_new[:, :, None, None], fresh,
                            jnp.where((j < offset[:, None])[:, :, None, None], before, 0.0))
            return out.reshape(b, span, g, *new.shape[2:]).transpose(0, 1, 3, 2, 4)

        keys, values = buffer(k, prior_k), buffer(v, prior_v)
        k_data, k_codes = kivi.quantize_key_pages(keys.reshape(b * span, *keys.shape[2:]), False)
        dest = jnp.where(inside & (index > 0), page_ids, self.num_pages).reshape(-1)
        put_pages = lambda pool, new: pool.at[dest].set(new, mode="drop")
        # Per token: values everywhere, keys on page 0 (the others' slots point past the pool).
        slots = self._slots(meta)
        on_first_page = meta.new_token_slots()[0] < g
        key_slots = jnp.where(on_first_page, slots, self.num_pages * g)
        kt_data, kt_codes = kivi.quantize_key_tokens(k, g)
        v_data, v_codes = kivi.quantize_values(v)
        put_keys = lambda pool, paged, tokens: _put_tokens(put_pages(pool, paged), key_slots,
                                                           tokens)

        # The ring takes the last W pages touched (fewer when the write touched fewer; the
        # entries it did not touch keep the earlier pages they hold).
        last = jnp.clip((ends - 1) // g - first_page, 0, span - 1)
        back = jnp.arange(w)[None, :]
        touched = last[:, None] - back  # [B, W] buffer indices of the newest pages touched
        page_index = first_page[:, None] + touched
        entries = jnp.where((touched >= 0) & (meta.q_lens[:, None] > 0),
                            self._ring_entry(slot[:, None], page_index % w),
                            self.k_window[layer].shape[0])
        pick = lambda x: jnp.take_along_axis(
            x, jnp.clip(touched, 0)[:, :, None, None, None], axis=1)
        bf16 = lambda x: kv_quant.to_bits(x.astype(jnp.bfloat16), self.k_window[layer].dtype)
        to_ring = lambda pool, x: pool.at[entries.reshape(-1)].set(
            bf16(pick(x)).reshape(-1, *pool.shape[1:]), mode="drop")
        new_tags = jnp.stack([jnp.broadcast_to(tag[:, None], page_index.shape), page_index],
                             axis=-1).reshape(-1, 2)
        replace = lambda pools, new: pools[:layer] + (new,) + pools[layer + 1:]
        written = _KiviWrite(keys, values, index, inside)
        return dataclasses.replace(
            self, k=replace(self.k, put_keys(self.k[layer], k_data, kt_data)),
            v=replace(self.v, _put_tokens(self.v[layer], slots, v_data)),
            k_scales=replace(self.k_scales, put_keys(self.k_scales[layer], k_codes, kt_codes)),
            v_scales=replace(self.v_scales, _put_tokens(self.v_scales[layer], slots, v_codes)),
            k_window=replace(self.k_window, to_ring(self.k_window[layer], keys)),
            v_window=replace(self.v_window, to_ring(self.v_window[layer], values)),
            window_tags=replace(self.window_tags, self.window_tags[layer].at[
                entries.reshape(-1)].set(new_tags, mode="drop"))), written

    def _gather(self, pool: jax.Array, scales: jax.Array | None, page_tables: jax.Array,
                dtype: jnp.dtype) -> jax.Array:
        """The row's pages as head-major [B, K, n * G, D], dequantized."""
        b, n = page_tables.shape
        _, k, g, _ = pool.shape
        # [B, n, K, G, Ds] -> [B, K, n, G, Ds]: each (page, head) tile moves whole. Transposing
        # before dequantizing lets XLA fuse gather, transpose and dequantization into one pass.
        data = pool[page_tables].transpose(0, 2, 1, 3, 4).reshape(b, k, n * g, pool.shape[3])
        if scales is not None:
            scales = scales[page_tables].transpose(0, 2, 1, 3, 4).reshape(b, k, n * g, -1)
        return kv_quant.dequantize(data, scales, self.kv_format, dtype)


def _put_tokens(pool: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """pool [P, K, G, X] with new [B, T, K, X] scattered one [K, X] row per token to the flat
    slots [B, T] (page * G + offset; past the pool: dropped)."""
    g = pool.shape[2]
    # One extra update aimed past the pool (and so dropped): with a single token to write,
    # XLA:CPU turned the scatter into a dynamic-update-slice and then copied every layer's
    # whole pool to keep it in place -- 0.7 s a step for a 1,024-page pool.
    slots = jnp.concatenate([slots.reshape(-1), jnp.asarray([pool.shape[0] * g], jnp.int32)])
    rows = kv_quant.to_bits(new.reshape(-1, *new.shape[2:]), pool.dtype)
    rows = jnp.concatenate([rows, jnp.zeros((1, *rows.shape[1:]), rows.dtype)])
    return pool.at[slots // g, :, slots % g].set(rows, mode="drop")


class _KiviWrite(NamedTuple):
    """The pages an int4_kivi write touched, as the exact values it quantized them from."""
    keys: jax.Array  # [B, span, K, G, D] float32 (values rotated when the cache rotates)
    values: jax.Array
    page_index: jax.Array  # [B, span] index of each in its row's page table
    inside: jax.Array  # [B, span] bool: the write really touched it


@functools.cache
def _hadamard(d: int) -> np.ndarray:
    """The orthonormal [d, d] rotation: Sylvester's Hadamard matrix when d is a power of two.
    Otherwise block-diagonal, one Hadamard block per run of b consecutive channels, b the largest
    power of two dividing d (d = 96: three blocks of 32): an outlier channel spreads over its
    block instead of the whole head, rather than no rotation at all for head dims like 80 or 96."""
    if not isinstance(d, (int, np.integer)) or d < 2 or d % 2:
        raise ValueError(f"Hadamard rotation needs an even head dim, got {d}")
    b = d & -d
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    h = np.kron(np.eye(d // b), h / np.sqrt(b))
    h.flags.writeable = False  # cached and shared
    return h


def hadamard_rotate(x: jax.Array, inverse: bool = False) -> jax.Array:
    """x [..., D] times the orthonormal Hadamard matrix (its transpose with inverse=True)."""
    h = jnp.asarray(_hadamard(x.shape[-1]), jnp.float32)
    return jnp.einsum("...d,ed->...e" if inverse else "...d,de->...e", x.astype(jnp.float32), h,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def reads_in_place(kv_format: str, backend: str, q_dtype: jnp.dtype, head_dim: int) -> bool:
    """Whether a cache of this format, backend and head dim hands every step without a tree
    mask to `kernels_cpu.attention` (on one device), which reads each row's visible tokens from
    its pages: the page-table width then costs nothing, so one width can serve every length. The
    one rule both `PagedKVCache` (which step goes to the kernel) and the engine (how many
    widths to compile) follow."""
    return (backend == "reference" and kv_format in ("float32", "bfloat16")
            and cpu_attention.takes(q_dtype, kv_format, head_dim))


def window_slots(kv_format: str, max_sequences: int) -> int:
    """Window slots a cache of `kv_format` needs when at most `max_sequences` sequences hold
    pages at once (the allocator's `num_windows` and the cache's): one each for int4_kivi, which
    keeps each sequence's newest pages in a window, none for every other format."""
    name = kv_quant.resolve_kv_format(kv_format, page_formats=True)
    return max_sequences if name == kivi.KIVI_FORMAT else 0


def copy_pages(cache: PagedKVCache, src: list[int], dst: list[int]) -> PagedKVCache:
    """Copies whole pages src[i] -> dst[i] in every layer (copy-on-write of shared pages).
    The cache is donated. Lists are padded to a power of two with dropped copies, so a run
    compiles a handful of shapes."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destinations")
    if not src:
        return cache
    n = 1 << (len(src) - 1).bit_length()
    pad = n - len(src)
    return _copy_pages(cache, jnp.asarray(list(src) + [0] * pad, jnp.int32),
                       jnp.asarray(list(dst) + [cache.num_pages] * pad, jnp.int32))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    move = lambda pools: None if pools is None else tuple(
        p.at[dst].set(p[src], mode="drop") for p in pools)
    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v),
                               k_scales=move(cache.k_scales), v_scales=move(cache.v_scales))
