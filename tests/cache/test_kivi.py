"""int4_kivi: the format's error bounds, checked apart from its code, and the cache's pages and
windows against a host model of what each position must read back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache import kivi
from infer.cache.metadata import AttentionMetadata
from infer.cache.page_allocator import OutOfWindows, PageAllocator
from infer.cache.paged import PagedKVCache, _hadamard

STEP_GRID = 2 ** (1 / kivi.STEP_CODES_PER_OCTAVE)  # a step is at most this much above its need


def _step_needed(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The smallest step of a group spanning [lo, hi] whose low is a multiple of it in
    [-127, 127] steps, or the format's smallest step: what it promises to stay within (times
    the grid's rounding)."""
    smallest = 2.0 ** -kivi.STEP_OFFSET / STEP_GRID
    return np.maximum(np.maximum((hi - lo) / 15, np.abs(lo) / 127), smallest)


@pytest.mark.parametrize("magnitude", [1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3])
def test_every_value_comes_back_within_one_step_of_its_group(magnitude: float) -> None:
    rng = np.random.default_rng(int(np.log10(magnitude) * 7) % 97)
    n, k, g, d = 3, 2, 8, 16
    keys = rng.standard_normal((n, k, g, d)).astype(np.float32) * magnitude
    keys += rng.standard_normal((1, 1, 1, d)).astype(np.float32) * magnitude  # offsets
    first = np.array([True, False, False])
    data, codes = kivi.quantize_key_pages(jnp.asarray(keys), jnp.asarray(first))
    back = np.asarray(kivi.dequantize_key_pages(data, codes, jnp.asarray(first)))
    # Page 0 per token in groups of g channels, the others per channel over the page.
    per_token = keys[0].reshape(k, g, d // g, g)
    need_t = _step_needed(per_token.min(-1), per_token.max(-1))[..., None]
    err_t = np.abs(back[0] - keys[0]).reshape(k, g, d // g, g)
    assert (err_t <= need_t * STEP_GRID * 1.001 + 1e-12).all()
    need_c = _step_needed(keys[1:].min(2), keys[1:].max(2))[:, :, None]
    assert (np.abs(back[1:] - keys[1:]) <= need_c * STEP_GRID * 1.001 + 1e-12).all()
    values = rng.standard_normal((5, d)).astype(np.float32) * magnitude
    v_back = np.asarray(kivi.dequantize_values(*kivi.quantize_values(jnp.asarray(values))))
    group = kivi.value_group(d)
    grouped = values.reshape(5, d // group, group)
    need_v = _step_needed(grouped.min(-1), grouped.max(-1))[..., None]
    assert (np.abs(v_back - values).reshape(grouped.shape) <= need_v * STEP_GRID * 1.001).all()


def test_channels_and_tokens_keep_their_own_ranges() -> None:
    """An outlier channel costs only its own channel on a per-channel page, and an outlier
    token (an attention sink) only its own groups on page 0: what the layout is for."""
    rng = np.random.default_rng(3)
    k, g, d = 1, 8, 16
    base = rng.standard_normal((2, k, g, d)).astype(np.float32)
    spiked = base.copy()
    spiked[1, :, :, 5] *= 500  # channel 5 of a per-channel page
    spiked[0, :, 0, :] *= 500  # token 0 of page 0
    first = jnp.asarray([True, False])
    error = lambda x: np.abs(np.asarray(kivi.dequantize_key_pages(
        *kivi.quantize_key_pages(jnp.asarray(x), first), first)) - x)
    calm, spike = error(base), error(spiked)
    others = np.ones(d, bool)
    others[5] = False
    np.testing.assert_array_equal(spike[1][..., others], calm[1][..., others])
    np.testing.assert_array_equal(spike[0][:, 1:], calm[0][:, 1:])


class _RowModel:
    """What one sequence's positions must read back from the cache: a per-channel key page
    holds the quantization of the exact values its last write assembled (the window's copy, in
    bfloat16, for the tokens before that write, or the page's own, dequantized, when the window
    had moved on); what is per token (values, page 0's keys) holds each token's quantization as
    it was written; and the pages the window's ring holds (the last two a write touched, page j
    in entry j % 2, an entry a write did not reach keeping its page) read back the assembled
    values in bfloat16."""

    def __init__(self, g: int, pages: int, k: int, d: int):
        self.g = g
        self.input_k = np.zeros((pages, k, g, d), np.float32)
        self.input_v = np.zeros((pages, k, g, d), np.float32)
        self.token_k = np.zeros((pages, k, g, d), np.float32)  # as each token was written
        self.token_v = np.zeros((pages, k, g, d), np.float32)
        self.ring = [-1] * kivi.WINDOW_PAGES
        self.just_written: set[int] = set()

    def _quantized(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        first = jnp.asarray([j == 0])
        source = self.token_k if j == 0 else self.input_k
        keys = kivi.dequantize_key_pages(*kivi.quantize_key_pages(
            jnp.asarray(source[j:j + 1]), first), first)
        values = kivi.dequantize_values(*kivi.quantize_values(jnp.asarray(self.token_v[j])))
        return np.asarray(keys[0]), np.asarray(values)

    def _read(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        if self.ring[j % len(self.ring)] == j:
            bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
            return bf16(self.input_k[j]), bf16(self.input_v[j])
        return self._quantized(j)

    def write(self, start: int, k_new: np.ndarray, v_new: np.ndarray) -> None:
        g, n = self.g, len(k_new)
        self.just_written = set()
        if n == 0:
            return
        first, last = start // g, (start + n - 1) // g
        prior_k, prior_v = self._read(first)
        for j in range(first, last + 1):
            buf_k = np.zeros_like(self.input_k[j])
            buf_v = np.zeros_like(self.input_v[j])
            if j == first:
                buf_k[:, :start % g], buf_v[:, :start % g] = (prior_k[:, :start % g],
                                                              prior_v[:, :start % g])
            for p in range(max(start, j * g), min(start + n, (j + 1) * g)):
                buf_k[:, p % g], buf_v[:, p % g] = k_new[p - start], v_new[p - start]
                self.token_k[j, :, p % g] = k_new[p - start]
                self.token_v[j, :, p % g] = v_new[p - start]
            self.input_k[j], self.input_v[j] = buf_k, buf_v
        for j in range(max(first, last - len(self.ring) + 1), last + 1):
            self.ring[j % len(self.ring)] = j
        self.just_written = set(range(first, last + 1))

    def keys_values(self, length: int, fused: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """[K, length, D] keys and values as a query reads them; `fused`: as the queries of
        the last write read them through write_and_attend, the pages it touched exact."""
        read = lambda j: ((self.input_k[j], self.input_v[j])
                          if fused and j in self.just_written else self._read(j))
        pages = [read(j) for j in range(-(-length // self.g))]
        cat = lambda i: np.concatenate([p[i] for p in pages], axis=1)[:, :length]
        return cat(0), cat(1)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
               length: int) -> np.ndarray:
    """q [T, H, D] over k, v [K, length, D], query t seeing slots <= positions[t]."""
    t, h, d = q.shape
    groups = h // k.shape[0]
    out = np.zeros_like(q)
    for i in range(t):
        for head in range(h):
            kv = head // groups
            s = k[kv, :length] @ q[i, head] / np.sqrt(d)
            s[np.arange(length) > positions[i]] = -np.inf
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v[kv, :length]
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_reads_follow_the_pages_and_windows_through_random_writes_and_rollbacks(
        seed: int, fused: bool) -> None:
    """Rows of random write lengths (single tokens, chunks across several pages), random
    rollbacks into the last write (rejected speculative tokens), permuted pages, rows writing
    nothing: every attention output matches the host model's, and each row's window serves it
    alone. Through write_and_attend (`fused`) a write's own queries read every page it touched
    as the exact values it quantized them from; a later attend reads them as stored. Odd seeds
    rotate values (the format's default): the model holds v H, and outputs come back times H^T."""
    rng = np.random.default_rng(seed)
    b, k, h, d, g, width = 3, 2, 4, 16, 4, 8
    rotate = bool(seed % 2)
    turn = _hadamard(d) if rotate else np.eye(d)
    pages = rng.permutation(b * width + 3)[:b * width].reshape(b, width).astype(np.int32)
    cache = PagedKVCache.create(1, b * width + 3, g, k, d, kivi.KIVI_FORMAT, rotate=rotate,
                                num_windows=b + 2)
    slots = rng.permutation(b + 2)[:b]
    windows = jnp.asarray(np.stack([slots, 100 + np.arange(b)], axis=1).astype(np.int32))
    models = [_RowModel(g, b * width + 3, k, d) for _ in range(b)]
    length = np.zeros(b, np.int32)
    last_start = np.zeros(b, np.int32)
    for _ in range(12):
        t = int(rng.choice([1, 2, 3, g, 2 * g + 1]))
        start = length.copy()
        for row in range(b):  # a rollback into the previous write, now and then
            if rng.random() < 0.3 and length[row] > last_start[row]:
                start[row] = rng.integers(last_start[row], length[row] + 1)
        room = width * g - start
        q_lens = np.minimum(rng.integers(0, t + 1, b), room).astype(np.int32)
        kn = rng.standard_normal((b, t, k, d)).astype(np.float32)
        vn = rng.standard_normal((b, t, k, d)).astype(np.float32)
        q = rng.standard_normal((b, t, h, d)).astype(np.float32)
        meta = AttentionMetadata.for_prefill(jnp.asarray(q_lens), t, cached=jnp.asarray(start),
                                             page_tables=jnp.asarray(pages))
        meta = AttentionMetadata(meta.positions, meta.lengths, meta.q_lens, meta.page_tables,
                                 windows=windows)
        if fused:
            cache, out = cache.write_and_attend(0, jnp.asarray(q), jnp.asarray(kn),
                                                jnp.asarray(vn), meta)
            later = np.asarray(cache.attend(0, jnp.asarray(q), meta))
        else:
            cache = cache.write(0, jnp.asarray(kn), jnp.asarray(vn), meta)
            out = later = np.asarray(cache.attend(0, jnp.asarray(q), meta))
        out = np.asarray(out)
        for row in range(b):
            models[row].write(int(start[row]), kn[row, :q_lens[row]],
                              vn[row, :q_lens[row]] @ turn)
            end = int(start[row] + q_lens[row])
            if q_lens[row]:
                last_start[row] = start[row]
            length[row] = end
            if q_lens[row] == 0:
                continue
            positions = np.arange(start[row], end)
            for got, now in ((out, fused), (later, False)):
                keys, values = models[row].keys_values(end, fused=now)
                expected = _attention(q[row, :q_lens[row]], keys, values, positions, end) @ turn.T
                np.testing.assert_allclose(got[row, :q_lens[row]], expected, rtol=2e-5,
                                           atol=2e-5)


def test_a_window_slot_another_sequence_held_is_read_as_quantized() -> None:
    """A slot handed to a new sequence still holds the last one's page: its tag, not its slot,
    decides, so the newcomer's first page is never read from it."""
    k, d, g = 1, 16, 4
    cache = PagedKVCache.create(1, 4, g, k, d, kivi.KIVI_FORMAT, rotate=False, num_windows=1)
    tables = jnp.asarray([[0, 1]], jnp.int32)
    old = AttentionMetadata.for_prefill(jnp.asarray([3]), 3, page_tables=tables)
    old = AttentionMetadata(old.positions, old.lengths, old.q_lens, tables,
                            windows=jnp.asarray([[0, 5]], jnp.int32))
    x = jnp.ones((1, 3, k, d))
    cache = cache.write(0, x * 7, x * 7, old)
    new = AttentionMetadata(old.positions, old.lengths, old.q_lens, jnp.asarray([[2, 3]]),
                            windows=jnp.asarray([[0, 6]], jnp.int32))
    keys, _ = cache._gather_kivi(0, new, jnp.float32)
    np.testing.assert_array_equal(np.asarray(keys), 0)  # page 2: never written, not the window


@pytest.mark.parametrize("seed", range(4))
def test_a_row_without_a_window_touches_no_window(seed: int) -> None:
    """A row whose slot lies outside the ring (paged_metadata's "no window", int32 max, or any
    other) writes its pages and no window: the ring and its tags stay as the windowed rows left
    them, and their reads do not change. slot * WINDOW_PAGES wrapped int32 max to -2, whose
    write landed in the last slot's window."""
    rng = np.random.default_rng(seed)
    k, d, g, slots = 1, 16, 4, 3
    cache = PagedKVCache.create(1, 16, g, k, d, kivi.KIVI_FORMAT, rotate=False,
                                num_windows=slots)
    tables = jnp.asarray(rng.permutation(16)[:8].reshape(4, 2).astype(np.int32))
    windows = jnp.asarray([[s, 10 + s] for s in range(slots)], jnp.int32)
    owned = AttentionMetadata.for_prefill(jnp.asarray(rng.integers(1, 2 * g + 1, slots)), 2 * g,
                                          page_tables=tables[:slots])
    owned = AttentionMetadata(owned.positions, owned.lengths, owned.q_lens, tables[:slots],
                              windows=windows)
    x = jnp.asarray(rng.standard_normal((slots, 2 * g, k, d)), jnp.float32)
    cache = cache.write(0, x, x, owned)
    q = jnp.asarray(rng.standard_normal((slots, 2 * g, 2, d)), jnp.float32)
    before = (np.asarray(cache.k_window[0]), np.asarray(cache.window_tags[0]),
              np.asarray(cache.attend(0, q, owned)))
    outside = int(rng.choice([np.iinfo(np.int32).max, slots, slots + 7, -1,
                              np.iinfo(np.int32).max // kivi.WINDOW_PAGES + 1]))
    n = int(rng.integers(1, 2 * g + 1))
    alone = AttentionMetadata.for_prefill(jnp.asarray([n]), n, page_tables=tables[slots:])
    alone = AttentionMetadata(alone.positions, alone.lengths, alone.q_lens, tables[slots:],
                              windows=jnp.asarray([[outside, -1]], jnp.int32))
    y = jnp.asarray(rng.standard_normal((1, n, k, d)) * 5, jnp.float32)
    cache = cache.write(0, y, y, alone)
    after = (np.asarray(cache.k_window[0]), np.asarray(cache.window_tags[0]),
             np.asarray(cache.attend(0, q, owned)))
    for was, now in zip(before, after):
        np.testing.assert_array_equal(now, was, err_msg=f"slot {outside}")


def test_allocator_gives_each_sequence_its_own_window_and_takes_it_back() -> None:
    alloc = PageAllocator(8, 4, num_windows=2)
    a, b = alloc.new_sequence(), alloc.new_sequence()
    alloc.reserve(a, 5)
    alloc.reserve(b, 1)
    assert a.window[0] != b.window[0] and a.window[1] != b.window[1]
    c = alloc.new_sequence()
    with pytest.raises(OutOfWindows, match="2 window slots"):
        alloc.reserve(c, 1)
    assert c.pages == [] and alloc.num_free() == 8 - 3  # all or nothing
    slot_a, tag_a = a.window
    alloc.release(a)
    assert a.window is None
    alloc.reserve(c, 1)
    assert c.window[0] == slot_a and c.window[1] not in (tag_a, b.window[1])
    alloc.check_invariants()


def test_format_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="num_windows"):
        PagedKVCache.create(1, 4, 4, 1, 16, "int4_kivi")
    with pytest.raises(ValueError, match="divisible by the page size"):
        PagedKVCache.create(1, 4, 32, 1, 16, "int4_kivi", num_windows=1)
    with pytest.raises(ValueError, match="reference attention backend only"):
        PagedKVCache.create(1, 4, 4, 1, 16, "int4_kivi", "pallas", num_windows=1)
    from kernels_pallas.kv_quant import resolve_kv_format
    with pytest.raises(ValueError, match="format of the paged cache"):
        resolve_kv_format("int4_kivi")
    assert resolve_kv_format("int4_kivi", page_formats=True) == "int4_kivi"


@pytest.mark.parametrize("seed", range(2))
def test_engine_serves_each_request_as_it_would_alone(tiny_model, seed: int) -> None:
    """The engine with int4_kivi: more requests than window slots (each slot serves several
    sequences in turn), greedy and sampled rows, some prompts past a page, some across a prefill
    chunk; each request gets the tokens it gets alone. A window read by the wrong row, or kept
    from a finished sequence, would change them."""
    from tests.engine.test_engine import prompts, serve
    from tests.engines import tiny_engine

    from infer.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    inputs = prompts(7, seed=300 + seed, lo=2, hi=30)
    params = [SamplingParams(max_tokens=int(rng.integers(3, 20)), seed=int(rng.integers(1 << 30)),
                             temperature=float(rng.choice([0.0, 40.0])), ignore_eos=True)
              for _ in inputs]
    engine = tiny_engine(tiny_model, kv_cache_dtype="int4_kivi", max_num_seqs=3)
    together = serve(engine, inputs, params)
    engine.allocator.check_invariants()
    assert engine.allocator._free_windows and len(engine.allocator._free_windows) == 3
    alone = [serve(tiny_engine(tiny_model, kv_cache_dtype="int4_kivi", max_num_seqs=3), [p],
                   [sp])[0] for p, sp in zip(inputs, params)]
    assert together == alone
    float32 = serve(tiny_engine(tiny_model), inputs, params)
    assert together != float32  # the format is really in the path


def test_each_engine_sequence_keeps_its_filling_page_in_its_window() -> None:
    """Through the allocator and `paged_metadata`, as the engine builds its steps: after each
    decode step of three sequences (rows in a changing order), every row's window holds its own
    last two pages (one, until it has two), so none of them reads its filling page or the one
    before it quantized."""
    from infer.cache.metadata import paged_metadata

    g, k, d = 4, 1, 16
    alloc = PageAllocator(32, g, num_windows=3)
    cache = PagedKVCache.create(1, 32, g, k, d, kivi.KIVI_FORMAT, num_windows=3)
    seqs = [alloc.new_sequence() for _ in range(3)]
    rng = np.random.default_rng(0)
    for step in range(9):
        order = rng.permutation(3)
        rows = [seqs[i] for i in order]
        for s in rows:
            alloc.reserve(s, s.num_tokens + 1)
        cached = np.array([s.num_tokens for s in rows], np.int32)
        meta = paged_metadata(rows, 3, 8, cached, np.ones(3, np.int32), 1)
        x = jnp.asarray(rng.standard_normal((3, 1, k, d)), jnp.float32)
        cache = cache.write(0, x, x, meta)
        slot, tag = cache._windows(meta)
        held = np.asarray(cache._window_pages(0, slot, tag))
        for row, (s, pages) in enumerate(zip(cached // g, held)):
            want = {s, s - 1} if s >= 1 else {s}
            assert set(pages) - {-1} == want and (s < 1) == (-1 in pages), (s, pages)
        for s in rows:
            s.mark_computed(s.num_tokens + 1)
