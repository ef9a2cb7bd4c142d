"""int4_kivi: 4-bit keys quantized per channel over each page (KIVI), 4-bit values per token, and
each sequence's page still filling held in bfloat16 beside the pool.

Why this scheme: per-token int4 keys kept 89.9% of SmolLM2's next tokens; keys have outlier
*channels* whose range moves slowly along the sequence, so one (step, low) per channel over a page
of tokens fits them far better (`experiments.int4_keys` measured the candidates by simulation).

Layout of one page of G tokens and one kv head (D the head dim):
  keys, page index >= 1   data [G, D/2] uint8, two nibbles a byte along D (element 2i low); codes
                          [G, 2D/G] uint8: flattened, D step codes then D low codes, one pair per
                          channel over the page's G tokens
  keys, page index 0      the same bytes, quantized per token in groups of G channels: row g holds
                          token g's D/G step codes then its D/G low codes. The first page holds
                          the attention sink (token 0), whose outliers would otherwise set every
                          channel's range for the 31 ordinary tokens beside it; per token they set
                          only their own. Same bytes, and nothing to keep beyond the page.
  values                  per token in groups of min(32, D) channels, Hadamard-rotated first (as
                          every quantized format of the cache is): codes [G, 2D/group]
A step is a uint8 code c: step = 2^(c / 10 - 16), 1.5e-5 to 724 in steps of 7.2%, rounded up so
that the group's range fits; the low is an integer multiple z of the step, stored as int8 bits for
z in [-127, 127] (so a zeroed page reads back as zeros) (the step is raised to |low| / 127 when needed so that z never clips). A group's
values then come back within one step; its range may reach 15 * 724 = 10,800 and its low
127 * 724 = 92,000.

At G = 32, D = 64 a token costs 32 + 4 bytes for its key and as much for its value: 72 bytes
against bfloat16's 256, 1/3.56. Each sequence also holds its last WINDOW_PAGES pages in bfloat16
(the window: a ring of WINDOW_PAGES * 2 * G * D * 2 bytes per kv head and layer, K and V; page j
in ring entry j % WINDOW_PAGES), which a query reads instead of the quantized pages, as KIVI reads
its residual: a token is read per-channel-quantized only once its page is whole and the next
page is whole too. Why two pages and not one: with one, a token just past a page boundary reads
the whole previous page quantized; reading it exact too raised the simulated top-1 agreement
from 95.8% to 96.8% (`experiments.int4_keys`), and a rollback across a boundary (rejected draft
tokens) then re-quantizes the earlier page from exact values, not from its dequantized self.
A rollback cannot undo a write that crossed into the next page, though: that page's ring entry
is the previous page's, whose exact copy it evicted. So speculation over this format verifies
no drafts past the page of a row's next position (`SchedulerConfig.drafts_within_page`), and
rejected drafts leave the window as plain decoding would.
Pages a request takes from the prefix cache (its own too, when preemption sends it back to
recompute) never enter its window, which holds what it writes: a prefix hit's last pages read
quantized where the request alone would have read them exact, so with prefix caching outputs
can differ slightly from a lone run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KIVI_FORMAT = "int4_kivi"
VALUE_GROUP = 32
STEP_CODES_PER_OCTAVE, STEP_OFFSET = 10, 16  # step = 2^(code / 10 - 16)
LOW_MAX = 127
WINDOW_PAGES = 2  # a sequence's newest pages read exact (bfloat16), in a ring
WINDOW_TAG_BYTES = WINDOW_PAGES * 2 * 4  # per layer and sequence: (tag, page) int32 per entry


def check_geometry(head_dim: int, page_size: int) -> None:
    """ValueError unless the format can lay out pages of `page_size` tokens of `head_dim`."""
    if head_dim % 2 or head_dim % page_size or head_dim % value_group(head_dim):
        raise ValueError(f"{KIVI_FORMAT} needs an even head dim divisible by the page size "
                         f"(page 0's keys are quantized per token in groups of page-size "
                         f"channels) and by {VALUE_GROUP} (or below it): D={head_dim}, "
                         f"G={page_size}")


def check_backend(backend: str) -> None:
    """ValueError unless `backend` reads this format's pages."""
    if backend != "reference":
        raise ValueError(f"{KIVI_FORMAT} is read by the reference attention backend only: the "
                         "Pallas kernels do not implement its per-channel key pages or its "
                         "bfloat16 windows")


def value_group(head_dim: int) -> int:
    return min(VALUE_GROUP, head_dim)


def key_codes(head_dim: int, page_size: int) -> int:
    """Code bytes per key row of a page (last dim of the key codes)."""
    return 2 * head_dim // page_size


def value_codes(head_dim: int) -> int:
    return 2 * head_dim // value_group(head_dim)


def bytes_per_token(head_dim: int, page_size: int) -> tuple[float, float]:
    """(key, value) bytes one token costs per kv head, codes included, the window not."""
    return head_dim / 2 + key_codes(head_dim, page_size), head_dim / 2 + value_codes(head_dim)


def window_bytes(head_dim: int, page_size: int) -> int:
    """Bytes of one sequence's bfloat16 window (its ring of WINDOW_PAGES pages) per kv head and
    layer, K and V."""
    return WINDOW_PAGES * 2 * page_size * head_dim * 2


def step_of(code: jax.Array) -> jax.Array:
    return jnp.exp2(code.astype(jnp.float32) / STEP_CODES_PER_OCTAVE - STEP_OFFSET)


def _encode(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Groups of x (float32) along `axis` -> (levels q in [0, 15] as int32, shaped like x; step
    codes and low codes (int8 bits) as uint8, `axis` removed)."""
    hi = jnp.max(x, axis=axis, keepdims=True)
    lo = jnp.min(x, axis=axis, keepdims=True)
    need = jnp.maximum((hi - lo) / 15, jnp.abs(lo) / LOW_MAX)
    exponent = jnp.log2(jnp.maximum(need, 1e-30)) + STEP_OFFSET
    code = jnp.clip(jnp.ceil(exponent * STEP_CODES_PER_OCTAVE), 0, 255)
    step = step_of(code)
    z = jnp.clip(jnp.round(lo / step), -LOW_MAX, LOW_MAX)
    q = jnp.clip(jnp.round(x / step - z), 0, 15).astype(jnp.int32)
    squeeze = lambda a: jnp.squeeze(a, axis)
    low_bits = jax.lax.bitcast_convert_type(squeeze(z).astype(jnp.int8), jnp.uint8)
    return q, squeeze(code).astype(jnp.uint8), low_bits


def _pack(q: jax.Array) -> jax.Array:
    """int32 levels [..., D] -> uint8 [..., D/2], element 2i in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(jnp.uint8)


def _unpack(data: jax.Array) -> jax.Array:
    """uint8 [..., D/2] -> float32 levels [..., D]."""
    d = data.astype(jnp.int32)
    both = jnp.stack([d & 0xF, (d >> 4) & 0xF], axis=-1)
    return both.reshape(*data.shape[:-1], 2 * data.shape[-1]).astype(jnp.float32)


def _decode(q: jax.Array, code: jax.Array, low: jax.Array) -> jax.Array:
    z = jax.lax.bitcast_convert_type(low, jnp.int8).astype(jnp.float32)
    return (q + z) * step_of(code)


def quantize_key_tokens(keys: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Keys [..., D] per token, in groups of page_size channels: page 0's layout, a row per
    token -> (data [..., D/2], codes [..., 2D/G]), D/G step codes then D/G low codes."""
    d = keys.shape[-1]
    grouped = keys.astype(jnp.float32).reshape(*keys.shape[:-1], d // page_size, page_size)
    q, step, low = _encode(grouped, axis=-1)
    return _pack(q.reshape(keys.shape)), jnp.concatenate([step, low], axis=-1)


def quantize_key_pages(keys: jax.Array, first: jax.Array | bool) -> tuple[jax.Array, jax.Array]:
    """Whole pages of keys [N, K, G, D] -> (data [N, K, G, D/2], codes [N, K, G, 2D/G]); pages
    where first [N] is true per token (page index 0), the others per channel (one Python bool:
    every page so, and only that layout is computed)."""
    n, k, g, d = keys.shape
    keys = keys.astype(jnp.float32)

    def per_channel():
        q, step, low = _encode(keys, axis=2)  # [N, K, D]
        return _pack(q), jnp.concatenate([step, low], axis=-1).reshape(n, k, g, 2 * d // g)

    if isinstance(first, bool):
        return quantize_key_tokens(keys, g) if first else per_channel()
    pick = first[:, None, None, None]
    (data_t, codes_t), (data_c, codes_c) = quantize_key_tokens(keys, g), per_channel()
    return jnp.where(pick, data_t, data_c), jnp.where(pick, codes_t, codes_c)


def dequantize_key_pages(data: jax.Array, codes: jax.Array, first: jax.Array,
                         dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The inverse of `quantize_key_pages` on pages [..., K, G, D/2] (first broadcasting against
    the leading dims) -> [..., K, G, D] in `dtype`."""
    *lead, k, g, half = data.shape
    d = 2 * half
    q = _unpack(data)
    flat = codes.reshape(*lead, k, 1, 2 * d)
    per_channel = _decode(q, flat[..., :d], flat[..., d:])
    expand = lambda c: jnp.repeat(c, g, axis=-1)  # [.., G, D/G] -> [.., G, D]
    per_token = _decode(q, expand(codes[..., :d // g]), expand(codes[..., d // g:]))
    first = jnp.asarray(first)[..., None, None, None]
    return jnp.where(first, per_token, per_channel).astype(dtype)


def quantize_values(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """values [..., D] -> (data [..., D/2], codes [..., 2D/group]) per token."""
    d = values.shape[-1]
    group = value_group(d)
    grouped = values.astype(jnp.float32).reshape(*values.shape[:-1], d // group, group)
    q, step, low = _encode(grouped, axis=-1)
    return _pack(q.reshape(values.shape)), jnp.concatenate([step, low], axis=-1)


def dequantize_values(data: jax.Array, codes: jax.Array, dtype: jnp.dtype = jnp.float32
                      ) -> jax.Array:
    d = 2 * data.shape[-1]
    groups = d // value_group(d)
    expand = lambda c: jnp.repeat(c, value_group(d), axis=-1)
    return _decode(_unpack(data), expand(codes[..., :groups]),
                   expand(codes[..., groups:])).astype(dtype)
