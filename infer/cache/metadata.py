"""The per-step attention metadata that says where new tokens go, the host-side bounds check of
every write, and the one builder of a paged step's metadata from the sequences' pages."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from infer.cache.page_allocator import SequencePages, page_tables


def check_writes(starts: ArrayLike, ends: ArrayLike, capacity: ArrayLike,
                 names: Sequence[str] | None = None) -> None:
    """Raises ValueError naming each row (and `names[row]`, e.g. its request) whose writes,
    slots [starts, ends), do not lie in [0, capacity) (each of the three per row, or one for
    all rows); rows with ends <= starts write nothing.

    The one bounds check of every host caller that builds metadata (the runner, the proposers,
    the simple loop, tree speculation) and of eager cache writes. It must run on the host: the
    jitted write cannot raise, and out of range it drops (contiguous) or lands on another slot
    (a paged row's table is padded with page 0), silently either way."""
    # Broadcast together: the message indexes all three by row (the simple loop passes one
    # start, 0, for every row).
    starts, ends, capacity = (a.reshape(-1) for a in np.broadcast_arrays(
        np.asarray(starts), np.asarray(ends), np.asarray(capacity)))
    bad = np.flatnonzero((ends > starts) & ((starts < 0) | (ends > capacity)))
    if bad.size:
        label = lambda b: f"row {b}" + (f" ({names[b]})" if names is not None else "")
        rows = "; ".join(f"{label(b)} writes slots [{starts[b]}, {ends[b]}) but has room for "
                         f"{capacity[b]}" for b in bad[:8])
        more = f" (and {bad.size - 8} more rows)" if bad.size > 8 else ""
        raise ValueError(f"write outside the KV cache: {rows}{more}")

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What one model call needs to know about the batch, as arrays (never static)."""

    positions: jax.Array  # [B, T] int32, RoPE positions of the new tokens
    lengths: jax.Array  # [B] int32, tokens in the cache after this call (old + new)
    q_lens: jax.Array  # [B] int32, valid new tokens of each row (<= T); the rest is padding
    page_tables: jax.Array | None = None  # [B, n] int32, paged caches only
    tree_mask: jax.Array | None = None  # [B, T, T] bool: new token i sees new token j
    # [B, 2] int32 (slot, tag) of each row's sequence window, for caches that keep one
    # (`infer.cache.kivi`); None: row b's window is slot b, for loops whose rows each hold one
    # sequence throughout.
    windows: jax.Array | None = None

    @property
    def starts(self) -> jax.Array:
        """Slot of each row's first new token."""
        return self.lengths - self.q_lens

    def check_eager_writes(self, capacity: int) -> None:
        """`check_writes` of this call's new tokens against `capacity` slots per row, when the
        metadata holds values (an eager call). Under jit it holds tracers and checks nothing:
        jitted callers check first, on the host."""
        if isinstance(self.lengths, jax.core.Tracer):
            return
        lengths = np.asarray(self.lengths)
        check_writes(lengths - np.asarray(self.q_lens), lengths, capacity)

    def new_token_slots(self) -> tuple[jax.Array, jax.Array]:
        """[B, T] slot of each new token and [B, T] whether it is a real (non-padding) token."""
        t = jnp.arange(self.positions.shape[1], dtype=jnp.int32)
        slots = self.starts[:, None] + t[None, :]
        return slots, t[None, :] < self.q_lens[:, None]

    @staticmethod
    def for_prefill(q_lens: jax.Array, num_tokens: int, cached: jax.Array | None = None,
                    page_tables: jax.Array | None = None) -> "AttentionMetadata":
        """Rows of `num_tokens` (padded) new tokens following `cached` tokens already stored."""
        q_lens = jnp.asarray(q_lens, jnp.int32)
        cached = jnp.zeros_like(q_lens) if cached is None else jnp.asarray(cached, jnp.int32)
        positions = cached[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        return AttentionMetadata(positions=positions, lengths=cached + q_lens, q_lens=q_lens,
                                 page_tables=page_tables)

    @staticmethod
    def for_tree(cached: jax.Array, q_lens: jax.Array, offsets: jax.Array, tree_mask: jax.Array,
                 page_tables: jax.Array | None = None) -> "AttentionMetadata":
        """Rows of tree nodes after `cached` tokens: node i sits in slot cached + i, at position
        cached + offsets[i] (its depth below the tree's root, siblings alike), and sees the cache
        and the nodes tree_mask [B, T, T] allows (its ancestors and itself)."""
        cached = jnp.asarray(cached, jnp.int32)
        q_lens = jnp.asarray(q_lens, jnp.int32)
        offsets = jnp.asarray(offsets, jnp.int32)
        positions = cached[:, None] + (offsets if offsets.ndim == 2 else offsets[None, :])
        return AttentionMetadata(positions=positions, lengths=cached + q_lens, q_lens=q_lens,
                                 page_tables=page_tables, tree_mask=tree_mask)

    @staticmethod
    def for_decode(cached: jax.Array, page_tables: jax.Array | None = None) -> "AttentionMetadata":
        """One new token per row, after `cached` tokens."""
        cached = jnp.asarray(cached, jnp.int32)
        return AttentionMetadata(positions=cached[:, None], lengths=cached + 1,
                                 q_lens=jnp.ones_like(cached), page_tables=page_tables)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedMetadata:
    """A mixed step: parts of [B_i, T_i] rows (a prefill chunk, the decode rows) packed into
    one model row of N = sum B_i T_i tokens, so that every dense product reads the weights once
    for all of them. Cache writes and attention run per part, or, with the Pallas backend, as
    one ragged call over every row (`PagedKVCache`). Paged caches only."""

    parts: tuple[AttentionMetadata, ...]

    @property
    def positions(self) -> jax.Array:
        """[1, N] RoPE positions of the packed tokens, part after part."""
        return jnp.concatenate([p.positions.reshape(1, -1) for p in self.parts], axis=1)

    def split(self, x: jax.Array) -> list[jax.Array]:
        """Packed [1, N, ...] -> each part's [B_i, T_i, ...]."""
        out, start = [], 0
        for p in self.parts:
            b, t = p.positions.shape
            out.append(x[0, start:start + b * t].reshape(b, t, *x.shape[2:]))
            start += b * t
        return out

    def packed(self, x_parts: Sequence[jax.Array]) -> jax.Array:
        """The inverse of `split`: parts' [B_i, T_i, ...] -> [1, N, ...]."""
        return jnp.concatenate([x.reshape(1, -1, *x.shape[2:]) for x in x_parts], axis=1)


def paged_metadata(pages: Sequence[SequencePages], rows: int, width: int, cached: np.ndarray,
                   q_lens: np.ndarray, tokens: int, row_of: Sequence[int] | None = None,
                   write_ends: np.ndarray | None = None,
                   names: Sequence[str] | None = None,
                   with_windows: bool | None = None) -> AttentionMetadata:
    """Metadata, as host arrays, for `rows` rows of `tokens` (padded) new tokens after `cached`
    [rows], `q_lens` [rows] of them valid, sequence i (`pages[i]`, called `names[i]` in errors,
    e.g. "request 'id'") in row `row_of[i]` (default i), page tables `width` pages wide.

    First checks on the host that each row writes only slots of pages it holds and its table
    shows: [cached, cached + q_lens), or [cached, write_ends) for a proposer's chain, which
    writes past its metadata. Under jit a write past the table would be dropped and one past
    the held pages would land in page 0 (the table's padding), another sequence's.

    with_windows: give the metadata the rows' windows (`AttentionMetadata.windows`); None: when
    some sequence has one. Callers that compile ahead say which, so that a step with no
    sequence (a warm-up dummy) has the same structure as the real ones."""
    if names is not None and len(names) != len(pages):
        raise ValueError(f"{len(names)} names for {len(pages)} sequences")
    row_of = range(len(pages)) if row_of is None else row_of
    capacity = np.zeros(rows, np.int64)
    row_names = [""] * rows
    for j, (i, seq) in enumerate(zip(row_of, pages)):
        capacity[i] = min(len(seq.pages), width) * seq.page_size
        row_names[i] = names[j] if names is not None else f"sequence {j}"
    check_writes(cached, cached + q_lens if write_ends is None else write_ends, capacity,
                 row_names)
    positions = cached[:, None] + np.arange(tokens, dtype=np.int32)[None, :]
    windows = None
    if with_windows is None:
        with_windows = any(seq.window is not None for seq in pages)
    if with_windows:
        # Rows without a sequence, or whose sequence has no window, point past every slot:
        # they neither read nor write one.
        windows = np.full((rows, 2), [np.iinfo(np.int32).max, -1], np.int32)
        for i, seq in zip(row_of, pages):
            if seq.window is not None:
                windows[i] = seq.window
    # Host arrays: the jitted step they go to moves them with its other arguments, in its C++
    # dispatch. A `jax.device_put` per step cost more host time than that (about 0.3 ms a call
    # on 2 cores, taken from the step's own threads), and eager `jnp.asarray` would compile a
    # copy program for each new shape.
    return AttentionMetadata(
        positions=positions, lengths=cached + q_lens, q_lens=q_lens,
        page_tables=page_tables(pages, rows, width, row_of), windows=windows)
