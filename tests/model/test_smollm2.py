"""SmolLM2-135M-Instruct from the bundled GGUF: infer against HF transformers on the same file."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.simple_loop import decode_stream
from infer.sampling_params import SamplingParams
from tests.engines import check_logprobs
from tests.hf_util import agree_until_near_tie, hf_greedy, hf_logits

pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Les fleurs du printemps sont",
]


@pytest.fixture(scope="module")
def chat_prompt(smollm2) -> str:
    _, _, tokenizer = smollm2
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give me three tips for writing clean Python code."}])


def _logits(model, ids: list[int]) -> np.ndarray:
    c = model.config
    cache = KVCache.create(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata.for_prefill(jnp.asarray([len(ids)]), len(ids))
    logits, _, _ = model(jnp.asarray([ids]), cache, meta)
    return np.asarray(logits[0])


@pytest.mark.parametrize("which", range(len(PROMPTS) + 1))
def test_logits_match_hf(smollm2, hf_smollm2, chat_prompt, which: int) -> None:
    _, model, tokenizer = smollm2
    text = (PROMPTS + [chat_prompt])[which]
    ids = tokenizer.encode(text)
    ours, ref = _logits(model, ids), hf_logits(hf_smollm2, ids)
    assert np.abs(ours - ref).max() <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_feature_layers_are_hf_hidden_states(smollm2, hf_smollm2) -> None:
    """An EAGLE-3 head's taps: the residual stream after decoder layers 1 and 14 (HF's
    hidden_states[2] and [15], before any norm), then the final hidden state (HF's last entry,
    after the final norm), side by side in that order."""
    import torch

    _, model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPTS[1])
    c = model.config
    cache = KVCache.create(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata.for_prefill(jnp.asarray([len(ids)]), len(ids))
    _, features, _ = model(jnp.asarray([ids]), cache, meta, feature_layers=(1, 14))
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids]), output_hidden_states=True).hidden_states
    e = c.hidden_size
    ours = np.asarray(features[0])
    assert ours.shape == (len(ids), 3 * e)
    for j, hf_index in enumerate((2, 15, len(ref) - 1)):
        want = ref[hf_index][0].float().numpy()
        scale = np.abs(want).max()
        assert np.abs(ours[:, j * e:(j + 1) * e] - want).max() <= 1e-4 * scale, hf_index


def test_feature_layers_are_checked(smollm2) -> None:
    _, model, _ = smollm2
    cache = KVCache.create(model.config.num_layers, 1, 4, model.config.num_kv_heads,
                           model.config.head_dim)
    meta = AttentionMetadata.for_prefill(jnp.asarray([4]), 4)
    for bad in ((14, 1), (3, 3), (30,), (-1,)):
        with pytest.raises(ValueError, match="feature_layers"):
            model(jnp.zeros((1, 4), jnp.int32), cache, meta, feature_layers=bad)


def test_cached_decode_matches_full_forward(smollm2) -> None:
    """Prefill 12 tokens, then decode 20 with the cache: each step equals the full forward."""
    _, model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPTS[2] + " a fisherman who had never seen the mountains.")[:32]
    full = _logits(model, ids)
    c = model.config
    cache = KVCache.create(c.num_layers, 1, 32, c.num_kv_heads, c.head_dim)
    logits, _, cache = model(jnp.asarray([ids[:12]]), cache,
                             AttentionMetadata.for_prefill(jnp.asarray([12]), 12))
    np.testing.assert_allclose(np.asarray(logits[0]), full[:12], atol=1e-4)
    for pos in range(12, len(ids)):
        logits, _, cache = model(jnp.asarray([[ids[pos]]]), cache,
                                 AttentionMetadata.for_decode(jnp.asarray([pos])))
        np.testing.assert_allclose(np.asarray(logits[0, 0]), full[pos], atol=1e-4)


def test_greedy_32_tokens_equal_hf_generate(smollm2, hf_smollm2, chat_prompt) -> None:
    """All prompts in one batch (rows of different lengths) against HF generate one at a time.
    (32 tokens: HF's generate on CPU was most of this test's 110 s at 64.)"""
    _, model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in PROMPTS + [chat_prompt]]
    steps = 32
    ours = [[] for _ in prompts]
    for tokens in decode_stream(model, prompts, [SamplingParams(ignore_eos=True)] * len(prompts),
                                steps):
        for row, t in enumerate(tokens):
            ours[row].append(int(t))
    for row, ids in enumerate(prompts):
        ref, margins = hf_greedy(hf_smollm2, ids, steps)
        ok, why = agree_until_near_tie(ours[row], ref, margins)
        assert ok, f"prompt {row}: {why}"


def test_engine_logprobs_match_hf(smollm2, hf_smollm2, chat_prompt) -> None:
    """LLM.generate's logprobs (greedy and sampled, one batch) against log_softmax of HF's logits
    over the same prompt and output tokens."""
    import torch

    from infer.llm import LLM
    config, model, tokenizer = smollm2
    llm = LLM.from_loaded(config, model, tokenizer, max_num_seqs=2, max_model_len=128,
                          max_prefill_tokens=64)
    params = [SamplingParams(max_tokens=8, logprobs=5),
              SamplingParams(max_tokens=8, logprobs=2, temperature=1.0, seed=3)]
    outs = llm.generate([chat_prompt, PROMPTS[0]], params)
    for text, p, out in zip([chat_prompt, PROMPTS[0]], params, outs):
        ids = tokenizer.encode(text)
        ref = torch.log_softmax(torch.from_numpy(hf_logits(hf_smollm2, ids + out.token_ids)),
                                dim=-1).numpy()[len(ids) - 1:-1]
        check_logprobs(ref, out, p.logprobs, atol=1e-3)
