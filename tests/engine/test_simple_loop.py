"""The one host loop (`timed_generate`) and the plain baseline over it (`generate`): stops,
counts and the stream's tokens, with step functions that need no model where possible."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.engine.device_steps import DeviceSteps
from infer.engine.simple_loop import PagedLayout, decode_stream, generate, timed_generate
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams


def _steps(*emitted: list[int]):
    it = iter(emitted)
    return lambda: next(it)


def test_counts_accepted_full_and_truncated_steps() -> None:
    """Steps of 3, 1 and 2 tokens (at most 3 a step), cut at max_new_tokens=6 inside the last:
    the tokens past the limit are dropped, but the step still counts what it accepted."""
    out, stats = timed_generate(lambda: 7, _steps([1, 2, 3], [4], [5, 6]), 6,
                                max_step_tokens=3)
    assert out == [7, 1, 2, 3, 4, 5]
    assert (stats["verify_steps"], stats["accepted"], stats["full_steps"]) == (3, 3, 1)
    assert stats["mean_accepted"] == 1.0 and stats["tokens_per_step"] == 2.0
    assert stats["decode_tok_s"] > 0 and stats["prefill_s"] >= 0


def test_stops_after_an_eos_mid_step_and_on_the_first_token() -> None:
    out, stats = timed_generate(lambda: 7, _steps([1, 9, 3], [4]), 10, eos_ids=[9],
                                max_step_tokens=3)
    assert out == [7, 1, 9] and stats["verify_steps"] == 1
    out, stats = timed_generate(lambda: 9, _steps(), 10, eos_ids=[9])
    assert out == [9] and stats["verify_steps"] == 0
    assert stats["mean_accepted"] != stats["mean_accepted"]  # nan: no step was taken
    assert timed_generate(lambda: 7, _steps(), 1)[0] == [7]


@pytest.fixture(scope="module")
def steps() -> DeviceSteps:
    model = Llama(get_config("tiny"), jnp.float32, nnx.Rngs(3))
    model.embed.set_value(model.embed.get_value() * 0.05)  # varied greedy text
    return DeviceSteps(model)


PROMPT = np.random.default_rng(4).integers(0, 512, 21).tolist()


@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=0.9, top_k=20, seed=5)])
def test_generate_is_the_stream_at_batch_1(steps, sampling) -> None:
    """The baseline is `decode_stream` at batch 1, read one token at a time; it stops at an
    eos id where the stream would go on, and a paged layout yields the same tokens."""
    stream = [int(t[0]) for t in decode_stream(steps, [PROMPT], [sampling], 12)]
    got, stats = generate(steps, PROMPT, 12, sampling)
    assert got == stream and stats["verify_steps"] == 11 and stats["accepted"] == 0
    eos = stream[4]
    assert generate(steps, PROMPT, 12, sampling, eos_ids=[eos])[0] == \
        stream[:stream.index(eos) + 1]
    paged = [int(t[0]) for t in decode_stream(steps, [PROMPT], [sampling], 12,
                                              paged=PagedLayout(page_size=8, seed=1))]
    assert paged == stream


@pytest.mark.parametrize("params", [SamplingParams(stop=["x"]),
                                    SamplingParams(stop_token_ids=[7]),
                                    SamplingParams(stop_token_ids=[7], ignore_eos=True)])
def test_stops_it_would_ignore_are_refused(steps, params) -> None:
    """The loop runs max_new_tokens steps (generate: until an eos id it is given): a stop asked
    for in the params, which it would ignore, is refused before any work, in the row it names."""
    with pytest.raises(ValueError, match=r"rows \[1\] ask for stop strings or stop_token_ids"):
        next(decode_stream(steps, [PROMPT, PROMPT], [SamplingParams(), params], 4))
    with pytest.raises(ValueError, match="stop strings or stop_token_ids"):
        generate(steps, PROMPT, 4, params)
