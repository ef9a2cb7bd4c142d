"""The simple generation loop over a contiguous KV cache: one batch, prefill once, then decode
until the caller stops listening. The serving engine replaces it for anything with arrivals."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata, check_writes
from infer.cache.paged import PagedKVCache
from infer.engine.buckets import next_power_of_two
from infer.engine.device_steps import DecodeState, DeviceSteps
from infer.engine.request import RequestLimits, validate_request
from infer.model.llama import Llama
from infer.sampling import SamplingArrays
from infer.sampling_params import SamplingParams

MIN_ATTEND = 128  # smallest attention window; each larger power of two is one more compile


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int,
                     sampling: Sequence[SamplingParams]) -> list[list[int]]:
    """The engine's request check (`infer.request.validate_request`) on every prompt, with the
    prompt's index in the message; returns the prompts as lists of ints."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
    limits = RequestLimits(vocab_size=vocab_size, max_model_len=max_len)
    checked = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling)):
        try:
            checked.append(validate_request(prompt, params, limits))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return checked


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Run the loop over a paged cache instead of the contiguous one. Pages are handed out in a
    shuffled order, as a long-running pool would, so page tables really are indirections."""

    page_size: int = 16
    kv_format: str = "float32"
    backend: str = "reference"
    seed: int = 0


def decode_stream(model: Llama | DeviceSteps, prompts: Sequence[Sequence[int]],
                  sampling: Sequence[SamplingParams], max_new_tokens: int,
                  cache_dtype: jnp.dtype = jnp.float32,
                  paged: PagedLayout | None = None) -> Iterator[np.ndarray]:
    """Yields the next token of every prompt [B], first from the prefill, then one decode step at a
    time, for at most `max_new_tokens` steps; the caller stops early by closing the generator.

    The cache (and, when paged, the page-table width) covers a power-of-two window of the longest
    row and grows with it: attention reads only that window. The next decode step is dispatched
    before the previous tokens are read back, so the host's bookkeeping overlaps the device work.
    """
    steps_fn = model if isinstance(model, DeviceSteps) else DeviceSteps(model)
    config = steps_fn.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    # The loop stops after max_new_tokens whatever each row's max_tokens says: check that.
    sampling = [dataclasses.replace(p, max_tokens=max_new_tokens).with_resolved_seed()
                for p in sampling]
    prompts = validate_prompts(prompts, config.vocab_size, config.max_position_embeddings,
                               sampling)
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    prompt_len = next_power_of_two(int(lengths.max()), 16)
    max_len = max(min(next_power_of_two(int(lengths.max()) + max_new_tokens, MIN_ATTEND),
                      config.max_position_embeddings), prompt_len)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt

    if paged is None:
        cache = KVCache.create(config.num_layers, batch, prompt_len, config.num_kv_heads,
                               config.head_dim, cache_dtype)
        all_tables = None
    else:
        g = paged.page_size
        per_row = -(-max_len // g)
        order = np.random.default_rng(paged.seed).permutation(batch * per_row)
        all_tables = order.reshape(batch, per_row).astype(np.int32)
        cache = PagedKVCache.create(config.num_layers, batch * per_row, g, config.num_kv_heads,
                                    config.head_dim, paged.kv_format, paged.backend)

    def tables_for(window: int) -> jax.Array | None:
        return None if all_tables is None else jnp.asarray(
            all_tables[:, :-(-window // paged.page_size)])

    arrays = SamplingArrays.from_params(sampling)
    steps = jnp.zeros(batch, jnp.int32)
    meta = AttentionMetadata.for_prefill(lengths, prompt_len, page_tables=tables_for(prompt_len))
    check_writes(0, lengths, cache.max_len if paged is None
                 else meta.page_tables.shape[1] * paged.page_size)
    first, _, _, cache = steps_fn.prefill_step(cache, jnp.asarray(tokens), meta, arrays, steps)
    state = DecodeState(tokens=first, lengths=jnp.asarray(lengths), steps=steps + 1,
                        sampling=arrays, page_tables=meta.page_tables)
    window, longest = prompt_len, int(lengths.max())
    pending = first
    for _ in range(max_new_tokens - 1):
        longest += 1
        if longest > window:  # grow by powers of two: each size is one more compile
            window = min(next_power_of_two(longest, MIN_ATTEND), max_len)
            if paged is None:
                cache = cache.resized(window)
            else:
                state = dataclasses.replace(state, page_tables=tables_for(window))
        state, _, cache = steps_fn.decode_step(cache, state)
        yield np.asarray(pending)
        pending = state.tokens
    yield np.asarray(pending)
