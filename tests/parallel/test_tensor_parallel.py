"""Tensor parallelism on virtual CPU devices (tests/conftest.py makes eight): head layouts,
placement, collectives per step, and the engine's tokens against one device's.

TP is never bitwise equal to one device (an all-reduce sums in another order): logits are
compared within 1e-4, and tokens exactly. Tokens are sampled (temperature 1, a seed per prompt):
that exercises the sampler over gathered logits too. A draw flips only when logits a few 1e-6
apart straddle its uniform; with fixed weights and seeds such a near-tie would show the same way
on every run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache.metadata import AttentionMetadata
from infer.cache.paged import PagedKVCache
from infer.engine.runner import Runner, RunnerConfig, Shape
from infer.llm import LLM
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.parallel.heads import apply_head_layout, head_layout
from infer.parallel.hlo import collectives
from infer.parallel.mesh import ParallelConfig
from infer.parallel.placement import bytes_per_device, place_replicas
from infer.platform import CompileCounter
from infer.sampling_params import SamplingParams

# SmolLM2's 3:1 grouping (9 query, 3 KV heads) at a size that compiles in seconds. Untied: with
# random weights a tied head maps each token's residual back onto the token itself, and every
# row would repeat its last prompt token.
GROUPED = dataclasses.replace(get_config("tiny"), name="tiny-3kv", num_heads=6, num_kv_heads=3,
                              intermediate_size=192, vocab_size=384, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def grouped() -> Llama:
    return Llama(GROUPED, jnp.float32, nnx.Rngs(5))


def _prefill_logits(model: Llama, mesh, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Logits at every position of a paged prefill of `tokens` [B, T] (rows of `lengths`)."""
    from infer.engine.device_steps import DeviceSteps
    c, (b, t) = model.config, tokens.shape
    pages = -(-t // 16)
    cache = PagedKVCache.create(c.num_layers, b * pages, 16, c.num_kv_heads, c.head_dim,
                                mesh=mesh)
    meta = AttentionMetadata.for_prefill(
        jnp.asarray(lengths, jnp.int32), t,
        page_tables=jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages))
    logits, _, _ = DeviceSteps(model, mesh).forward_step(cache, jnp.asarray(tokens), meta)
    return np.asarray(logits)


# -- head layouts ---------------------------------------------------------------------------------

def test_head_layouts_of_smollm2():
    smol = get_config("smollm2-135m")
    assert head_layout(smol, 3) == head_layout(smol, 3, pad_heads=True)
    assert head_layout(smol, 3).way == "split"
    with pytest.raises(ValueError, match=r"intermediate_size 1536; .*: \[1, 3\]"):
        head_layout(smol, 9)  # 9 heads would split, the FFN would not
    replicate = head_layout(GROUPED, 6)  # one query head per device, each next to its KV head
    assert (replicate.way, replicate.num_heads, replicate.num_kv_heads) == ("replicate", 6, 6)
    for t in (2, 4):
        with pytest.raises(ValueError, match=r"sizes that do: \[1, 3\].*pad_heads=True"):
            head_layout(smol, t)
        padded = head_layout(smol, t, pad_heads=True)
        assert (padded.way, padded.num_heads, padded.num_kv_heads) == ("pad", 12, 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        head_layout(get_config("tiny"), 3)


@pytest.mark.parametrize("t,pad", [(2, True), (4, True), (6, False), (8, True)])
def test_widened_heads_are_exact_on_one_device(grouped, t, pad):
    """Padding and replication change the weights, never the function: on one device the
    logits are bitwise those of the original heads."""
    layout = head_layout(GROUPED, t, pad_heads=pad)
    widened = apply_head_layout(grouped, layout)
    assert widened.config.num_kv_heads == layout.num_kv_heads != GROUPED.num_kv_heads
    rng = np.random.default_rng(t)
    tokens = rng.integers(0, GROUPED.vocab_size, (2, 24))
    lengths = np.array([24, int(rng.integers(1, 24))])
    from infer.parallel.placement import place_model
    np.testing.assert_array_equal(_prefill_logits(place_model(widened, None), None, tokens, lengths),
                                  _prefill_logits(grouped, None, tokens, lengths))


# -- placement ------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,pad", [(3, False), (2, True), (6, False)])
def test_logits_match_one_device(grouped, t, pad):
    (model, mesh), = place_replicas(grouped, ParallelConfig(t, 1, pad))
    rng = np.random.default_rng(10 + t)
    tokens = rng.integers(0, GROUPED.vocab_size, (3, 20))
    lengths = rng.integers(1, 21, 3)
    out = _prefill_logits(model, mesh, tokens, lengths)
    ref = _prefill_logits(grouped, None, tokens, lengths)
    valid = np.arange(20)[None] < lengths[:, None]
    np.testing.assert_allclose(out[valid], ref[valid], atol=1e-4, rtol=0)


def test_bytes_per_device_are_a_tp_th_of_the_sharded_parts(grouped):
    (model, mesh), = place_replicas(grouped, ParallelConfig(3))
    runner = Runner(model, RunnerConfig(num_pages=8, max_num_seqs=2, max_model_len=64),
                    mesh=mesh)
    params = runner.device_steps.params
    sharded = [p for p in params if not p.sharding.is_fully_replicated]
    whole = [p for p in params if p.sharding.is_fully_replicated]
    assert {len(p.sharding.device_set) for p in params} == {3}
    assert sum(p.nbytes for p in sharded) > 10 * sum(p.nbytes for p in whole)  # norms only
    held = bytes_per_device(params)
    expected = sum(p.nbytes for p in sharded) // 3 + sum(p.nbytes for p in whole)
    assert set(held.values()) == {expected}
    pools = runner.cache.k + runner.cache.v
    assert set(bytes_per_device(list(pools)).values()) == {sum(p.nbytes for p in pools) // 3}


@pytest.mark.parametrize("t,pad,shape", [
    (3, False, Shape("decode", 4, 1, 4)), (2, True, Shape("decode", 2, 1, 4)),
    (3, False, Shape("prefill", 1, 16, 4))])
def test_collectives_per_step(grouped, t, pad, shape):
    """Megatron's count: one all-reduce after the attention and one after the MLP of each layer,
    one for the vocabulary-parallel embedding, and one all-gather of the logits. Anything else
    (a weight gathered, pages moved between devices) is a sharding regression."""
    (model, mesh), = place_replicas(grouped, ParallelConfig(t, 1, pad))
    runner = Runner(model, RunnerConfig(num_pages=16, max_num_seqs=4, max_model_len=64),
                    mesh=mesh)
    _, lower = runner._program(shape)
    found = collectives(lower(runner.cache, *runner._dummy(shape)).compile().as_text())
    layers = GROUPED.num_layers
    assert found.counts == {"all-reduce": 2 * layers + 1, "all-gather": 1, "all-to-all": 0,
                            "reduce-scatter": 0, "collective-permute": 0}
    # The gather moves the logits of the rows that sample, nothing bigger.
    assert found.bytes["all-gather"] == shape.rows * GROUPED.vocab_size * 4


def test_cache_stays_on_its_heads_after_a_step(grouped):
    (model, mesh), = place_replicas(grouped, ParallelConfig(3))
    runner = Runner(model, RunnerConfig(num_pages=8, max_num_seqs=2, max_model_len=64),
                    mesh=mesh)
    before = [p.sharding for p in runner.cache.k]
    runner._run_shape(Shape("decode", 2, 1, 4))
    after = [p.sharding for p in runner.cache.k]
    assert all(a.is_equivalent_to(b, 4) for a, b in zip(after, before))
    assert before[0].spec[1] == "model"


# -- the engine -----------------------------------------------------------------------------------

def _sampled(llm: LLM, prompts: list[list[int]], max_tokens: int = 8,
             temperature: float = 1.0) -> list[list[int]]:
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert len({t for out in outs for t in out}) > len(outs)  # not one repeated token per row
    return outs


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, GROUPED.vocab_size, int(rng.integers(2, 15))).tolist()
            for _ in range(n)]


ENGINE = dict(max_num_seqs=4, max_model_len=64, max_prefill_tokens=16)


@pytest.fixture(scope="module")
def one_device_tokens(grouped):
    prompts = _prompts(0)
    return prompts, _sampled(LLM.from_loaded(GROUPED, grouped, None, **ENGINE), prompts)


@pytest.mark.parametrize("parallel", [
    dict(tensor_parallel_size=3), dict(tensor_parallel_size=2, pad_heads=True),
    dict(tensor_parallel_size=3, attention_backend="pallas"),
    dict(tensor_parallel_size=2, pad_heads=True, attention_backend="pallas", mixed_steps=True)])
def test_engine_tokens_match_one_device(grouped, one_device_tokens, parallel):
    prompts, expected = one_device_tokens
    llm = LLM.from_loaded(GROUPED, grouped, None, **ENGINE, **parallel)
    assert _sampled(llm, prompts) == expected


def test_int4_kivi_windows_split_over_heads_give_one_device_tokens(grouped):
    """int4_kivi's windows are split over kv heads with the pages: TP = 3 gives the tokens one
    device gives with the same format."""
    prompts = _prompts(2)
    kivi = dict(ENGINE, kv_cache_dtype="int4_kivi", page_size=8)
    one = _sampled(LLM.from_loaded(GROUPED, grouped, None, **kivi), prompts, max_tokens=12)
    llm = LLM.from_loaded(GROUPED, grouped, None, tensor_parallel_size=3, **kivi)
    assert llm.engine.runner.cache.k_window[0].sharding.spec[1] == "model"
    assert _sampled(llm, prompts, max_tokens=12) == one


def test_no_compilation_after_warmup_with_a_mesh(grouped):
    llm = LLM.from_loaded(GROUPED, grouped, None, tensor_parallel_size=3, **ENGINE)
    llm.engine.warmup()
    with CompileCounter() as compiles:
        _sampled(llm, _prompts(1, n=6))
    assert compiles.count == 0


def test_errors_before_any_weight_moves(grouped):
    with pytest.raises(ValueError, match="pad_heads=True"):
        LLM.from_loaded(GROUPED, grouped, None, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs 16 devices, but 8 are visible"):
        LLM.from_loaded(GROUPED, grouped, None, tensor_parallel_size=4, data_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int"):
        ParallelConfig(tensor_parallel_size=0)


def test_smollm2_tp3_gives_one_device_greedy_tokens(smollm2_4_layers):
    """SmolLM2's weights and its 9/3 heads (its first 4 layers: the split is per layer)."""
    config, model, tokenizer = smollm2_4_layers
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    engine = dict(max_num_seqs=2, max_model_len=128, max_prefill_tokens=16)
    one = _sampled(LLM.from_loaded(config, model, tokenizer, **engine), prompts, 6, 0.0)
    three = _sampled(LLM.from_loaded(config, model, tokenizer, tensor_parallel_size=3, **engine),
                     prompts, 6, 0.0)
    assert three == one
    assert jax.device_count() >= 3


def test_async_collectives_count_their_results_only():
    """On GPU, XLA splits an all-gather or a collective-permute into a -start whose value is a
    tuple of its operand and its result (and, for a permute, two u32 contexts): the bytes are the
    result's, as for the synchronous op, while an all-reduce-start's value is its result alone
    (a tuple only when it reduces several arrays)."""
    rng = np.random.default_rng()
    rows, vocab, embed = (int(n) for n in rng.integers(1, 64, 3))
    sync = (f"%ag = f32[{rows},{vocab}]{{1,0}} all-gather(f32[{rows},{vocab // 2}]{{1,0}} %x)\n"
            f"%cp = bf16[{embed}]{{0}} collective-permute(bf16[{embed}]{{0}} %y)\n"
            f"%ar = (f32[{rows},{embed}]{{1,0}}, f32[{embed}]{{0}}) all-reduce(%a, %b)\n")
    split = (f"%ag-start = (f32[{rows},{vocab // 2}]{{1,0}}, f32[{rows},{vocab}]{{1,0}}) "
             f"all-gather-start(f32[{rows},{vocab // 2}]{{1,0}} %x)\n"
             f"%ag-done = f32[{rows},{vocab}]{{1,0}} all-gather-done(%ag-start)\n"
             f"%cp-start = (bf16[{embed}]{{0}}, bf16[{embed}]{{0}}, u32[], u32[]) "
             f"collective-permute-start(bf16[{embed}]{{0}} %y)\n"
             f"%cp-done = bf16[{embed}]{{0}} collective-permute-done(%cp-start)\n"
             f"%ar-start = (f32[{rows},{embed}]{{1,0}}, f32[{embed}]{{0}}) all-reduce-start(%a, %b)\n"
             f"%ar-done = (f32[{rows},{embed}]{{1,0}}, f32[{embed}]{{0}}) all-reduce-done(%ar-start)\n")
    assert collectives(split) == collectives(sync)
    assert collectives(sync).bytes["all-gather"] == rows * vocab * 4


@pytest.mark.parametrize("t,pad", [(3, False), (2, True), (6, False)])
def test_a_tiled_model_is_refused_before_its_heads_are_laid_out(grouped, t, pad):
    """A one-CPU engine's model (`LLM.model`, in the kernel's tile layout) handed to a mesh: the
    same clear error whichever head layout the size needs (padding and replicating reshaped the
    packed weights first and failed with numpy's reshape error)."""
    from infer.model.llama import tile_weights
    tiled = tile_weights(grouped)
    with pytest.raises(ValueError, match="tile layout"):
        place_replicas(tiled, ParallelConfig(t, 1, pad))


@pytest.mark.parametrize("field,value", [("tensor_parallel_size", 0), ("data_parallel_size", 2.0),
                                         ("tensor_parallel_size", True), ("pad_heads", "no"),
                                         ("pad_heads", 1), ("pad_heads", None)])
def test_parallel_config_refuses_values_of_the_wrong_kind(field, value):
    """pad_heads="no" (a string from a config file) is truthy: it padded without a word."""
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**{field: value})
