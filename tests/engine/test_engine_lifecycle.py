"""A request's life in the engine: validated once and all or nothing, seeded, streamed without
showing part of a stop string, and forgotten when it ends (a long-running engine's memory is
bounded). (Draft state across a preemption: test_speculative_engine's full-depth self-draft
on SmolLM2, whose acceptance is sensitive to the KV its drafts read; a random tiny model's
is not.)"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import random

import jax.numpy as jnp
import pytest
from flax import nnx

from infer.engine.engine import Engine, EngineConfig
from infer.engine.metrics import StepTimes
from infer.engine.plan import InFlight, StepPlan
from infer.engine.request import (FinishReason, Request, RequestIds, RequestLimits,
                                  validate_request)
from infer.llm import LLM
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import OUTPUT_KINDS, SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.ngram import NgramProposer
from infer.spec.stats import SpeculationStats
from tests.engines import run_jobs, tiny_engine

TINY = get_config("tiny")


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    finals = {}
    for out in engine.stream():
        if out.finished:
            finals[out.request_id] = out
    return [finals[i] for i in ids]


# -- bounded memory --------------------------------------------------------------------------

class TokenMockRunner:
    """Stands in for the device: each prefill chunk or decode row emits a token that depends on
    the request's last token, and a decode row accepts a random share of the n-gram drafts."""

    def __init__(self, config, proposer: NgramProposer, rng: random.Random) -> None:
        self.config, self.proposer, self.rng = config, proposer, rng
        self.spec_stats = SpeculationStats()
        self.times = StepTimes()

    def dispatch(self, plan: StepPlan, after: InFlight | None = None) -> InFlight:
        return InFlight(plan, lambda: (self.execute(plan), None))

    def execute(self, plan: StepPlan) -> list[list[int]]:
        out = [[(sum(c.token_ids) * 7 + 3) % TINY.vocab_size] for c in plan.prefill]
        if plan.decode:
            k = self.config.num_speculative_tokens
            drafts, counts, _ = self.proposer.propose(plan.decode, plan.draft_limits,
                                                      len(plan.decode), k)
            for i, seq in enumerate(plan.decode):
                accepted = self.rng.randint(0, int(counts[i]))
                bonus = (seq.request.last_token_id * 5 + 1) % TINY.vocab_size
                out.append([int(t) for t in drafts[i, :accepted]] + [bonus])
        return out


def test_ten_thousand_requests_leave_bounded_state(tiny_model) -> None:
    engine = tiny_engine(tiny_model, max_num_seqs=8, num_pages=64, max_step_records=500,
                         max_finished_outputs=100,
                         speculative=SpeculativeConfig("ngram", 3))
    proposer = NgramProposer(3, 1)
    rng = random.Random(0)
    engine.runner = TokenMockRunner(engine.runner.config, proposer, rng)
    seen = {"callbacks": 0}

    def callback(out) -> None:
        seen["callbacks"] += 1

    live: list[str] = []
    for i in range(10_000):
        prompt = [rng.randrange(1, 20) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True, seed=0)
        live.append(engine.add_request(prompt_token_ids=prompt, params=params,
                                       callback=callback))
        if rng.random() < 0.15:
            engine.abort(rng.choice(live))
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if i % 500 == 0:
            unfinished = len(engine.scheduler.seqs)
            assert len(proposer._indexes) <= unfinished
            assert len(engine._callbacks) <= unfinished
        live = [r for r in live if r in engine.scheduler.seqs]
    engine.run_until_done()
    assert seen["callbacks"] > 10_000
    assert not engine.scheduler.seqs and not proposer._indexes and not engine._callbacks
    assert len(engine.records) == 500 and engine.num_steps > 10_000
    assert [r.index for r in engine.step_records(engine.num_steps - 3)] == \
        list(range(engine.num_steps - 3, engine.num_steps))
    with pytest.raises(ValueError, match="max_step_records"):
        engine.step_records(0)  # a summary over dropped steps would be silently wrong
    assert len(engine._finished) == 100
    with pytest.raises(KeyError, match="finished longer ago"):
        engine.output("0")
    engine.allocator.check_invariants()
    assert engine.allocator.num_free() == engine.allocator.num_pages


# -- validation: one validator, all or nothing ----------------------------------------------

def test_generate_queues_nothing_when_a_later_prompt_is_bad(tiny_model) -> None:
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=4, max_model_len=64,
                          page_size=4, num_pages=4)
    # 20 tokens fit max_model_len but not the 16-slot pool: only the engine's check knows.
    with pytest.raises(ValueError, match="prompt 2: .*page pool"):
        llm.generate(prompt_token_ids=[[1, 2], [3, 4], [5] * 20],
                     sampling_params=SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.seqs
    with pytest.raises(ValueError, match="prompt 1: prompt token ids must be ints"):
        llm.generate(prompt_token_ids=[[1, 2], [True]],
                     sampling_params=SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()
    outs = llm.generate(prompt_token_ids=[[1, 2], [3, 4]],
                        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_a_request_that_fills_the_page_pool_exactly_runs(tiny_model) -> None:
    """prompt + max_tokens - 1 KV slots (the last token is never fed back) fit a pool of as
    many: such a request was refused as needing one slot more, and runs, with the tokens a
    larger pool gives; one slot more is refused."""
    rng = random.Random(0)
    params = dict(max_tokens=rng.randint(1, 6), ignore_eos=True)
    for _ in range(200):  # the check alone, at random sizes
        pool, max_tokens = rng.randint(1, 99), rng.randint(1, 20)
        limits = RequestLimits(pool_tokens=pool)
        prompt = [1] * max(1, pool + 1 - max_tokens)
        fits = len(prompt) + max_tokens - 1 <= pool
        try:
            validate_request(prompt, SamplingParams(max_tokens=max_tokens), limits)
            assert fits
        except ValueError:
            assert not fits
    page_size, num_pages = 4, 4
    prompt = [rng.randrange(1, 500) for _ in range(page_size * num_pages + 1
                                                    - params["max_tokens"])]
    outs = []
    for pages in (num_pages, None):
        llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=1, max_model_len=64,
                              page_size=page_size, num_pages=pages)
        outs.append(llm.generate(prompt_token_ids=[prompt],
                                 sampling_params=SamplingParams(**params))[0].token_ids)
        assert llm.engine.allocator.num_free() == llm.engine.allocator.num_pages
    assert outs[0] == outs[1] and len(outs[0]) == params["max_tokens"]
    with pytest.raises(ValueError, match="page pool"):
        LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=1, max_model_len=64,
                        page_size=page_size, num_pages=num_pages).generate(
            prompt_token_ids=[prompt + [1]], sampling_params=SamplingParams(**params))


def test_a_request_is_validated_once(tiny_model, monkeypatch) -> None:
    """The engine checks a request with the scheduler's limits and the vocabulary; the scheduler
    does not check it again. A request made by hand (not through `make_request`) is still
    refused by the scheduler, for what only it knows."""
    import infer.engine.engine as engine_module
    import infer.engine.scheduler as scheduler_module
    calls = []
    for module in (engine_module, scheduler_module):
        check = module.validate_request
        monkeypatch.setattr(module, "validate_request",
                            lambda *a, _check=check, _m=module.__name__: calls.append(_m)
                            or _check(*a))
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=2, max_model_len=64,
                          page_size=4)
    engine = llm.engine
    assert engine.limits.implies(engine.scheduler.limits)
    llm.generate(prompt_token_ids=[[1, 2], [3, 4]], sampling_params=SamplingParams(max_tokens=2))
    assert calls == ["infer.engine.engine"] * 2
    calls.clear()
    by_hand = Request("hand", [1] * 60, SamplingParams(max_tokens=8), None)
    with pytest.raises(ValueError, match="request 'hand': .*exceed max_model_len=64"):
        engine.submit(by_hand)
    assert calls == ["infer.engine.scheduler"] and not engine.has_unfinished()


def test_a_huge_top_k_does_not_fail_its_batch(tiny_model) -> None:
    """top_k past int32 once made building the step's arrays raise, failing every request of
    the batch; it restricts nothing, as a top_k of the vocabulary's size does."""
    engine = tiny_engine(tiny_model)
    sampled = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1)
    huge = dataclasses.replace(sampled, top_k=2**31)
    unrestricted = run(engine, [[1, 2, 3], [4, 5, 6]], sampled)
    ids = [engine.add_request(prompt_token_ids=[1, 2, 3], params=sampled),
           engine.add_request(prompt_token_ids=[4, 5, 6], params=huge)]
    engine.run_until_done()
    got = [engine.output(i) for i in ids]
    assert all(o.finished and len(o.token_ids) == 4 for o in got)
    assert [o.token_ids for o in got] == [o.token_ids for o in unrestricted]


def test_stop_strings_are_refused_without_a_tokenizer(tiny_model) -> None:
    """Without text they could never match: refused, as structured output is, not ignored."""
    engine = tiny_engine(tiny_model)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):  # Request's check
        engine.add_request(prompt_token_ids=[1, 2], params=SamplingParams(stop=["a"],
                                                                          max_tokens=4))
    assert not engine.has_unfinished()
    engine.add_request(prompt_token_ids=[1, 2], params=SamplingParams(stop_token_ids=[7],
                                                                      max_tokens=4))


def test_request_limits_implies() -> None:
    tight = RequestLimits(vocab_size=10, max_model_len=32, pool_tokens=64)
    loose = RequestLimits(max_model_len=64, pool_tokens=64)
    assert tight.implies(loose) and tight.implies(RequestLimits()) and tight.implies(tight)
    assert not loose.implies(tight)  # no vocabulary check, a longer context
    assert not RequestLimits(vocab_size=10).implies(loose)


def test_prompts_are_tokenized_once(smollm2) -> None:
    config, _, tokenizer = smollm2
    model = Llama(dataclasses.replace(TINY, vocab_size=config.vocab_size), jnp.float32,
                  nnx.Rngs(0))
    calls = {"n": 0}
    encode = tokenizer.encode

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, *args, **kwargs):
            calls["n"] += 1
            return encode(text, *args, **kwargs)

    llm = LLM.from_loaded(model.config, model, Counting(), max_num_seqs=2, max_model_len=64)
    outs = llm.generate(["Hello there", "A page table"], SamplingParams(max_tokens=2,
                                                                       ignore_eos=True))
    assert calls["n"] == 2 and all(len(o.token_ids) == 2 for o in outs)


@pytest.mark.parametrize("field, value", [("page_size", 0), ("num_pages", 0),
                                          ("max_model_len", 0), ("max_num_seqs", 0),
                                          ("max_prefill_tokens", -1), ("page_size", True)])
def test_engine_config_rejects_bad_sizes(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.fixture
def no_checkpoint_read(monkeypatch) -> None:
    """LLM(...) fails with an AssertionError once it reaches the checkpoint's read: a setting
    refused before it raises its own error instead."""
    import infer.llm

    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the settings were checked")

    monkeypatch.setattr(infer.llm, "load_on_host", no_read)


BAD_SETTINGS = [("scheduler", "fcfs"), ("attention_backend", "flash"),
                ("kv_cache_dtype", "int3"), ("static_max_wait_s", -1.0),
                ("static_max_wait_s", float("nan")), ("static_max_wait_s", "5"),
                ("enable_prefix_caching", "no"), ("mixed_steps", 1),
                ("async_scheduling", None), ("page_size", 0), ("dp_routing", "random"),
                ("dp_routing", "prefix"),  # without the prefix cache it routes by
                ("speculative", {"method": "ngram", "num_tokens": 0})]


@pytest.mark.parametrize("field, value", BAD_SETTINGS)
def test_llm_rejects_bad_settings_before_reading_the_checkpoint(
        tiny_model, no_checkpoint_read, field: str, value: object) -> None:
    """Each of LLM's engine settings is checked before the checkpoint is read (seconds, a large
    GGUF's minutes), with a ValueError; a scheduler or backend typo once surfaced only after
    the read, and a bad static wait, a non-bool flag or a routing typo with one replica
    passed silently (enable_prefix_caching="no" turned prefix caching on)."""
    if field in inspect.signature(LLM).parameters:  # async_scheduling: EngineConfig's alone
        with pytest.raises(ValueError):
            LLM(model="tiny", compilation_cache=False, **{field: value})
    with pytest.raises(ValueError):  # the same checks for a loaded model
        LLM.from_loaded(TINY, tiny_model, None, **{field: value})
    LLM.from_loaded(TINY, tiny_model, None, max_model_len=64, page_size=4)  # the good ones pass


@pytest.mark.parametrize("settings, refusal", [
    (dict(mixed_steps=True, speculative={"method": "ngram"}), "mixed steps"),
    (dict(kv_cache_dtype="int4_kivi", speculative={"method": "eagle", "tree": "2x2"}),
     "tree speculation")])
def test_llm_refuses_what_speculation_cannot_run_with_before_reading(
        no_checkpoint_read, settings: dict, refusal: str) -> None:
    """Settings each good alone and not together: refused by the runner and the scheduler,
    once the checkpoint had been read; a chain over int4_kivi, or mixed steps alone, pass."""
    with pytest.raises(ValueError, match=refusal):
        LLM(model="tiny", compilation_cache=False, **settings)
    for alone in ({"mixed_steps": True}, {"kv_cache_dtype": "int4_kivi",
                                          "speculative": {"method": "eagle"}}):
        with pytest.raises(AssertionError, match="the checkpoint was read"):
            LLM(model="tiny", compilation_cache=False, **alone)


def test_llm_refuses_speculation_over_tensor_parallelism_before_reading(
        no_checkpoint_read) -> None:
    """Found only once the model was read and placed, where the engine refused it; data
    parallelism gives each replica one device and is taken."""
    with pytest.raises(ValueError, match="speculative decoding runs on one device.*spans 2"):
        LLM(model="tiny", compilation_cache=False, tensor_parallel_size=2,
            speculative={"method": "ngram"})
    with pytest.raises(AssertionError, match="the checkpoint was read"):
        LLM(model="tiny", compilation_cache=False, data_parallel_size=2,
            speculative={"method": "ngram"})


# -- seeds -----------------------------------------------------------------------------------

def test_unseeded_requests_draw_fresh_seeds_and_report_them(tiny_model) -> None:
    engine = tiny_engine(tiny_model)
    prompt = [5, 6, 7]
    unseeded = SamplingParams(temperature=20.0, max_tokens=16, ignore_eos=True)  # spread out
    a, b = run(engine, [prompt, prompt], unseeded)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a.token_ids != b.token_ids
    # A reported seed reproduces its output; an explicit seed reproduces itself.
    again = run(engine, [prompt], dataclasses.replace(unseeded, seed=a.seed))[0]
    assert again.token_ids == a.token_ids and again.seed == a.seed


# -- stop strings while streaming ------------------------------------------------------------

def test_streamed_text_never_shows_part_of_a_stop_string(smollm2) -> None:
    """Random stop strings cut from real text: every streamed text is a prefix of the final
    text, which ends just before the first stop string."""
    from pydoc_data.topics import topics

    tokenizer = smollm2[2]
    rng = random.Random(0)
    corpus = [t for t in topics.values() if len(t) > 400]
    checked = 0
    for trial in range(60):
        doc = rng.choice(corpus)
        start = rng.randrange(0, len(doc) - 300)
        ids = tokenizer.encode(doc[start:start + 300], add_bos=False)
        text = tokenizer.decode(ids)
        at = rng.randrange(20, len(text) - 10)
        stop = text[at:at + rng.randint(1, 8)]
        if not stop.strip():
            continue
        decoy = stop[:-1] + chr(ord(stop[-1]) + 1) if len(stop) > 1 else "\x00"
        expected = text[:text.find(stop)]
        r = Request(str(trial), [1], SamplingParams(max_tokens=len(ids) + 1,
                                                    stop=(decoy, stop), seed=0),
                    tokenizer)
        for token in ids:
            finished = r.append(token)
            shown = r.output().text
            assert expected.startswith(shown), (stop, shown[-20:], expected[-20:])
            if finished:
                break
        if decoy not in text[:len(expected) + len(stop)]:
            assert r.finish_reason == FinishReason.STOP and r.output().text == expected
            checked += 1
    assert checked >= 40


# -- final-only outputs ----------------------------------------------------------------------

def test_a_final_only_request_ends_as_a_streamed_one(smollm2) -> None:
    """Random token streams (special tokens, UTF-8 characters cut between tokens, stop ids, stop
    strings, max_tokens, aborts): a request that decodes its text once, at the end, finishes
    where a streamed one does, with the same output."""
    tokenizer = smollm2[2]
    n = tokenizer.vocab_size
    specials = [i for i in range(n) if tokenizer.is_special(i)]
    # Tokens that end inside a UTF-8 character, which the streamed text holds back.
    partial = [i for i in range(n) if tokenizer.decode([i]).endswith("\ufffd")]
    rng = random.Random(3)
    for trial in range(300):
        length = rng.randint(1, 40)
        ids = [rng.choice(rng.choice([specials, partial, range(n)])) for _ in range(length)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop_ids = (rng.choice(ids),) if rng.random() < 0.3 else ()
        at = rng.randrange(len(text)) if text else 0
        stop = (text[at:at + rng.randint(1, 4)],) if text and rng.random() < 0.3 else None
        params = SamplingParams(max_tokens=rng.randint(1, length), stop_token_ids=stop_ids,
                                stop=stop, ignore_eos=rng.random() < 0.5, seed=0)
        abort_after = rng.randrange(length) if rng.random() < 0.2 else length
        outputs = []
        for kind in OUTPUT_KINDS:
            r = Request(str(trial), [1], dataclasses.replace(params, output_kind=kind),
                        tokenizer, tokenizer.eos_ids)
            for token in ids[:abort_after]:
                if r.append(token):
                    break
            r.abort()
            assert r.finished
            outputs.append(r.output())
        streamed, final = outputs
        assert (final.text, final.token_ids, final.finish_reason) == (
            streamed.text, streamed.token_ids, streamed.finish_reason), (trial, params)


def test_final_only_requests_come_back_once_with_the_streamed_tokens(tiny_model) -> None:
    """A step hands back a streamed request's output at each of its tokens and a final-only
    request's once, when it finishes; the tokens are those of the same requests all streamed."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randint(1, 12))]
               for _ in range(10)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 20),
                             seed=i, ignore_eos=True) for i in range(len(prompts))]
    kinds = ["final", "cumulative"] + [rng.choice(OUTPUT_KINDS) for _ in prompts[2:]]
    engine = tiny_engine(tiny_model)
    ids = [engine.add_request(prompt_token_ids=p, params=dataclasses.replace(sp, output_kind=k))
           for p, sp, k in zip(prompts, params, kinds)]
    handed_back, finals = collections.Counter(), {}
    for out in engine.stream():
        handed_back[out.request_id] += 1
        if out.finished:
            finals[out.request_id] = out
    for i, kind in zip(ids, kinds):
        expected = len(finals[i].token_ids) if kind == "cumulative" else 1
        assert handed_back[i] == expected, (kind, handed_back[i], len(finals[i].token_ids))
    streamed = run(tiny_engine(tiny_model), prompts[:1], params[0]) + [
        run(tiny_engine(tiny_model), [p], sp)[0] for p, sp in zip(prompts[1:], params[1:])]
    assert [finals[i].token_ids for i in ids] == [o.token_ids for o in streamed]


def test_ids_past_the_tokenizers_vocabulary_decode_to_nothing(tiny_model) -> None:
    """A tokenizer with fewer ids than the model samples (a byte-level one of 258 under the tiny
    model's 512, built without `model_vocab_size`): the ids past it decode to "" in the
    engine's requests, as in HF, rather than fail the step that samples one."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from infer.io.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(models.BPE(
        {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    tok = Tokenizer(backend, bos_id=256, eos_ids=[257], add_bos=False, chat_template=None)
    assert tok.vocab_size == 258 < TINY.vocab_size
    engine = Engine(tiny_model, tok, EngineConfig(max_num_seqs=4, max_prefill_tokens=16,
                                                  max_model_len=64, page_size=4))
    rng = random.Random(4)
    for trial in range(40):
        ids = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 10))]
        params = SamplingParams(max_tokens=len(ids), ignore_eos=True, seed=0,
                                output_kind=rng.choice(OUTPUT_KINDS),
                                stop=["\x00\x00\x00"] if rng.random() < 0.5 else None)
        request = engine.make_request(prompt_token_ids=[1], params=params)
        for i, token in enumerate(ids):
            assert request.append(token) == (i == len(ids) - 1)
        known = [t for t in ids if t < tok.vocab_size]
        assert request.output().text == tok.decode(known, skip_special_tokens=True)


# -- draining --------------------------------------------------------------------------------

def test_a_drain_lasts_one_run(tiny_model) -> None:
    """stream() and run_until_done() start a partial static batch because no more requests
    will come during them; afterwards, a request added waits for its batch to fill, as on a
    fresh engine (the drain once stuck, so every later request started alone)."""
    engine = tiny_engine(tiny_model, scheduler="static")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for trial in range(6):
        for _ in range(rng.randint(1, 3)):
            engine.add_request(prompt_token_ids=[rng.randrange(1, 500)] * 3, params=params)
        how = rng.choice(("run_until_done", "stream", "stream closed early"))
        if how == "run_until_done":
            engine.run_until_done()
        else:
            stream = engine.stream()
            next(stream)
            if how == "stream":
                for _ in stream:
                    pass
            stream.close()
            engine.run_until_done()
        assert not engine.scheduler.draining, how
        waiting = rng.randint(1, engine.config.max_num_seqs - 1)
        ids = [engine.add_request(prompt_token_ids=[7, 8], params=params) for _ in range(waiting)]
        assert engine.seconds_until_work() == float("inf"), how
        engine.step()
        assert not engine.scheduler.running and len(engine.scheduler.waiting) == waiting, how
        for i in ids:
            engine.abort(i)


# -- request ids -----------------------------------------------------------------------------

def test_numbered_ids_skip_the_ids_callers_chose(tiny_model) -> None:
    """A caller's own ids may look like the engine's numbered ones; a fresh id never takes a
    live one (generate once failed midway on such a clash, its earlier prompts left queued)."""
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=4, max_model_len=64,
                          page_size=4)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(5):
        chosen = {str(engine._ids.next_number + rng.randrange(6)) for _ in range(3)}
        for i in chosen:
            engine.add_request(prompt_token_ids=[1, 2], params=params, request_id=i)
        if rng.random() < 0.5:  # finished, their outputs kept: still theirs after generate
            engine.run_until_done()
        prompts = [[rng.randrange(1, 500)] for _ in range(rng.randint(1, 6))]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.prompt_token_ids for o in outs] == prompts
        assert not {o.request_id for o in outs} & chosen
        assert all(len(o.token_ids) == 2 for o in outs)
        for i in chosen:  # generate ran them too
            assert engine.output(i).finished and engine.output(i).prompt_token_ids == [1, 2]
        assert not engine.has_unfinished()


def test_generate_counts_only_its_own_requests(tiny_model, monkeypatch) -> None:
    """The engine runs every request it holds; generate's progress bar counts its own prompts
    only (other requests once pushed it past its total) and returns its own outputs."""
    import tqdm

    bars = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=4, max_model_len=64,
                          page_size=4)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(4):
        others = [llm.engine.add_request(prompt_token_ids=[3, 4], params=params)
                  for _ in range(rng.randint(0, 5))]
        prompts = [[rng.randrange(1, 500)] for _ in range(rng.randint(1, 5))]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
        assert [o.prompt_token_ids for o in outs] == prompts
        assert bars[-1].n == bars[-1].total == len(prompts) and bars[-1].closed
        assert all(llm.engine.output(i).finished for i in others)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_token_ids=[1, 2, 3]), "prompt 0: prompt_token_ids must be a sequence"),
    (dict(prompt_token_ids=[[1, 2], 7], sampling_params=SamplingParams(max_tokens=2)),
     "prompt 1: prompt_token_ids must be a sequence"),
    (dict(prompt_token_ids=[[1, 2]], sampling_params=[dict(max_tokens=2)]),
     "prompt 0: sampling params must be SamplingParams"),
    (dict(prompt_token_ids=[[1], [2]], sampling_params=[SamplingParams(), None]),
     "prompt 1: sampling params must be SamplingParams"),
])
def test_mistyped_inputs_raise_value_error(tiny_model, kwargs: dict, match: str) -> None:
    """validate_request's promise (a ValueError naming the problem, nothing queued) holds for
    inputs of the wrong type too: a flat id list, a bare id, a dict for SamplingParams once raised
    TypeErrors from deep inside ('int' object is not iterable)."""
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=4, max_model_len=64,
                          page_size=4)
    with pytest.raises(ValueError, match=match):
        llm.generate(**kwargs)
    with pytest.raises(ValueError, match="prompt_token_ids must be a sequence"):
        llm.engine.add_request(prompt_token_ids=5)
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.seqs


@pytest.mark.parametrize("request_id", [0, 1.0, None, b"0", ("0",)])
def test_request_ids_are_strings(tiny_model, request_id) -> None:
    """The engine numbers its requests "0", "1", ...: abort(0) once stopped nothing without a
    word, and add_request took an int id that abort("0") could not name. Both refuse a non-str
    id (add_request's None is its own fresh id), changing nothing."""
    engine = tiny_engine(tiny_model)
    first = engine.add_request(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2))
    assert first == "0"
    with pytest.raises(ValueError, match="request ids are strings"):
        engine.abort(request_id)
    if request_id is not None:
        with pytest.raises(ValueError, match="request ids are strings"):
            engine.add_request(prompt_token_ids=[3], params=SamplingParams(max_tokens=2),
                               request_id=request_id)
    assert list(engine.scheduler.seqs) == ["0"] and engine.abort("0") is not None


def test_request_ids_skip_every_taken_number() -> None:
    rng = random.Random()
    ids, handed = RequestIds(), []
    taken = {str(rng.randrange(40)) for _ in range(15)}
    for _ in range(20):
        handed.append(ids.fresh(taken.__contains__))
    assert len(set(handed)) == 20 and not set(handed) & taken
    assert sorted(map(int, handed)) == [int(h) for h in handed]  # numbered in order
    assert all(str(n) in taken or str(n) in handed for n in range(int(handed[-1])))


# -- a step stopped midway ------------------------------------------------------------------

class DeviceError(RuntimeError):
    pass


def _failing_once(engine: Engine, at: int, action, pipelined: bool = False) -> None:
    """Makes the `at`-th wait for a step's tokens run `action` (raise, or signal); with
    `pipelined`, counting from the first step that was planned ahead."""
    wait, calls = engine.runner._wait, [0]

    def flaky(x):
        if not pipelined or any(r.planned_ahead for r in engine.records):
            calls[0] += 1
            if calls[0] == at:
                action()
        return wait(x)

    engine.runner._wait = flaky


@pytest.mark.parametrize("seed", range(4))
def test_a_step_that_fails_midway_leaves_the_engine_exact(tiny_model, seed: int) -> None:
    """A device error while a step's tokens are read, at a random step, with async scheduling
    (the next step already planned on the lost tokens): the engine goes on, and every request
    gets the tokens it gets without the error. The step planned ahead used to be kept, and
    added its tokens to rows that lacked the ones before them."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 12))] for _ in range(4)]
    # Temperature 9: the random tiny model's draws at 1 are all its argmax, which a lost or
    # shifted token would not change.
    params = [SamplingParams(max_tokens=rng.randint(4, 20), temperature=9.0, seed=i,
                             ignore_eos=True) for i in range(4)]
    expected = [o.token_ids for o in run_jobs(tiny_engine(tiny_model),
                                              list(zip(prompts, params)))]
    assert len({t for tokens in expected for t in tokens}) > 8
    engine = tiny_engine(tiny_model)

    def fail() -> None:
        raise DeviceError("lost")

    _failing_once(engine, rng.randint(1, 4), fail, pipelined=True)
    ids = [engine.add_request(prompt_token_ids=p, params=s) for p, s in zip(prompts, params)]
    with pytest.raises(DeviceError):
        engine.run_until_done()
    engine.run_until_done()
    assert [engine.output(i).token_ids for i in ids] == expected


def test_ctrl_c_during_a_step_waits_for_its_end(tiny_model) -> None:
    """SIGINT while a step waits for the device: KeyboardInterrupt once the step is recorded
    (its cache handed back, its tokens kept), and the engine goes on exactly; a second
    SIGINT stops at once."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    # Python's own handler, as in a script or notebook: a test runner's worker may ignore SIGINT.
    runner_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_step(tiny_model)
    finally:
        signal.signal(signal.SIGINT, runner_handler)


def _interrupt_a_step(tiny_model) -> None:
    import os
    import signal

    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, temperature=9.0,
                                                           seed=3, ignore_eos=True)
    expected = [o.token_ids for o in run(tiny_engine(tiny_model), prompts, params)]
    engine = tiny_engine(tiny_model)
    _failing_once(engine, 5, lambda: os.kill(os.getpid(), signal.SIGINT))
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    steps = engine.num_steps
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_done()
    assert engine.num_steps > steps and engine.records[-1].output_tokens > 0  # it finished
    engine.run_until_done()
    assert [engine.output(i).token_ids for i in ids] == expected
    twice = tiny_engine(tiny_model)
    twice.add_request(prompt_token_ids=[5, 6], params=params)

    def two() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second interrupt did not stop the step")

    _failing_once(twice, 3, two)
    with pytest.raises(KeyboardInterrupt):
        twice.run_until_done()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_generate_stopped_midway_takes_its_requests_away(tiny_model) -> None:
    """An interrupted generate leaves none of its requests queued: the next call runs its own
    prompts alone, as a fresh engine does."""
    llm = LLM.from_loaded(TINY, tiny_model, None, max_num_seqs=4, max_prefill_tokens=16,
                          max_model_len=64, page_size=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    step, calls = llm.engine.step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=[[5, 6, 7]] * 3, sampling_params=params)
    assert not llm.engine.has_unfinished()
    llm.engine.step = step
    out = llm.generate(prompt_token_ids=[[9, 8]], sampling_params=params)
    fresh = run(tiny_engine(tiny_model), [[9, 8]], params)
    assert out[0].token_ids == fresh[0].token_ids


# -- LLM's arguments -------------------------------------------------------------------------

def test_llm_takes_a_speculative_config_as_from_loaded_does(tiny_model,
                                                           no_checkpoint_read) -> None:
    """`infer` exports SpeculativeConfig, and from_loaded took one; LLM(...) unpacked it as a
    dict and failed with a TypeError about mappings."""
    for spec in (SpeculativeConfig("ngram"), {"method": "ngram"}):
        with pytest.raises(AssertionError, match="the checkpoint was read"):
            LLM(model="tiny", compilation_cache=False, speculative=spec)
        llm = LLM.from_loaded(TINY, tiny_model, None, max_model_len=64, page_size=4,
                              speculative=spec)
        assert llm.engine.config.speculative == SpeculativeConfig("ngram")
    with pytest.raises(TypeError, match="SpeculativeConfig or a dict"):
        LLM(model="tiny", compilation_cache=False, speculative="ngram")


def test_from_loaded_warms_up_as_llm_does(tiny_model) -> None:
    """from_loaded(warmup=True) compiles every program ahead, as LLM(warmup=True) does (it was
    an unknown EngineConfig field). Shapes no other test builds, so nothing is shared."""
    from infer.platform import CompileCounter

    llm = LLM.from_loaded(TINY, tiny_model, None, max_model_len=40, page_size=5,
                          max_num_seqs=3, max_prefill_tokens=24, warmup=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randint(1, 30))]
               for _ in range(5)]
    with CompileCounter() as compiles:
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6))
    assert compiles.count == 0


def test_reset_prefix_cache_frees_what_no_request_holds(tiny_model) -> None:
    """vLLM's LLM.reset_prefix_cache: cached pages that no request holds go back to the pool,
    and the next run of the same prompt computes it again with the same tokens; a running
    request's pages stay until it ends (False until then)."""
    llm = LLM.from_loaded(TINY, tiny_model, None, max_model_len=64, page_size=4,
                          max_num_seqs=2, enable_prefix_caching=True)
    engine = llm.engine
    prompt = [[(7 * i) % 300 + 1 for i in range(30)]]
    params = SamplingParams(max_tokens=5)
    first = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0]
    again = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0]
    assert again.metrics.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert len(engine.prefix_cache) > 0
    assert llm.reset_prefix_cache()
    assert len(engine.prefix_cache) == 0
    assert engine.allocator.num_free() == engine.config.num_pages
    fresh = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0]
    assert fresh.metrics.num_cached_tokens == 0 and fresh.token_ids == first.token_ids

    request_id = engine.add_request(prompt_token_ids=prompt[0], params=params)
    while not engine.scheduler.seqs[request_id].num_computed:
        engine.step()
    assert not llm.reset_prefix_cache()  # the pages the running request holds stay cached
    assert len(engine.prefix_cache) == 30 // 4
    engine.run_until_done()
    assert llm.reset_prefix_cache() and len(engine.prefix_cache) == 0
    engine.allocator.check_invariants()


@pytest.mark.parametrize("settings, refusal", [
    (dict(tensor_parallel_size=2), "splits neither"),  # SmolLM2: 9 heads, 3 KV heads
    (dict(tensor_parallel_size=5, pad_heads=True), "intermediate_size"),
    (dict(kv_cache_dtype="int4_kivi", page_size=128), "divisible by the page size")])
def test_llm_refuses_what_the_models_shapes_rule_out_before_the_weights(
        monkeypatch, tmp_path, settings: dict, refusal: str) -> None:
    """Settings the model's config rules out were refused after the whole checkpoint was read
    (seconds here, a large GGUF's minutes): now once the config is, before any tensor, for a
    GGUF file and a HF directory alike. Settings that fit go on to read the tensors."""
    import json

    import infer.io.checkpoint

    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors were read")

    monkeypatch.setattr(infer.io.checkpoint, "_dequantize", no_tensors)
    monkeypatch.setattr(infer.io.checkpoint, "_safetensors_files", no_tensors)
    hf_dir = tmp_path / "smollm2-shapes"  # SmolLM2's shapes, its config.json alone
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
    (hf_dir / "tokenizer.json").write_text("{}")  # present: a directory without one stops first
    for model in ("smollm2-135m", str(hf_dir)):
        with pytest.raises(ValueError, match=refusal):
            LLM(model=model, compilation_cache=False, **settings)
        fitting = {**settings, "tensor_parallel_size": 3} if "pad_heads" in settings or \
            "tensor_parallel_size" in settings else {**settings, "page_size": 32}
        with pytest.raises(AssertionError, match="tensors were read"):
            LLM(model=model, compilation_cache=False, **fitting)


def test_int4_kivi_with_the_pallas_backend_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="reference attention backend only"):
        EngineConfig(kv_cache_dtype="int4_kivi", attention_backend="pallas")
    EngineConfig(kv_cache_dtype="int4_kivi", attention_backend="reference")


@pytest.mark.parametrize("how", ["raises", "aborts", "aborts_then_raises", "aborts_and_resubmits"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_its_callback_ends_ends_in_the_steps_outputs(tiny_model, how: str,
                                                               async_scheduling: bool) -> None:
    """Whatever the callback does to its own request (raise, abort it, abort it and raise,
    abort it and start another under the same id), step() shows the request's end, its own
    output and never a stale one under the id. An abort inside the callback came back as the
    unfinished output the callback was handed."""
    engine = tiny_engine(tiny_model, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = [5, 6, 7], [9, 10, 11, 12]

    def callback(out) -> None:
        if out.finished or len(out.token_ids) < 2:
            return
        if how != "raises":
            engine.abort("x")
        if how == "aborts_and_resubmits":
            engine.add_request(prompt_token_ids=second, params=params, request_id="x")
        if how in ("raises", "aborts_then_raises"):
            raise RuntimeError("consumer bug")

    engine.add_request(prompt_token_ids=first, params=params, request_id="x", callback=callback)
    outs = [o for o in engine.stream() if o.request_id == "x"]
    old = [o for o in outs if o.prompt_token_ids == first]
    assert old[-1].finished and old[-1].finish_reason == FinishReason.ABORT
    assert len(old[-1].token_ids) == 2 and all(not o.finished for o in old[:-1])
    new = [o for o in outs if o.prompt_token_ids == second]
    if how == "aborts_and_resubmits":
        assert outs.index(old[-1]) < outs.index(new[0])  # the old one's end, then the new one's
        assert new[-1].finished and len(new[-1].token_ids) == 6
    else:
        assert not new and not engine.has_unfinished()
    engine.allocator.check_invariants()
