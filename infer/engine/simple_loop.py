"""The simple generation loop over a contiguous KV cache: one batch, prefill once, then decode
until the caller stops listening. The serving engine replaces it for anything with arrivals.

Besides the engine it is the one loop of infer: `decode_stream` is the batch's token stream,
`timed_generate` the host loop of one sequence (stop at max_new_tokens or an eos id, time the
prefill and the decode, count tokens per step) for any step function, so the plain baseline
(`generate`, the stream at batch 1) and tree speculation (`infer.spec.tree.tree_generate`) are
measured by the same code.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata, check_writes
from infer.cache.page_allocator import SequencePages, page_tables
from infer.cache.paged import PagedKVCache
from infer.engine.buckets import prompt_bucket, window_bucket
from infer.engine.device_steps import DecodeState, DeviceSteps
from infer.engine.request import RequestLimits, validate_request
from infer.model.llama import Llama
from infer.sampling import SamplingArrays
from infer.sampling_params import SamplingParams


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int,
                     sampling: Sequence[SamplingParams]) -> list[list[int]]:
    """The engine's request check (`infer.engine.request.validate_request`) on every prompt,
    with the prompt's index in the message; returns the prompts as lists of ints."""
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


def check_loop_params(sampling: Sequence[SamplingParams]) -> None:
    """Refuses what a loop outside the engine (this one, tree speculation's) cannot honour: it
    draws tokens and stops where its caller does (max_new_tokens, its eos_ids), so logprobs,
    structured output and stops asked for in the params would be ignored without a word."""
    plain = [i for i, p in enumerate(sampling) if p.plain_steps_only]
    if plain:
        raise ValueError(f"rows {plain} ask for logprobs or structured output: the engine "
                         "(LLM, Engine) serves those, loops outside it do not")
    stopping = [i for i, p in enumerate(sampling) if p.stop or p.stop_token_ids]
    if stopping:
        raise ValueError(f"rows {stopping} ask for stop strings or stop_token_ids: the engine "
                         "(LLM, Engine) stops at those; loops outside it run max_new_tokens "
                         "steps (generate: until one of its eos_ids)")


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
    check_loop_params(sampling)
    # The loop stops after max_new_tokens whatever each row's max_tokens says: check that.
    sampling = [dataclasses.replace(p, max_tokens=max_new_tokens).with_resolved_seed()
                for p in sampling]
    prompts = validate_prompts(prompts, config.vocab_size, config.max_position_embeddings,
                               sampling)
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    prompt_len = prompt_bucket(int(lengths.max()))
    max_len = max(window_bucket(int(lengths.max()) + max_new_tokens,
                                cap=config.max_position_embeddings), prompt_len)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt

    if paged is None:
        cache = KVCache.create(config.num_layers, batch, prompt_len, config.num_kv_heads,
                               config.head_dim, cache_dtype)
        pages = None
    else:
        g = paged.page_size
        per_row = -(-max_len // g)
        order = np.random.default_rng(paged.seed).permutation(batch * per_row).tolist()
        pages = [SequencePages(g, order[row * per_row:(row + 1) * per_row])
                 for row in range(batch)]
        # Row b is one sequence throughout: its window, for formats that keep one, is slot b.
        cache = PagedKVCache.create(config.num_layers, batch * per_row, g, config.num_kv_heads,
                                    config.head_dim, paged.kv_format, paged.backend,
                                    num_windows=batch)

    def tables_for(window: int) -> jax.Array | None:
        return None if pages is None else jnp.asarray(
            page_tables(pages, batch, -(-window // paged.page_size)))

    arrays = SamplingArrays.from_params(sampling)
    sample_index = jnp.zeros(batch, jnp.int32)
    meta = AttentionMetadata.for_prefill(lengths, prompt_len, page_tables=tables_for(prompt_len))
    check_writes(0, lengths, cache.max_len if paged is None
                 else meta.page_tables.shape[1] * paged.page_size)
    first, _, _, cache = steps_fn.prefill_step(cache, jnp.asarray(tokens), meta, arrays,
                                               sample_index)
    state = DecodeState(tokens=first, lengths=jnp.asarray(lengths), sample_index=sample_index + 1,
                        sampling=arrays, page_tables=meta.page_tables)
    window, longest = prompt_len, int(lengths.max())
    pending = first
    for _ in range(max_new_tokens - 1):
        longest += 1
        if longest > window:  # grow by powers of two: each size is one more compile
            window = window_bucket(longest, cap=max_len)
            if paged is None:
                cache = cache.resized(window)
            else:
                state = dataclasses.replace(state, page_tables=tables_for(window))
        state, _, cache = steps_fn.decode_step(cache, state)
        yield np.asarray(pending)
        pending = state.tokens
    yield np.asarray(pending)


def timed_generate(first: Callable[[], int], step: Callable[[], Sequence[int]],
                   max_new_tokens: int, eos_ids: Sequence[int] = (), max_step_tokens: int = 1
                   ) -> tuple[list[int], dict[str, float]]:
    """The host loop of one sequence: `first()` prefills and returns the first token, each
    `step()` returns the tokens one step emitted (a plain decode step one, a speculative step
    its accepted drafts then the target's token, at most `max_step_tokens`). Stops after
    max_new_tokens tokens or an eos id (the tokens a step emitted past it are dropped).

    Returns (token ids, stats): prefill_s (to the first token), decode_s, decode_tok_s and
    decode_step_s (the steps after it), verify_steps (steps taken), accepted (tokens steps
    emitted beyond one each: accepted drafts), full_steps (steps that emitted max_step_tokens),
    mean_accepted and tokens_per_step (per step). The clock stops when the last token is on
    the host, so a step function must return host values."""
    start = time.perf_counter()
    out = [int(first())]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    accepted, steps, full, stop = 0, 0, 0, set(eos_ids)
    while len(out) < max_new_tokens and out[-1] not in stop:
        emitted = list(step())
        steps += 1
        accepted += len(emitted) - 1
        full += len(emitted) == max_step_tokens
        for token in emitted:
            out.append(int(token))
            if token in stop or len(out) == max_new_tokens:
                break
    decode_s = time.perf_counter() - start
    per_step = lambda x: x / steps if steps else float("nan")
    return out, {"prefill_s": prefill_s, "decode_s": decode_s,
                 "decode_tok_s": (len(out) - 1) / decode_s if decode_s > 0 else float("nan"),
                 "decode_step_s": per_step(decode_s), "verify_steps": steps,
                 "accepted": accepted, "full_steps": full, "mean_accepted": per_step(accepted),
                 "tokens_per_step": per_step(accepted + steps)}


def generate(model: Llama | DeviceSteps, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
             cache_dtype: jnp.dtype = jnp.float32) -> tuple[list[int], dict[str, float]]:
    """Plain decoding of one prompt: `decode_stream` at batch 1 through `timed_generate` (the
    baseline tree speculation is measured against). Pass a `DeviceSteps` to generate more than
    once with the same compiled programs (a model builds them per call)."""
    stream = decode_stream(model, [prompt_ids], [sampling], max_new_tokens, cache_dtype)
    try:
        return timed_generate(lambda: next(stream)[0], lambda: next(stream)[:1].tolist(),
                              max_new_tokens, eos_ids)
    finally:
        stream.close()
