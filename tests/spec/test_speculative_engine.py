"""Speculative decoding inside the engine: every proposer (n-gram, suffix, draft model,
self-draft, EAGLE and EAGLE-3 heads) leaves greedy outputs exactly those of plain decoding, on SmolLM2 and
on a tiny model under preemption; rejected drafts roll back (the cache holds what plain decoding
would have written, and no page past the accepted length stays taken)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.sampling_params import SamplingParams
from infer.spec.config import WEIGHTS_DIR, SpeculativeConfig
from tests.engines import serve
from tests.spec.plain_kv import run_checking_pages

TINY = get_config("tiny")


def tiny_specs(paths: dict[str, str]) -> list[SpeculativeConfig]:
    # The draft model drafts as many tokens as the one-layer self-draft: the two are programs of
    # one shape, so the draft's are the self-draft's, loaded instead of compiled anew.
    return [SpeculativeConfig("ngram", 3), SpeculativeConfig("suffix", 3),
            SpeculativeConfig("self_draft", 4, self_draft_layers=1),
            SpeculativeConfig("draft", 4, draft_path=paths["draft"]),
            SpeculativeConfig("eagle", 3, eagle_path=paths["eagle"]),
            SpeculativeConfig("eagle", 3, eagle_path=paths["eagle3"])]


# 14 pages: requests get preempted, and the prefix cache hands prompts over, in part or whole
# (all but the last token), at admission or before a chunk.
@pytest.mark.parametrize("num_pages", [None, 14])
def test_every_proposer_keeps_greedy_outputs_tiny(tiny_model, tiny_weights, num_pages) -> None:
    rng = np.random.default_rng(0)
    # More rows than slots, so some wait; with 14 pages, running ones are preempted. (The draft
    # proposers' host loop, not compilation, is most of the time: 4 random prompts, 14 tokens.)
    prompts = [rng.integers(1, TINY.vocab_size, rng.integers(3, 30)).tolist() for _ in range(4)]
    prompts += [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]  # repetitive: n-gram lookup proposes
    shared = rng.integers(1, TINY.vocab_size, 9).tolist()  # two pages and a token
    prompts += [shared, shared, shared + [3, 4, 5, 6, 7, 8, 9, 10]]
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    caching = num_pages is not None
    plain, _ = serve(tiny_model, None, prompts, None, greedy, num_pages=num_pages,
                     enable_prefix_caching=caching)
    for spec in tiny_specs(tiny_weights):
        out, stats = serve(tiny_model, None, prompts, spec, greedy, num_pages=num_pages,
                           enable_prefix_caching=caching)
        assert out == plain, spec.method
        assert stats["proposed"] > 0, spec.method
        assert (stats["preemptions"] > 0) == caching, spec.method
        if spec.method in ("self_draft", "draft"):  # some drafts are rejected and roll back
            assert stats["accepted"] < stats["proposed"], (spec.method, stats)


def test_sampled_requests_run_with_every_proposer(tiny_model, tiny_weights) -> None:
    """Sampled drafts carry their probabilities to the verifier: the same seed gives the same
    tokens twice, and each proposer's run is reproducible. At temperature 9 (the random
    model's logit gaps are ~15; at 0.9 every draw was the argmax, and a key or seed bug
    passed), draws differ from greedy decoding and between seeds."""
    prompts = [[5, 6, 7, 8] * 4, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=16, temperature=9.0, top_k=20, seed=7, ignore_eos=True)
    greedy, _ = serve(tiny_model, None, prompts, None, SamplingParams(max_tokens=16,
                                                                      ignore_eos=True))
    for spec in tiny_specs(tiny_weights):
        first, stats = serve(tiny_model, None, prompts, spec, params)
        second, _ = serve(tiny_model, None, prompts, spec, params)
        assert first == second, spec.method
        assert all(len(o) == 16 and max(o) < TINY.vocab_size for o in first)
        assert first != greedy and stats["proposed"] > 0, spec.method


def _assert_draft_kv_held(engine: Engine, context: str = "") -> int:
    """The draft model's pages equal the target's (with every target layer) wherever the
    proposer counts its KV as computed; returns the positions checked. `context` goes into a
    failure's message (a random test's seed)."""
    proposer, checked = engine.runner.proposer, 0
    for seq in engine.scheduler.running:
        track = proposer._tracks.get(seq.request.request_id)
        if track is None or not track.valid or track.pages is not seq.pages:
            continue
        slots = np.array([seq.pages.slot(t) for t in range(track.valid)])
        for draft_pools, pools in ((proposer.cache.k, engine.runner.cache.k),
                                   (proposer.cache.v, engine.runner.cache.v)):
            for draft_pool, pool in zip(draft_pools, pools):
                flat = [np.asarray(p).swapaxes(1, 2).reshape(-1, *p.shape[1::2])[slots]
                        for p in (draft_pool, pool)]  # [P, K, G, D] -> [valid, K, D]
                np.testing.assert_allclose(*flat, atol=1e-5,
                                           err_msg=f"{seq.request.request_id} {context}")
        checked += track.valid
    return checked


@pytest.mark.parametrize("chunk", [15, 16])  # 16: every chunk ends on a page boundary
def test_the_draft_cache_holds_the_prompt_however_it_was_chunked(tiny_model, chunk) -> None:
    """The draft model computes its own KV of each prompt, whatever chunks the target's took:
    with every layer of the target, the draft's pages must equal the target's wherever the
    proposer counts them as computed."""
    spec = SpeculativeConfig("self_draft", 3, self_draft_layers=TINY.num_layers)
    engine = Engine(tiny_model, None, EngineConfig(
        max_num_seqs=2, max_prefill_tokens=chunk, max_model_len=128, page_size=4,
        speculative=spec))
    rng = np.random.default_rng(chunk)
    for length in rng.integers(20, 80, 3):
        engine.add_request(prompt_token_ids=rng.integers(1, TINY.vocab_size, length).tolist(),
                           params=SamplingParams(max_tokens=12, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        checked += _assert_draft_kv_held(engine)
    assert checked > 100


def test_the_draft_cache_of_a_cached_prefix_is_what_was_drafted(tiny_model) -> None:
    """Pages from the prefix cache hold a draft's KV only if some request's draft wrote it:
    a request that computed them but never drafted (one token, logprobs, aborted before its
    first draft) leaves them without, and the next request to take them must compute it."""
    spec = SpeculativeConfig("self_draft", 3, self_draft_layers=TINY.num_layers)
    engine = Engine(tiny_model, None, EngineConfig(
        max_num_seqs=3, max_prefill_tokens=16, max_model_len=96, page_size=4, speculative=spec,
        enable_prefix_caching=True, num_pages=60))
    seed = int(np.random.SeedSequence().entropy % 2**32)  # a fresh draw each run, reported
    rng = np.random.default_rng(seed)
    stems = [rng.integers(1, TINY.vocab_size, int(n)).tolist() for n in rng.integers(9, 30, 3)]
    checked = 0
    for _ in range(12):
        prompt = stems[rng.integers(3)] + rng.integers(1, TINY.vocab_size,
                                                       rng.integers(0, 6)).tolist()
        kind = rng.integers(4)
        # (A row asking for logprobs drafts nothing: it computes pages without draft KV.)
        params = SamplingParams(max_tokens=(1, 2, 20, int(rng.integers(6, 20)))[kind],
                                ignore_eos=True, logprobs=0 if kind == 1 else None)
        request_id = engine.add_request(prompt_token_ids=prompt, params=params)
        if kind == 2:  # aborted once its prompt is computed, before it drafts
            while engine.output(request_id).token_ids == [] and engine.has_unfinished():
                engine.step()
            engine.abort(request_id)
        for _ in range(int(rng.integers(0, 8))):
            engine.step()
            checked += _assert_draft_kv_held(engine, f"seed {seed}")
    for stem in stems:  # last, a drafting request over each stem's cached pages
        engine.add_request(prompt_token_ids=stem + [1], params=SamplingParams(
            max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        checked += _assert_draft_kv_held(engine, f"seed {seed}")
    assert checked > 50, seed


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_rollback_leaves_the_cache_as_plain_decoding_would(tiny_model, tiny_weights,
                                                           method) -> None:
    """After every step, each running request holds exactly the pages its accepted tokens need,
    and the KV in them equals a plain forward over those tokens. (The random EAGLE head's
    drafts are mostly rejected; on this tiny model the random draft's are mostly accepted.)"""
    spec = SpeculativeConfig(method, 4, draft_path=tiny_weights["draft"],
                             eagle_path=tiny_weights["eagle"])
    engine = Engine(tiny_model, None, EngineConfig(
        max_num_seqs=2, max_prefill_tokens=16, max_model_len=64, page_size=4,
        speculative=spec))
    for p, temperature in (([7, 3, 9, 1, 2] * 3, 0.0), ([4, 4, 8, 1] * 2, 1.5)):
        engine.add_request(prompt_token_ids=p, params=SamplingParams(
            max_tokens=24, temperature=temperature, seed=1, ignore_eos=True))
    assert run_checking_pages(engine, tiny_model) > 10
    stats = engine.speculative_stats()
    if method == "eagle":
        assert stats["accepted"] < stats["proposed"] / 2  # rejections rolled back
    else:
        assert stats["accepted"] > 0  # accepted drafts' KV kept


@pytest.fixture(scope="module")
def smollm2_specs() -> list[SpeculativeConfig]:
    """The shipped draft and EAGLE weights (weights/, trained by experiments.train_draft and
    experiments.train_eagle) with n-gram lookup. (The self-draft's bookkeeping on real weights
    is the full-depth test below; every proposer runs on the tiny model too.)"""
    return [SpeculativeConfig("ngram", 4), SpeculativeConfig("draft", 4),
            SpeculativeConfig("eagle", 4)]


def test_every_proposer_keeps_greedy_outputs_smollm2(smollm2, smollm2_specs) -> None:
    """Float32 SmolLM2, a batch of two prompts (one input-grounded, one chat): each proposer's
    greedy output equals plain greedy decoding token for token."""
    _, model, tokenizer = smollm2
    repeat = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog, "
              "and the lazy dog sleeps on.")
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in (repeat, "What is gravity?")]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    # Chunks of up to 48 tokens: the 53-token prompt still takes two, in programs of 48 and 16
    # tokens (chunks of 32 took three: 32, 24 and 16, one more 30-layer program per engine).
    overrides = dict(max_num_seqs=2, max_prefill_tokens=48, max_model_len=128, page_size=16)
    assert max(map(len, prompts)) > overrides["max_prefill_tokens"]  # a prompt is chunked
    plain, _ = serve(model, tokenizer, prompts, None, greedy, **overrides)
    for spec in smollm2_specs:
        out, stats = serve(model, tokenizer, prompts, spec, greedy, **overrides)
        assert out == plain, spec.method
        assert stats["accepted"] > 0, spec.method


@pytest.mark.parametrize("num_pages", [None, 5])  # 5: requests are preempted and recomputed
def test_full_depth_self_draft_is_always_accepted_smollm2(smollm2_4_layers, num_pages) -> None:
    """A self-draft with all of the target's layers is the target: if its cache bookkeeping
    (catch-up, rollback, positions, a reset after preemption) is right, greedy drafts are all
    accepted. Draft state kept across a preemption attends to pages that then hold other
    requests' KV: outputs stay exact while acceptance collapses. (The target is SmolLM2's first
    4 layers: the bookkeeping is the same at any depth.)"""
    config, model, tokenizer = smollm2_4_layers
    prompts = [tokenizer.encode(text) for text in (
        "The history of the printing press begins", "def fibonacci(n):",
        "Rivers of Europe, from west to east:", "import numpy as np\nx =")]
    spec = SpeculativeConfig("self_draft", 3, self_draft_layers=config.num_layers)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = Engine(model, tokenizer, EngineConfig(
        max_num_seqs=2, max_prefill_tokens=16, max_model_len=64, page_size=8,
        num_pages=num_pages, speculative=spec))
    for p in prompts:
        engine.add_request(prompt_token_ids=p, params=params)
    preemptions = sum(o.metrics.num_preemptions for o in engine.stream() if o.finished)
    assert (preemptions > 0) == (num_pages is not None)
    stats = engine.speculative_stats()
    assert stats["acceptance_rate"] >= 0.98, stats


@pytest.mark.parametrize("seed", range(2))
def test_int4_kivi_speculation_keeps_greedy_outputs(smollm2_4_layers, seed: int) -> None:
    """int4_kivi reads a sequence's two newest pages from an exact bfloat16 ring in which
    page j's entry is page j - 2's: a verify write that crossed into the next page evicted the
    previous page's exact copy, and a rollback left it evicted, so the rest of the page read it
    quantized and greedy outputs drifted from plain decoding's. Drafts now stay within the
    page (`SchedulerConfig.drafts_within_page`): outputs equal, drafts still accepted. Pages
    of 4 tokens and 4 drafts: most verify steps would reach the next page."""
    from experiments.common import real_text

    _, model, tokenizer = smollm2_4_layers
    rng = np.random.default_rng(seed)
    text = tokenizer.encode(real_text(20_000, offset=100_000))
    prompts = []
    for _ in range(8):  # prose, half with a span repeated so that n-gram lookup proposes
        start, n = int(rng.integers(0, len(text) - 64)), int(rng.integers(4, 24))
        span = text[start:start + n]
        prompts.append(span + text[start + n:start + n + 8] + span if rng.random() < 0.5
                       else text[start:start + 2 * n])
    params = SamplingParams(max_tokens=int(rng.integers(16, 24)), ignore_eos=True)
    overrides = dict(kv_cache_dtype="int4_kivi", page_size=4, max_model_len=96)
    plain, _ = serve(model, tokenizer, prompts, None, params, **overrides)
    out, stats = serve(model, tokenizer, prompts, SpeculativeConfig("ngram", 4), params,
                       **overrides)
    assert out == plain
    assert stats["accepted"] > 0, stats


def test_weights_shipped() -> None:
    """The defaults of SpeculativeConfig point at weights committed in the repository."""
    for name in ("draft_smollm2.safetensors", "eagle_smollm2.safetensors"):
        assert os.path.isfile(os.path.join(WEIGHTS_DIR, name)), name


def test_the_shipped_eagle3_head_reads_layers_1_and_14() -> None:
    """The README's EAGLE-3 figures come from this file; its metadata must name the taps it was
    trained on, or the engine would feed it the wrong layers."""
    from infer.model.config import get_config
    from infer.spec.eagle_head import load_eagle
    head = load_eagle(get_config("smollm2-135m"),
                      os.path.join(WEIGHTS_DIR, "eagle3_smollm2.safetensors"))
    assert head.feature_layers == (1, 14)
    assert head.feature_size == 3 * get_config("smollm2-135m").hidden_size


def test_drafts_reserved_then_not_proposed_cross_a_window(tiny_model) -> None:
    """The scheduler reserves pages for k drafts before the proposer runs; when n-gram lookup
    then proposes nothing, the plain decode step's page table must still hold those pages (a
    sequence just under a window boundary used to crash here)."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(1, TINY.vocab_size, 120).tolist()  # random: lookup rarely matches
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = serve(tiny_model, None, [prompt], None, params, max_model_len=256)
    out, _ = serve(tiny_model, None, [prompt], SpeculativeConfig("ngram", 8, ngram_min=3),
                   params, max_model_len=256)
    assert out == plain


@pytest.mark.parametrize("method", ["self_draft", "eagle"])
def test_model_drafts_near_max_model_len(tiny_model, tiny_weights, method) -> None:
    """A draft model or head asked for fewer drafts than k (the room left before max_model_len)
    must not size its step for k: a request that ends at max_model_len used to crash there, its
    last steps' page tables being wider than any bucket."""
    rng = np.random.default_rng(5)
    spec = SpeculativeConfig(method, 5, self_draft_layers=1, eagle_path=tiny_weights["eagle"])
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in rng.integers(2, 12, 3)]
    for prompt in prompts:
        params = SamplingParams(max_tokens=32 - len(prompt), ignore_eos=True)
        plain, _ = serve(tiny_model, None, [prompt], None, params, max_model_len=32)
        out, stats = serve(tiny_model, None, [prompt], spec, params, max_model_len=32)
        assert out == plain and stats["proposed"] > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_host_proposers_index_survives_preemption(tiny_model, method: str) -> None:
    # A host proposer's index follows from the request's tokens, which a preemption keeps: it
    # is built once per request, chunk by chunk, not again after each preemption (a long
    # prompt's suffix index takes seconds to rebuild), and greedy outputs stay plain decoding's.
    rng = np.random.default_rng(19)
    prompts = [rng.integers(1, TINY.vocab_size, int(rng.integers(8, 30))).tolist()
               for _ in range(6)]
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    overrides = dict(num_pages=12, max_num_seqs=4)
    plain, _ = serve(tiny_model, None, prompts, None, greedy, **overrides)
    engine = Engine(tiny_model, None, EngineConfig(max_prefill_tokens=16, max_model_len=96,
                                                   page_size=4, **overrides,
                                                   speculative=SpeculativeConfig(method, 3)))
    proposer, built = engine.runner.proposer, []
    make = proposer._new_index
    proposer._new_index = lambda: built.append(1) or make()
    ids = [engine.add_request(prompt_token_ids=p, params=greedy) for p in prompts]
    engine.run_until_done()
    outputs = [engine.output(i) for i in ids]
    assert [o.token_ids for o in outputs] == plain
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert len(built) == len(prompts)
