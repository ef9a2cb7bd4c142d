"""The serving engine end to end on real weights and on a tiny model: exactness under batching,
preemption and policies, seeds, streaming callbacks, aborts, bad input, and the compile counter
that tests/engine/test_warmup.py relies on."""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

from infer.engine.engine import Engine, EngineConfig
from infer.engine.request import FinishReason
from infer.model.config import get_config
from infer.platform import CompileCounter
from infer.sampling_params import SamplingParams
from tests.engines import tiny_engine

TINY = get_config("tiny")


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, rng.integers(lo, hi)).tolist() for _ in range(n)]


def serve(engine: Engine, inputs: list[list[int]], params) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(inputs)
    ids = [engine.add_request(prompt_token_ids=p, params=sp) for p, sp in zip(inputs, params)]
    engine.run_until_done()
    return [engine.output(i).token_ids for i in ids]


def test_greedy_alone_equals_inside_a_batch_of_32_smollm2(smollm2_4_layers) -> None:
    """SmolLM2's weights (its first 4 layers: each row's arithmetic is per layer): a greedy
    request gives the same tokens alone as among 31 others (different lengths, some sampled),
    whatever its batch row and the padding around it."""
    _, model, tokenizer = smollm2_4_layers
    from experiments.common import real_text
    text = tokenizer.encode(real_text(30_000, offset=100_000))
    rng = np.random.default_rng(1)
    others = [text[s:s + n] for s, n in zip(rng.integers(0, 5000, 31), rng.integers(5, 60, 31))]
    probe = tokenizer.encode("The three laws of thermodynamics are")
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_num_seqs=32, max_prefill_tokens=64, max_model_len=128)
    alone = serve(Engine(model, tokenizer, config), [probe], greedy)[0]
    mixed = [SamplingParams(max_tokens=int(n), temperature=0.8 if i % 3 else 0.0, seed=i,
                            ignore_eos=True) for i, n in enumerate(rng.integers(4, 16, 31))]
    batch = serve(Engine(model, tokenizer, config), others[:17] + [probe] + others[17:],
                  mixed[:17] + [greedy] + mixed[17:])
    assert batch[17] == alone


def test_same_seed_same_tokens_whatever_the_company(tiny_model) -> None:
    # The random tiny model's logits span ~100: a high temperature makes the draws really vary.
    sampled = SamplingParams(temperature=40.0, top_p=0.95, seed=1234, max_tokens=20,
                             ignore_eos=True)
    probe = prompts(1, seed=9)[0]
    a = serve(tiny_engine(tiny_model), [probe], sampled)[0]
    b = serve(tiny_engine(tiny_model), prompts(5, seed=2) + [probe],
              [SamplingParams(temperature=0.7, seed=s, max_tokens=9) for s in range(5)] + [sampled])[-1]
    c = serve(tiny_engine(tiny_model), [probe], SamplingParams(
        temperature=40.0, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True))[0]
    assert a == b and a != c
    assert len(set(a)) > 5  # the draws do vary, so equality above means something


def test_policies_and_preemption_do_not_change_outputs(tiny_model) -> None:
    """Static and continuous batching, and a page pool so small that requests are preempted
    and recomputed, give the same greedy tokens."""
    inputs = prompts(10, seed=4)
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in
              np.random.default_rng(5).integers(5, 30, 10)]
    reference = serve(tiny_engine(tiny_model), inputs, params)
    static = serve(tiny_engine(tiny_model, scheduler="static"), inputs, params)
    small = tiny_engine(tiny_model, num_pages=24)
    preempted = serve(small, inputs, params)
    assert sum(small.output(str(i)).metrics.num_preemptions for i in range(10)) > 0
    assert static == reference and preempted == reference


@pytest.mark.parametrize("seed", range(3))
def test_async_scheduling_gives_the_same_tokens(tiny_model, seed: int) -> None:
    """Planning each decode step while the one before it runs changes no token: random
    prompts, lengths, sampled and greedy rows, stop tokens that end requests early, static and
    continuous batching; and steps really were planned ahead."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    inputs = prompts(n, seed=100 + seed)
    params = [SamplingParams(max_tokens=int(rng.integers(1, 30)), seed=int(rng.integers(1 << 30)),
                             temperature=float(rng.choice([0.0, 40.0])), ignore_eos=True)
              for _ in range(n)]
    free = serve(tiny_engine(tiny_model), inputs, params)
    # Stop tokens met midway: the step planned after such a token has a row for nothing.
    params = [dataclasses.replace(p, stop_token_ids=(out[len(out) // 2],)) if len(out) > 2
              and rng.random() < 0.6 else p for p, out in zip(params, free)]
    policy = str(rng.choice(["continuous", "static"]))
    results = {}
    for on in (False, True):
        engine = tiny_engine(tiny_model, scheduler=policy, async_scheduling=on,
                             max_num_seqs=int(rng.integers(2, 6)) if not on else 4)
        results[on] = serve(engine, inputs, params)
        ahead = sum(r.planned_ahead for r in engine.step_records())
        assert (ahead > 0) == on, ahead
    assert results[True] == results[False]
    assert any(len(o) < p.max_tokens for o, p in zip(results[True], params))  # some stopped


@pytest.mark.parametrize("backend, seed", [("reference", 0), ("reference", 1), ("pallas", 2)])
def test_mixed_steps_give_the_same_tokens(tiny_model, backend: str, seed: int) -> None:
    """A prefill chunk and the decode rows in one forward (the Pallas backend: one ragged
    attention call) give the tokens alternating steps give: prompts longer than a chunk, more
    requests than slots, so that chunks keep meeting decode rows; and mixed steps did run."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 9))
    inputs = prompts(n, seed=200 + seed, lo=3, hi=40)
    params = [SamplingParams(max_tokens=int(rng.integers(2, 20)), seed=int(rng.integers(1 << 30)),
                             temperature=float(rng.choice([0.0, 1.0])), ignore_eos=True)
              for _ in range(n)]
    results = {}
    for mixed in (False, True):
        engine = tiny_engine(tiny_model, mixed_steps=mixed, attention_backend=backend)
        results[mixed] = serve(engine, inputs, params)
        kinds = Counter(r.kind for r in engine.step_records())
        assert (kinds["mixed"] > 0) == mixed, kinds
    assert results[True] == results[False]


def test_pallas_engine_gives_the_reference_tokens_smollm2(smollm2_4_layers) -> None:
    """SmolLM2's weights and shapes (its first 4 layers), greedy, through the engine: the Pallas
    kernels (interpreted on CPU) give the reference backend's tokens, in plain steps and in mixed
    ones (the ragged kernel: a second prompt's chunks arrive while the first decodes)."""
    _, model, tokenizer = smollm2_4_layers
    prompts = [tokenizer.encode("The three primary colors are"),
               tokenizer.encode("import numpy as np\n\ndef softmax(x):\n    # subtract the max "
                                "for numerical stability, then normalize\n")]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    for backend, mixed in (("reference", False), ("pallas", False), ("pallas", True)):
        engine = Engine(model, tokenizer, EngineConfig(
            max_num_seqs=2, max_prefill_tokens=16, max_model_len=64, page_size=8,
            attention_backend=backend, mixed_steps=mixed))
        first = engine.add_request(prompt_token_ids=prompts[0], params=params)
        engine.step()  # the first prompt's one chunk: it decodes while the second prefills
        second = engine.add_request(prompt_token_ids=prompts[1], params=params)
        engine.run_until_done()
        results[backend, mixed] = [engine.output(i).token_ids for i in (first, second)]
        if mixed:
            assert any(r.kind == "mixed" for r in engine.step_records())
    assert results["pallas", False] == results["reference", False]
    assert results["pallas", True] == results["reference", False]


def test_step_records_split_each_step_within_its_time(tiny_model) -> None:
    """Every step's schedule, inputs, device and output times are >= 0 and together within the
    step; decode steps are planned ahead once the batch only decodes."""
    engine = tiny_engine(tiny_model)
    serve(engine, prompts(3, seed=8), SamplingParams(max_tokens=12, ignore_eos=True))
    records = engine.step_records()
    for r in records:
        parts = [r.schedule_s, r.inputs_s, r.device_s, r.output_s]
        assert min(parts) >= 0 and sum(parts) <= (r.end_s - r.start_s) * 1.001, r
    assert any(r.planned_ahead for r in records)
    assert not any(r.planned_ahead and r.kind != "decode" for r in records)


def test_compile_counter_sees_compilations(tiny_model) -> None:
    """The counter tests/engine/test_warmup.py relies on does count: an engine not warmed up
    compiles."""
    engine = tiny_engine(tiny_model, max_num_seqs=2, max_prefill_tokens=32)
    with CompileCounter() as compiles:
        serve(engine, prompts(1, seed=8), SamplingParams(max_tokens=2))
    assert compiles.count > 0


def test_compile_counter_sees_programs_loaded_from_the_persistent_cache(
        compilation_cache: str) -> None:
    """With the persistent cache on (tests/conftest.py), a program an earlier `jit` compiled is
    loaded, not compiled, by a new `jit` of the same function: still one new program for the
    no-recompilation test to catch."""
    import jax

    def same_program():
        def body(x):  # a new function object each call, with the same name and code
            return jnp.tanh(x) * 3.0 + jnp.sin(x)
        return body

    x = jnp.arange(7.0)
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        with CompileCounter() as first:
            jax.jit(same_program())(x).block_until_ready()
        with CompileCounter() as second:  # no in-memory hit: the persistent cache's
            jax.jit(same_program())(x).block_until_ready()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    assert first.count == 1 and second.count == 1


def test_callback_exception_aborts_only_that_request(tiny_model, caplog) -> None:
    engine = tiny_engine(tiny_model)
    seen: dict[str, int] = {"good": 0}

    def good(out) -> None:
        seen["good"] += 1

    def bad(out) -> None:
        raise RuntimeError("consumer bug")

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = engine.add_request(prompt_token_ids=[5, 6, 7], params=params, callback=good)
    b = engine.add_request(prompt_token_ids=[8, 9], params=params, callback=bad)
    engine.run_until_done()
    assert engine.output(a).finish_reason == FinishReason.LENGTH and seen["good"] == 10
    assert engine.output(b).finish_reason == FinishReason.ABORT
    assert "consumer bug" in caplog.text
    assert engine.allocator.num_free() == engine.allocator.num_pages


def test_abort_mid_generation_frees_pages(tiny_model) -> None:
    engine = tiny_engine(tiny_model)
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=40,
                                                                       ignore_eos=True))
           for p in prompts(3, seed=10)]
    for _ in range(12):
        engine.step()
    held = len(engine.scheduler.seqs[ids[1]].pages.pages)
    free_before = engine.allocator.num_free()
    out = engine.abort(ids[1])
    assert out.finish_reason == FinishReason.ABORT and held > 0
    assert engine.allocator.num_free() == free_before + held
    engine.run_until_done()
    assert [engine.output(i).finish_reason for i in (ids[0], ids[2])] == [FinishReason.LENGTH] * 2
    assert engine.allocator.num_free() == engine.allocator.num_pages


def test_bad_requests_rejected_without_disturbing_running_ones(tiny_model) -> None:
    engine = tiny_engine(tiny_model)
    ok = engine.add_request(prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="exceed max_model_len=64"):
        engine.add_request(prompt_token_ids=[1] * 60, params=SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(prompt_token_ids=[TINY.vocab_size])
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        engine.add_request(prompt_token_ids=[1], params={"temperature": 0.5})
    with pytest.raises(ValueError, match="temperature must be"):
        engine.add_request(prompt_token_ids=[1], params=SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request(prompt_token_ids=[])
    engine.run_until_done()
    assert not engine.scheduler.seqs  # finished requests are forgotten
    assert len(engine.output(ok).token_ids) == 12


def test_prefix_caching_keeps_greedy_outputs_smollm2(smollm2_4_layers) -> None:
    """SmolLM2's weights and tokenizer (its first 4 layers), multi-turn chats and requests
    behind a shared system prompt: greedy outputs with the prefix cache equal those without it,
    while most prefill is skipped."""
    _, model, tokenizer = smollm2_4_layers
    system = {"role": "system", "content": "You are a terse assistant. Answer in one sentence, "
              "name concrete facts, and never apologise or repeat the question back."}
    questions = ["What is a page table?", "Why is decode memory-bound?",
                 "Name a prime above 90.", "What does RoPE rotate?"]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)

    def converse(enable: bool) -> tuple[list[list[int]], dict]:
        engine = Engine(model, tokenizer, EngineConfig(
            max_num_seqs=4, max_prefill_tokens=64, max_model_len=256, page_size=8,
            enable_prefix_caching=enable))
        chats = [[system, {"role": "user", "content": q}] for q in questions]
        outputs = []
        for _turn in range(2):  # the second turn extends each first conversation
            prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in chats]
            ids = [engine.add_request(prompt_token_ids=p, params=greedy) for p in prompts]
            engine.run_until_done()
            for chat, i in zip(chats, ids):
                out = engine.output(i)
                outputs.append(out.token_ids)
                chat += [{"role": "assistant", "content": out.text},
                         {"role": "user", "content": "And why?"}]
        engine.allocator.check_invariants()
        return outputs, engine.prefix_cache_stats()

    plain, no_stats = converse(False)
    cached, stats = converse(True)
    assert cached == plain
    assert no_stats == {}
    assert stats["hits"] >= 7 and stats["prefill_tokens_saved"] >= 7 * 32


def test_an_engine_on_one_cpu_device_runs_its_projections_in_the_tile_layout(
        monkeypatch, fresh_programs) -> None:
    """Where the CPU kernel runs AMX tiles, a bfloat16 engine on one device holds its layers'
    projections packed (`tile_weights`; `engine.model`), leaving the caller's model as loaded,
    and serves the tokens an engine over the weights as loaded serves when its products take
    the same tiles (tiles from 1 row): the packing changes where the weights lie, not a bit of
    any logit. Under INFER_TILED_WEIGHTS=0 (`TILED_WEIGHTS`) nothing is packed."""
    from flax import nnx

    from infer.model.llama import Llama
    from kernels_cpu import dense as dense_cpu

    if not dense_cpu.packs(jnp.zeros((32, 32), jnp.bfloat16)):
        pytest.skip("weights are packed only where the CPU kernel runs AMX tiles")
    model = Llama(TINY, jnp.bfloat16, nnx.Rngs(int(np.random.SeedSequence().entropy % 2**31)))
    config = EngineConfig(max_num_seqs=4, max_prefill_tokens=64, max_model_len=96)
    monkeypatch.setitem(dense_cpu.TILES_FROM, "kn", 1)
    inputs = prompts(6, seed=5)
    # Sampled at a high temperature (the random model's logits span ~100; greedy tokens hardly
    # depend on the layers): each draw depends on every logit.
    params = [SamplingParams(temperature=40.0, top_p=0.95, seed=i, max_tokens=10,
                             ignore_eos=True) for i in range(len(inputs))]
    tiled = Engine(model, None, config)
    up = lambda m: m.layers[0].mlp.up_proj.get_value()
    assert dense_cpu.is_packed(up(tiled.model)) and up(model).ndim == 2
    got = serve(tiled, inputs, params)
    monkeypatch.setattr(dense_cpu, "TILED_WEIGHTS", False)
    as_loaded = Engine(model, None, config)
    assert as_loaded.model is model
    assert serve(as_loaded, inputs, params) == got
