"""Warm-up compiles every program a serving run executes: after `engine.warmup()` a run compiles
nothing, without speculation, with the n-gram, self-draft and EAGLE proposers and with prefix
caching, including the one-row verify step whose k+1 tokens equal a prefill chunk's bucket."""

from __future__ import annotations

import numpy as np
import pytest

from infer.engine.engine import Engine, EngineConfig
from infer.engine.runner import RunnerConfig, Shape
from infer.model.config import get_config
from infer.platform import CompileCounter
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig

TINY = get_config("tiny")


def test_shapes_list_the_one_row_verify_whose_tokens_are_a_prefill_bucket(tiny_model) -> None:
    """k = 15 with 16-token prefill chunks: the one-row verify [1, 16] and the one-chunk
    prefill [1, 16] are different programs, and both are listed (the verify twice when drafts
    may come with probabilities)."""
    from infer.engine.runner import Runner
    from infer.spec.ngram import NgramProposer

    config = RunnerConfig(num_pages=16, page_size=4, max_num_seqs=2, max_prefill_tokens=16,
                          max_model_len=64, num_speculative_tokens=15, min_window=32)
    runner = Runner(tiny_model, config, NgramProposer())
    shapes = set(runner.shapes())
    for width in (8, 16):
        assert {Shape("prefill", 1, 16, width), Shape("verify", 1, 16, width),
                Shape("verify", 2, 16, width), Shape("decode", 1, 1, width)} <= shapes
    assert len(shapes) == 2 * (2 + 2 + 1)  # per width: 2 decodes, 2 verifies, 1 prefill


def test_chunk_buckets_cover_every_chunk_and_stop_at_the_longest_sequence() -> None:
    # A chunk holds at most min(max_prefill_tokens, max_model_len) tokens: every length up to
    # that has a bucket, and none lies past it (max_model_len 31 with 64-token chunks compiled
    # programs of 48 and 64 tokens, twice with mixed steps, that no step could run).
    from infer.engine.buckets import bucket_for

    rng = np.random.default_rng(17)
    for _ in range(40):
        page_size = int(rng.choice([1, 4, 16]))
        config = RunnerConfig(num_pages=8, page_size=page_size,
                              max_prefill_tokens=int(rng.integers(1, 300)),
                              max_model_len=int(rng.integers(page_size, 300)),
                              min_window=int(rng.choice([16, 1 << 20])))
        longest = min(config.max_prefill_tokens, config.max_model_len)
        buckets = config.prefill_buckets
        assert buckets[-1] == longest, (config, buckets)
        assert all(bucket_for(n, buckets) >= n for n in range(1, longest + 1))


def test_min_window_is_a_validated_config_field(tiny_model) -> None:
    """The smallest attention window is the config's (it was a module global that a script
    overwrote for every engine in the process), passed down from the engine's config."""
    config = RunnerConfig(num_pages=4, page_size=16, max_model_len=256)
    assert config.window_buckets == (8, 16)  # 128 and 256 tokens
    assert RunnerConfig(num_pages=4, page_size=16, max_model_len=256,
                        min_window=32).window_buckets == (2, 4, 8, 16)
    for bad in (0, -16, True, 32.0):
        with pytest.raises(ValueError, match="min_window"):
            RunnerConfig(num_pages=4, min_window=bad)
    engine = Engine(tiny_model, None, EngineConfig(max_num_seqs=2, max_model_len=64,
                                                   page_size=4, min_window=16))
    assert engine.runner.config.min_window == 16
    assert engine.runner.config.window_buckets == (4, 8, 16)


def test_one_window_where_every_step_reads_its_tokens_in_place(tiny_model) -> None:
    """By default an engine whose steps all read their rows' tokens in place (the CPU attention
    kernel: float32 or bfloat16 pages, no trees) compiles one page-table width, the longest,
    since the width then costs nothing; a cache whose steps gather their window (int8 pages)
    keeps a width per power of two from MIN_WINDOW, and an explicit min_window is kept."""
    from infer.cache.paged import reads_in_place
    from infer.engine.buckets import powers_of_two
    from kernels_cpu import attention as cpu_attention

    if not cpu_attention.available():
        pytest.skip("the CPU attention kernel is not available here: every cache gathers")
    options = dict(max_num_seqs=2, max_model_len=256, page_size=16)
    dtype = tiny_model.embed[...].dtype
    for kv in ("auto", "bfloat16"):
        engine = Engine(tiny_model, None, EngineConfig(kv_cache_dtype=kv, **options))
        assert reads_in_place(engine.config.kv_cache_dtype, "reference", dtype,
                              tiny_model.config.head_dim)
        assert engine.runner.config.window_buckets == (16,)  # 256 tokens
        assert {s.width for s in engine.runner.shapes()} == {16}
        # With one width, chunk buckets 1.5 times apart cost a program each, not one per width.
        assert engine.runner.config.prefill_buckets == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    gathered = Engine(tiny_model, None, EngineConfig(kv_cache_dtype="int8", **options))
    assert not reads_in_place("int8", "reference", dtype, tiny_model.config.head_dim)
    assert gathered.runner.config.window_buckets == (8, 16)  # 128 and 256 tokens
    assert gathered.runner.config.prefill_buckets == powers_of_two(16, 256)
    chosen = Engine(tiny_model, None, EngineConfig(min_window=64, **options))
    assert chosen.runner.config.window_buckets == (4, 8, 16)


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random and repetitive prompts (lookup proposes on these), some sharing a 12-token
    prefix (three pages: a prefix cache hit), greedy and sampled with top-k and top-p."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, TINY.vocab_size, 12).tolist()
    prompts = [rng.integers(1, TINY.vocab_size, rng.integers(3, 36)).tolist() for _ in range(4)]
    prompts += [shared + rng.integers(1, TINY.vocab_size, n).tolist() for n in (2, 9, 20)]
    prompts += [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, shared + [3, 4] * 6]
    params = [SamplingParams(max_tokens=int(n), temperature=t, top_k=k, top_p=p, seed=i,
                             ignore_eos=True)
              for i, (n, t, k, p) in enumerate(zip(rng.integers(2, 26, len(prompts)),
                                                   [0.0, 0.7, 0.0, 1.3, 0.0] * 2,
                                                   [0, 5, 0, 0, 40] * 2,
                                                   [1.0, 1.0, 0.9, 1.0, 1.0] * 2))]
    return prompts, params


# Two windows (min_window=32: page tables of 8 and 16 pages) where rows cross from one width to
# the next; the model proposers, whose programs are the most, at one.
CASES = {
    "plain": dict(min_window=32),
    "prefix_caching": dict(min_window=32, enable_prefix_caching=True),
    "mixed_steps": dict(min_window=32, mixed_steps=True, enable_prefix_caching=True),
    # k + 1 = 16 = the only prefill bucket: the verify shape the old warm-up mistook for a prefill.
    "ngram_k15": dict(min_window=32, speculative=("ngram", 15), enable_prefix_caching=True),
    "self_draft": dict(speculative=("self_draft", 3), enable_prefix_caching=True),
    "eagle": dict(speculative=("eagle", 3), enable_prefix_caching=True),
    # Its metadata carries window slots: the warm-up's empty steps must carry them too.
    "int4_kivi": dict(min_window=32, kv_cache_dtype="int4_kivi", mixed_steps=True,
                      enable_prefix_caching=True),
    "int4_kivi_ngram": dict(min_window=32, kv_cache_dtype="int4_kivi", speculative=("ngram", 3),
                            enable_prefix_caching=True),
    # The default window on CPU (one width where steps read in place) with chunk buckets 16, 24
    # and 32.
    "one_width": dict(max_prefill_tokens=32, enable_prefix_caching=True),
    "one_width_mixed": dict(max_prefill_tokens=32, mixed_steps=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_compilation_after_warmup(tiny_model, tiny_weights, case) -> None:
    options = dict(CASES[case])
    spec = options.pop("speculative", None)
    if spec is not None:
        spec = SpeculativeConfig(spec[0], spec[1], self_draft_layers=1,
                                 draft_path=tiny_weights["draft"],
                                 eagle_path=tiny_weights["eagle"])
    engine = Engine(tiny_model, None, EngineConfig(**{
        **dict(max_num_seqs=2, max_prefill_tokens=16, max_model_len=64, page_size=4), **options,
        "speculative": spec}))
    engine.warmup()
    verified = []  # (rows, tokens) of each verify step, to check the run reached the edge case
    verify_step = engine.runner.device_steps.verify_step

    def recording(cache, tokens, *args):
        verified.append(tokens.shape)
        return verify_step(cache, tokens, *args)

    engine.runner.device_steps.verify_step = recording
    prompts, params = workload(seed=6)
    with CompileCounter() as compiles:
        for p, sp in zip(prompts, params):
            engine.add_request(prompt_token_ids=p, params=sp)
        engine.run_until_done()
        # Alone, again: one-row steps (verifies with greedy drafts, no probabilities), and with
        # prefix caching its whole prompt but the last token comes from the cache.
        engine.add_request(prompt_token_ids=prompts[-3], params=SamplingParams(
            max_tokens=20, ignore_eos=True))
        engine.run_until_done()
    assert compiles.count == 0
    if spec is not None:
        assert (1, spec.num_tokens + 1) in verified
    if options.get("enable_prefix_caching"):
        assert engine.prefix_cache_stats()["hit_tokens"] > 0
    if options.get("mixed_steps"):
        assert any(r.kind == "mixed" for r in engine.step_records())


@pytest.mark.parametrize("proposer", [None, "eagle"])
def test_warmup_returns_once_its_steps_have_run(tiny_model, tiny_weights, proposer) -> None:
    """Warm-up's empty steps are dispatched asynchronously; it returns only when they have run,
    so a caller's first step does not wait behind them: the runner's steps, and a model
    proposer's, which keeps a cache of its own. Each warm-up prefill program here (the runner's,
    or the proposer's) ends in a host callback that sleeps, so its cache is not ready for a
    while after dispatch."""
    import time

    import jax

    spec = (None if proposer is None else
            SpeculativeConfig(proposer, 3, eagle_path=tiny_weights["eagle"]))
    engine = Engine(tiny_model, None, EngineConfig(max_num_seqs=2, max_prefill_tokens=16,
                                                   max_model_len=64, page_size=4,
                                                   speculative=spec))

    def sleep_then(x):
        time.sleep(0.3)
        return x

    @jax.jit
    def slow(cache):
        return jax.tree.map(lambda a: jax.pure_callback(
            sleep_then, jax.ShapeDtypeStruct(a.shape, a.dtype), a), cache)

    if proposer is None:
        steps = engine.runner.device_steps
        prefill_step = steps.prefill_step

        def slow_prefill(cache, *args):
            *out, cache = prefill_step(cache, *args)
            return (*out, slow(cache))

        steps.prefill_step = slow_prefill
        caches = lambda: engine.runner.cache
    else:
        drafter = engine.runner.proposer
        forward = drafter._forward
        drafter._forward = lambda cache, *args: slow(forward(cache, *args))
        caches = lambda: drafter.cache
    engine.warmup()
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(caches()))


def test_a_step_planned_ahead_compiles_nothing_after_jax_drops_its_lowering(tiny_model,
                                                                           fresh_programs):
    """A first engine runs without planning ahead (host tokens only), and JAX's lowering cache
    then drops its programs, as thousands of other programs do in a long process (simulated by
    clearing it). A second engine over the same weights warms up, then plans steps ahead: fed
    a device array, jit's dispatch missed, found no lowering, and compiled inside the run (in
    the full test suite this test module's first case did, depending on what ran before)."""
    from jax._src import pjit
    from jax._src.interpreters import pxla

    config = dict(max_num_seqs=2, max_prefill_tokens=16, max_model_len=64, page_size=4,
                  min_window=32)
    prompts, params = workload(seed=6)
    first = Engine(tiny_model, None, EngineConfig(**config, async_scheduling=False))
    first.warmup()
    for p, sp in zip(prompts, params):
        first.add_request(prompt_token_ids=p, params=sp)
    first.run_until_done()
    pjit._pjit_lower.cache_clear()  # jit's lowerings, each holding its executable
    pxla.clear_in_memory_compilation_cache()
    second = Engine(tiny_model, None, EngineConfig(**config))
    second.warmup()
    with CompileCounter() as compiles:
        for p, sp in zip(prompts, params):
            second.add_request(prompt_token_ids=p, params=sp)
        second.run_until_done()
    assert any(r.planned_ahead for r in second.step_records())
    assert compiles.count == 0
