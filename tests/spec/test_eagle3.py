"""An EAGLE-3 head (fused taps of the target's layers) inside the engine and beside EAGLE-1:
its drafts are the head's over the target's true taps, computed densely apart from the engine;
an EAGLE-1 head widened with the pass-through fuse drafts exactly as before; the file keeps its
layers; wrong layers are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.eagle_head import EagleHead, from_eagle1, load_eagle, save_eagle
from tests.spec.proposals import record_proposals

TINY = get_config("tiny")
LENGTH = 96  # the dense references' padded length: one compile


def serve(model, spec: SpeculativeConfig, prompts: list[list[int]]):
    engine = Engine(model, None, EngineConfig(max_num_seqs=4, max_prefill_tokens=16,
                                              max_model_len=LENGTH, page_size=4,
                                              speculative=spec))
    calls = record_proposals(engine)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    engine.run_until_done()
    return [engine.output(i).token_ids for i in ids], calls


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 19, 33)]


def test_drafts_are_the_head_over_the_targets_taps(tiny_model, tiny_weights) -> None:
    """Each drafted token is the argmax of the head's logits when the head reads, densely and
    apart from the engine's paged caches and feature store: the fused taps and final hidden
    state of every token the target has seen, then its own predictions for the drafts."""
    head = load_eagle(TINY, tiny_weights["eagle3"])
    assert head.feature_layers == (0,)

    @jax.jit
    def target_features(tokens, n):
        cache = KVCache.create(TINY.num_layers, 1, LENGTH, TINY.num_kv_heads, TINY.head_dim)
        meta = AttentionMetadata.for_prefill(n[None], LENGTH)
        return tiny_model(tokens[None], cache, meta, feature_layers=head.feature_layers)[1][0]

    @jax.jit
    def head_logits(inputs, tokens, n):
        """The head over rows 0..n-1 (inputs [L, E] in its space, tokens [L]): its next
        prediction's logits and the prediction itself."""
        meta = AttentionMetadata.for_prefill(n[None], LENGTH)
        predicted, _ = head(inputs[None], tokens[None], tiny_model.embed,
                            head.create_cache(1, LENGTH), meta)
        return tiny_model.logits(predicted[0, n - 1]), predicted[0, n - 1]

    spec = SpeculativeConfig("eagle", 3, eagle_path=tiny_weights["eagle3"])
    out, calls = serve(tiny_model, spec, prompts())
    checked = 0
    for call in calls:
        for row, seq in enumerate(call.tokens):
            n = len(seq)  # x_0 .. x_{n-1}; the target has features for x_0 .. x_{n-2}
            padded = np.zeros(LENGTH, np.int32)
            padded[:n] = seq
            real = head.features_in(target_features(jnp.asarray(padded), jnp.int32(n - 1)))
            inputs = np.zeros((LENGTH, TINY.hidden_size), np.float32)
            inputs[:n - 1] = np.asarray(real)[:n - 1]
            tokens = np.zeros(LENGTH, np.int32)
            tokens[:n - 1] = seq[1:]
            rows = n - 1  # row t reads (feature of x_t, x_{t+1})
            for j in range(int(call.counts[row])):
                logits, predicted = head_logits(jnp.asarray(inputs), jnp.asarray(tokens),
                                                jnp.int32(rows))
                logits = np.asarray(logits)
                draft = int(call.drafts[row, j])
                assert logits[draft] >= logits.max() - 1e-4, (call.limits, row, j)
                inputs[rows], tokens[rows] = np.asarray(predicted), draft
                rows += 1
                checked += 1
    assert checked > 20


def test_pass_through_fuse_drafts_as_the_eagle1_head(tiny_model, tiny_weights, tmp_path
                                                     ) -> None:
    """`from_eagle1` gives a head whose taps weigh nothing: in the engine (which now hands it
    the taps too) it proposes, call by call, the EAGLE-1 head's very drafts."""
    widened = from_eagle1(load_eagle(TINY, tiny_weights["eagle"]), (0, 1))
    path = str(tmp_path / "widened.safetensors")
    save_eagle(widened, path)
    base, calls = serve(tiny_model, SpeculativeConfig("eagle", 3, eagle_path=tiny_weights["eagle"]),
                        prompts())
    out, wide_calls = serve(tiny_model, SpeculativeConfig("eagle", 3, eagle_path=path), prompts())
    assert out == base
    assert len(calls) == len(wide_calls) > 0
    for a, b in zip(calls, wide_calls):
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_array_equal(a.drafts, b.drafts)


def test_file_keeps_its_layers_and_bad_layers_are_refused(tmp_path) -> None:
    head = EagleHead(TINY, jnp.float32, nnx.Rngs(0), feature_layers=(0, 1))
    assert head.feature_size == 3 * TINY.hidden_size
    path = tmp_path / "e3.safetensors"
    save_eagle(head, path)
    loaded = load_eagle(TINY, path)
    assert loaded.feature_layers == (0, 1)
    np.testing.assert_array_equal(np.asarray(loaded.fuse[...]), np.asarray(head.fuse[...]))
    for bad in ((1, 0), (2,), (0, 0)):
        with pytest.raises(ValueError, match="feature_layers"):
            EagleHead(TINY, jnp.float32, nnx.Rngs(0), feature_layers=bad)
    with pytest.raises(ValueError, match="EAGLE-1"):
        from_eagle1(head, (0,))
