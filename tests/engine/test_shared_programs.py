"""Engines over weights of one signature share their jitted programs (`infer.model.programs`):
whatever order engines over different models come in, each serves its own model's tokens, an
engine over a signature seen before compiles nothing, and the memo keeps the executables it
holds under its bound."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.engine.engine import Engine, EngineConfig
from infer.model.binding import binding, on_device
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.engine.runner import Runner
from infer.model.programs import ProgramMemo, count_executables
from infer.platform import CompileCounter
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from tests.engine.test_engine_reference import recompute_greedy

TINY = get_config("tiny")
# Settings a trace reads that change no array's shape: engines over these variants hold weights
# of equal shapes and dtypes, and only the graph's static settings tell their programs apart.
VARIANTS = [TINY, dataclasses.replace(TINY, rope_theta=500.0),
            dataclasses.replace(TINY, rms_norm_eps=0.5)]


def _compile_notices(caplog) -> int:
    return sum(r.name == "infer" and r.getMessage().startswith("compiling the ")
               for r in caplog.records)


def test_engines_in_any_order_serve_their_own_models(fresh_programs, caplog) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)  # a fresh order each run, named below
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, TINY.vocab_size, int(n)).tolist() for n in rng.integers(3, 20, 3)]
    # With logprobs: a random model's greedy tokens hardly depend on its layers, its logprobs do.
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    # Two models per variant (other weights, same signature), met in a random order, some twice.
    models = {(v, s): Llama(VARIANTS[v], jnp.float32, nnx.Rngs(10 * v + s))
              for v in range(len(VARIANTS)) for s in range(2)}
    keys = list(models)
    order = [keys[i] for i in rng.permutation(len(keys))] + [
        keys[i] for i in rng.permutation(len(keys))[:3]]
    seen = set()
    for v, s in order:
        model = models[v, s]
        want = [recompute_greedy(model)(p, params.max_tokens) for p in prompts]
        engine = Engine(model, None, EngineConfig(max_num_seqs=4, max_prefill_tokens=32,
                                                  max_model_len=64, page_size=4))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="infer"):
            ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
            engine.run_until_done()
        for i, (tokens, logprobs) in zip(ids, want):
            out = engine.output(i)
            context = f"seed {seed}: variant {v}, weights {s} after variants {sorted(seen)}"
            assert out.token_ids == tokens, context
            np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logprobs,
                                       atol=1e-4, err_msg=context)
        # A variant's second model has its first's signature: its programs, already compiled.
        assert (_compile_notices(caplog) == 0) == (v in seen), f"seed {seed}: variant {v}"
        seen.add(v)
    assert len(fresh_programs) == len(VARIANTS)


def test_bfloat16_weights_are_a_signature_of_their_own(fresh_programs, caplog) -> None:
    """Equal graphs, other dtypes: the float32 engine's programs must not count as compiled for
    bfloat16 weights (warm-up would skip them, and the first step would compile unannounced)."""
    f32, bf16 = (Llama(TINY, dtype, nnx.Rngs(0)) for dtype in (jnp.float32, jnp.bfloat16))
    # The graphs are equal (the dtype is the arrays'), so the dtypes must tell them apart.
    assert binding(f32).structure == binding(bf16).structure
    assert binding(f32).signature != binding(bf16).signature
    config = EngineConfig(max_num_seqs=2, max_prefill_tokens=16, max_model_len=32, page_size=4)
    warm = Engine(f32, None, config)
    warm.warmup()
    engine = Engine(bf16, None, config)
    assert engine.warmup() > 0 and len(fresh_programs) == 2
    with caplog.at_level(logging.INFO, logger="infer"):
        engine.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(max_tokens=4))
        engine.run_until_done()
    assert _compile_notices(caplog) == 0


def _on_host(model: Llama) -> Llama:
    """The model with every weight a numpy array, as `load_on_host` leaves a checkpoint."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(np.asarray, state))


def _first_request_compiles(engine: Engine, caplog) -> tuple[int, int]:
    """(programs made executable, compile notices) while `engine` serves one request."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="infer"), CompileCounter() as compiled:
        engine.add_request(prompt_token_ids=[3, 4, 5, 6, 7], params=SamplingParams(
            max_tokens=5, ignore_eos=True))
        engine.run_until_done()
    return compiled.count, _compile_notices(caplog)


SMALL = EngineConfig(max_num_seqs=2, max_prefill_tokens=16, max_model_len=32, page_size=4)


def test_weights_placed_otherwise_are_programs_of_their_own(fresh_programs, caplog) -> None:
    """jit keys executables on each argument's placement (host or device, committed or not):
    so must the signature, or a warmed-up engine's first request compiles unannounced. Host
    (numpy) weights run, as before programs were shared, and give the device weights' tokens."""
    model = Llama(TINY, jnp.float32, nnx.Rngs(1))
    signatures = {binding(m).signature
                  for m in (model, on_device(model, _last_device()), _on_host(model))}
    assert len(signatures) == 3
    outputs = []
    for variant in (model, _on_host(model)):
        engine = Engine(variant, None, SMALL)
        engine.warmup()
        assert _first_request_compiles(engine, caplog) == (0, 0)
        outputs.append(engine.output("0").token_ids)
    assert outputs[0] == outputs[1] and len(fresh_programs) == 2


def _last_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[-1])


@pytest.mark.parametrize("method", [None, "self_draft", "draft", "eagle"])
def test_an_engine_runs_where_its_weights_were_put(tiny_weights, caplog, method) -> None:
    """Weights put on a device explicitly (committed): the engine's caches and its proposer's
    weights go there, and every step takes its inputs there, host arrays and the last step's
    committed outputs alike; so after warm-up nothing compiles (a step fed a committed token or
    cache used to compile a program of its own, unannounced) and tokens are the default
    device's."""
    model = Llama(TINY, jnp.float32, nnx.Rngs(4))
    spec = None if method is None else SpeculativeConfig(
        method, 2, self_draft_layers=1, draft_path=tiny_weights["draft"],
        eagle_path=tiny_weights["eagle"])
    config = dataclasses.replace(SMALL, speculative=spec)
    placed = Engine(on_device(model, _last_device()), None, config)
    # Allocated there, not on the default device and moved by the first step.
    caches = [placed.runner.cache] + ([placed.runner.proposer.cache] if method else [])
    for leaf in jax.tree.leaves(caches):
        assert leaf.devices() == {jax.devices()[-1]} and leaf.committed
    placed.warmup()
    assert _first_request_compiles(placed, caplog) == (0, 0)
    engine = Engine(model, None, config)
    engine.warmup()
    assert _first_request_compiles(engine, caplog) == (0, 0)
    assert placed.output("0").token_ids == engine.output("0").token_ids


def test_an_interrupted_warmup_leaves_the_rest_to_the_next_engine(fresh_programs, caplog,
                                                                  monkeypatch) -> None:
    """Only programs whose step returned count as run: after a warm-up stopped part-way (a
    Ctrl-C in a notebook), the next engine over the same weights warms up the rest, and its
    requests compile nothing."""
    model = Llama(TINY, jnp.float32, nnx.Rngs(2))
    first = Engine(model, None, SMALL)
    runs = [0]
    real = Runner._run_shape

    def interrupted(runner, shape):
        runs[0] += 1
        if runs[0] == 2:
            raise KeyboardInterrupt
        real(runner, shape)

    monkeypatch.setattr(Runner, "_run_shape", interrupted)
    with pytest.raises(KeyboardInterrupt):
        # One thread: each program compiles as its step runs (with two, an ahead-of-time pass
        # compiles them all before the first step runs).
        first.runner.warmup(threads=1)
    monkeypatch.undo()
    second = Engine(model, None, SMALL)
    second.warmup()
    assert len(first.runner.ready) == 1  # the one step that returned
    assert second.runner.ready == set(second.runner.shapes())
    assert _first_request_compiles(second, caplog) == (0, 0)


@dataclasses.dataclass(eq=False)
class _Held:
    count: int

    def executables(self) -> int:
        return self.count


def test_the_memo_drops_the_least_recently_used_past_its_bound() -> None:
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    bound = int(rng.integers(4, 40))
    memo, built = ProgramMemo(max_executables=bound), {}
    order = []

    def build(key: int) -> _Held:
        built[key] = _Held(int(rng.integers(0, 12)))
        return built[key]

    for _ in range(300):
        key = int(rng.integers(12))
        order.append(key)
        before = memo._sets.get(key)
        held = memo.get(key, lambda: build(key))
        assert held is built[key]
        if before is not None:  # kept: returned while below the bound, built anew once full
            assert (held is before) == (before.count < bound)
        kept = list(memo._sets)
        assert kept[-1] == key
        # Over the bound only if the set just asked for alone is; and what it dropped were the
        # least recently used: the kept sets are a suffix of the order of use.
        assert memo.executables() <= bound or len(kept) == 1
        used = list(dict.fromkeys(reversed(order)))[::-1]
        assert kept == used[len(used) - len(kept):]
        if rng.random() < 0.5:  # a set's executables grow after use (new shapes run)
            held.count += int(rng.integers(0, bound))


def test_one_set_asked_for_again_and_again_stays_bounded() -> None:
    """Engines of many shapes over one model share one key: its set grew past the bound for
    good (the memo only dropped other sets), ~550 memory mappings per engine shape."""
    memo, sets = ProgramMemo(max_executables=10), []
    for _ in range(50):
        held = memo.get("steps", lambda: sets.append(_Held(0)) or sets[-1])
        held.count += 3  # each engine's new shapes
        assert memo.executables() <= 10 + 3
    assert len(sets) == 50 // 4 + 1  # a fresh set every fourth engine


def test_executables_are_counted_per_signature_run() -> None:
    f, g = jax.jit(lambda x: x + 1), jax.jit(lambda x: x * 2)
    f(1.0), f(jnp.ones(3)), f(jnp.ones(3) * 2), g(jnp.ones((2, 2)))
    assert count_executables(f, g) == 3


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ProgramMemo(0)
