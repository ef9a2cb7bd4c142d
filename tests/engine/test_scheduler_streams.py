"""Randomized request streams through the scheduler, with a mock runner that reads every token
back through the page tables (no JAX). Each stream draws its own pool size (2-64 pages), page
size, policy, prompts with shared prefixes, output lengths, arrivals, aborts, a prefix cache or
none, speculative slots whose drafts are partly wrong, stop tokens, and half of them the
engine's async scheduling (each decode step's successor planned and dispatched before its tokens
are read, `Scheduler.next_steps`), and half of those without drafts mixed steps (a prefill
chunk and the decode rows planned as one step). Every stream must finish within a bound of steps, give each request exactly the tokens it gets alone, and account for every page
after every step.

The seeds are a fixed range, so a failure names the seed that reproduces it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from infer.cache.page_allocator import PageAllocator
from infer.cache.prefix_cache import PrefixCache
from infer.engine.plan import SeqState, Status
from infer.engine.request import FinishReason, Request
from infer.engine.scheduler import Scheduler, SchedulerConfig
from infer.sampling_params import SamplingParams
from tests.mock_runner import VOCAB, PageReadingRunner, alone, next_token


def check_pages(sched: Scheduler, cache: PrefixCache | None) -> None:
    """Every page is free, or its refcount equals its holders: sequences plus the cache."""
    allocator = sched.allocator
    holders: Counter[int] = Counter()
    for seq in sched.running:
        holders.update(seq.pages.pages)
    for seq in sched.waiting:
        assert not seq.pages.pages, "a waiting request holds pages"
    if cache is not None:
        holders.update(cache._nodes.keys())
    for page in range(allocator.num_pages):
        assert allocator.refcount(page) == holders[page], (page, allocator.refcount(page),
                                                            holders[page])
    cached = len(cache) if cache is not None else 0
    held_only = sum(1 for p in holders if cache is None or p not in cache._nodes)
    assert allocator.num_free() + cached + held_only == allocator.num_pages


def check_states(sched: Scheduler, seqs: list[SeqState]) -> None:
    """One counter and one finished state: a sequence's cached count (its pages' count) never
    exceeds the slots it holds nor its tokens; a waiting one has none; its status follows its
    request (FINISHED exactly when the request has a finish reason) and the queue it is in;
    a finished one holds no page and is forgotten."""
    running, waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
    for seq in seqs:
        assert seq.num_computed == seq.pages.num_tokens
        assert 0 <= seq.num_computed <= seq.pages.capacity, (seq.num_computed, seq.pages)
        assert seq.num_computed <= seq.num_tokens
        assert seq.finished == seq.request.finished
        if seq.request.finished:
            assert seq.status == Status.FINISHED
            assert not seq.pages.pages and seq.num_computed == 0
            assert id(seq) not in running and id(seq) not in waiting
            assert seq.request.request_id not in sched.seqs
        elif id(seq) in running:
            assert seq.status == Status.RUNNING and id(seq) not in waiting
        else:
            assert seq.status == Status.WAITING and id(seq) in waiting
            assert seq.num_computed == 0


def run_stream(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4, 8])
    num_pages = rng.randint(2, 64)
    use_cache = rng.random() < 0.6
    spec = rng.choice([0, 0, 1, 2, 4])
    plan_ahead = rng.random() < 0.5  # the engine's async scheduling
    mixed = not spec and rng.random() < 0.5  # a chunk and the decode rows in one step
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 6), max_prefill_tokens=rng.choice([1, 3, 8, 16]),
        max_model_len=num_pages * page_size, policy=rng.choice(["continuous", "continuous",
                                                                "static"]),
        num_speculative_tokens=spec, mixed_steps=mixed)
    allocator = PageAllocator(num_pages, page_size)
    cache = PrefixCache(allocator) if use_cache else None
    clock = iter(range(10**9))
    sched = Scheduler(config, allocator, clock=lambda: float(next(clock)), prefix_cache=cache)
    runner = PageReadingRunner(allocator, rng, p_right=rng.random())
    capacity = num_pages * page_size
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3 * page_size + 2))]
                for _ in range(rng.randint(1, 3))]

    def new_request(i: int) -> Request:
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]
        prompt = (head + tail)[:max(1, capacity - 1)]
        room = capacity - len(prompt)
        # A stop token ends some requests early, unforeseen by anyone planning ahead.
        stop = tuple(rng.sample(range(1, VOCAB), 3)) if rng.random() < 0.5 else ()
        return Request(f"{seed}/{i}", prompt,
                       SamplingParams(max_tokens=rng.randint(1, min(16, room)), seed=0,
                                      stop_token_ids=stop),
                       None, arrival_s=0.0)

    pending = [new_request(i) for i in range(rng.randint(1, 8))]
    requests: list[Request] = []
    seqs: list[SeqState] = []
    budget = 0
    steps = 0
    in_flight, ahead_steps, overrun, mixed_steps = None, 0, 0, 0
    chunk_tokens: Counter[str] = Counter()  # prompt tokens each request's chunks computed
    # Preemptions that took pages from a request: what its num_preemptions must count (one
    # holding none, admitted but not yet started, loses nothing when sent back).
    lost: Counter[str] = Counter()
    preempt = sched._preempt

    def watched_preempt(seq: SeqState) -> None:
        lost[seq.request.request_id if seq.pages.pages else "(held none)"] += 1
        preempt(seq)

    sched._preempt = watched_preempt
    while pending or sched.has_unfinished():
        if pending and (not sched.has_unfinished() or rng.random() < 0.3):
            request = pending.pop(0)
            seqs.append(sched.add(request))
            requests.append(request)
            budget += len(request.prompt_token_ids) + request.params.max_tokens
        if not pending:
            sched.draining = True  # the static policy may start a partial batch
        live = [r for r in requests if not r.finished]
        if live and rng.random() < 0.03:
            sched.abort(rng.choice(live).request_id)
        step, in_flight = sched.next_steps(in_flight, runner.dispatch, plan_ahead)
        sched.postprocess(step.plan, step.result())
        if cache is not None:  # every full computed page offered in the step that filled it
            for seq in sched.running:
                full = seq.num_computed // page_size * page_size
                assert cache.cached_tokens(seq.request.all_token_ids[:full]) == full, seed
        # Idle only with nobody to run: a running request always has a chunk or a row to
        # compute, or is preempted to free pages for one.
        assert step.plan.kind != "idle" or not sched.running, f"seed {seed}: idle step"
        for chunk in step.plan.prefill:
            chunk_tokens[chunk.seq.request.request_id] += len(chunk.token_ids)
        ahead_steps += in_flight is not None
        mixed_steps += step.plan.kind == "mixed"
        if in_flight is not None:  # rows of the step in flight whose request just ended
            overrun += sum(s.finished for s in in_flight.plan.decode)
        check_pages(sched, cache)
        check_states(sched, seqs)
        steps += 1
        # A preempted request recomputes what it had, so work is bounded by a multiple of the
        # tokens asked for; a livelock or a stall runs past it.
        assert steps <= 8 * budget + 20, f"seed {seed}: no end after {steps} steps"
    for r in requests:
        assert r.finished, (seed, r.request_id)
        assert r.num_preemptions == lost[r.request_id], (seed, r.request_id)
        # Cached tokens are those this request did not compute: with one admission, its
        # chunks and the cache cover the prompt (or all but its last token, which a decode
        # step computed when the cache held the rest).
        assert 0 <= r.num_cached_tokens <= len(r.prompt_token_ids), (seed, r.request_id)
        if cache is None:
            assert r.num_cached_tokens == 0, (seed, r.request_id)
        elif r.num_preemptions == 0 and r.output_ids:
            covered = r.num_cached_tokens + chunk_tokens[r.request_id]
            assert covered - len(r.prompt_token_ids) in (0, -1), (seed, r.request_id)
        assert r.output_ids == alone(r.prompt_token_ids, len(r.output_ids)), (seed, r.request_id)
        stops = [i for i, t in enumerate(r.output_ids) if t in r.params.stop_token_ids]
        if r.finish_reason == FinishReason.STOP:
            assert stops == [len(r.output_ids) - 1], (seed, r.request_id)
        elif r.finish_reason == FinishReason.LENGTH:
            assert not stops and len(r.output_ids) == r.params.max_tokens, (seed, r.request_id)
    assert not sched.seqs and not sched.running and not sched.waiting
    check_pages(sched, cache)
    check_states(sched, seqs)
    if cache is not None:
        stats = cache.stats()
        # One lookup per admission: each request with tokens was admitted, each preemption
        # (or sending back) may be followed by one more.
        assert (sum(bool(r.output_ids) for r in requests) <= stats["lookups"]
                <= sum(1 + r.num_preemptions for r in requests) + lost["(held none)"]), stats
        assert stats["hits"] <= stats["lookups"], stats
        assert stats["hit_tokens"] <= stats["lookup_tokens"], stats
        assert stats["hit_tokens"] >= sum(r.num_cached_tokens for r in requests), stats
        cache.check_invariants()
        cache.evict(num_pages)
    assert allocator.num_free() == num_pages, f"seed {seed}: pages lost"
    allocator.check_invariants()
    return {"steps": steps, "preemptions": sum(r.num_preemptions for r in requests),
            "sent_back_holding_none": lost["(held none)"],
            "cached": sum(r.num_cached_tokens for r in requests), "ahead": ahead_steps,
            "overrun": overrun, "mixed": mixed_steps,
            "stopped": sum(r.finish_reason == FinishReason.STOP for r in requests)}


@pytest.mark.parametrize("block", range(4))
def test_random_streams_finish_exact_and_lose_no_page(block: int) -> None:
    totals: Counter[str] = Counter()
    for seed in range(block * 750, (block + 1) * 750):
        totals.update(run_stream(seed))
    # The streams must really exercise what they claim to: preemption, cache hits, steps
    # planned ahead and requests stopping early.
    assert totals["preemptions"] > 50 and totals["cached"] > 500, totals
    assert totals["sent_back_holding_none"] > 0, totals
    assert totals["ahead"] > 1000 and totals["stopped"] > 200 and totals["overrun"] > 5, totals
    assert totals["mixed"] > 500, totals


def test_admission_does_not_count_the_matched_pages_as_evictable() -> None:
    """A request whose cached prefix is the only evictable memory: taking those pages makes
    them unevictable, so its first chunk's other pages must come from the free list. Counting
    them twice admitted a request whose first chunk could not be had."""
    allocator = PageAllocator(6, 2)
    cache = PrefixCache(allocator)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_prefill_tokens=8, max_model_len=12),
                      allocator, prefix_cache=cache)
    prefix = [5, 6, 7, 8]
    pages = allocator.allocate(2)
    cache.insert(prefix, pages)
    allocator.decref(pages)  # only the cache holds them: evictable
    allocator.allocate(2)  # held by someone else
    r = Request("r", prefix + [9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=1, seed=0),
                None)
    sched.add(r)  # 10 tokens: 2 cached pages + 3 more, and only 2 are free
    plan = sched.schedule()
    assert plan.kind == "idle" and sched.seqs["r"].status == Status.WAITING
    assert allocator.num_free() == 2 and len(cache) == 2


def test_drafts_dropped_before_anyone_is_preempted() -> None:
    """A decode row whose 1 + drafts slots do not fit decodes without drafts; nobody is
    preempted for optional work."""
    allocator = PageAllocator(2, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_prefill_tokens=8, max_model_len=8,
                                      num_speculative_tokens=4), allocator)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=5, seed=0), None)
    sched.add(r)
    plan = sched.schedule()  # prefill: the first page
    sched.postprocess(plan, [[next_token([1, 2, 3])]])
    allocator.allocate(1)  # someone else holds the last page
    plan = sched.schedule()
    assert plan.kind == "decode" and not plan.preempted
    assert plan.draft_limits == [0] and sched.seqs["r"].status == Status.RUNNING


def test_a_recompute_does_not_count_its_own_pages_as_cached() -> None:
    """Prompts that share nothing, a prefix cache and pools small enough to preempt: a request
    sent back finds its own pages cached at its next admission, which vLLM's
    `num_cached_tokens` (the prompt tokens its first admission found) does not count. They
    were counted."""
    preempted = 0
    for seed in range(200):
        rng = random.Random(seed)
        page_size = rng.choice([1, 2, 4])
        allocator = PageAllocator(rng.randint(3, 12), page_size)
        sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(2, 4), max_prefill_tokens=8,
                                          max_model_len=allocator.num_pages * page_size),
                          allocator, prefix_cache=PrefixCache(allocator))
        runner = PageReadingRunner(allocator, rng)
        requests = []
        for i in range(rng.randint(2, 5)):
            # Distinct first tokens: no two prompts share a page.
            prompt = [i + 1] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))]
            room = allocator.num_pages * page_size - len(prompt)
            if room < 1:
                continue
            requests.append(Request(str(i), prompt, SamplingParams(
                max_tokens=rng.randint(1, min(12, room)), seed=0), None))
            sched.add(requests[-1])
        sched.draining = True
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            plan = sched.schedule()
            sched.postprocess(plan, runner.execute(plan))
        assert not sched.has_unfinished(), seed
        for r in requests:
            assert r.num_cached_tokens == 0, (seed, r.request_id, r.num_preemptions)
            preempted += r.num_preemptions
    assert preempted > 20


def _steps_with_drafts(seed: int, spec: int) -> tuple[list[tuple], dict[str, int]]:
    """One random stream (requests added at once, pool of 2-24 pages, prefix cache or none)
    with `spec` draft slots per row, every draft wrong: each step's (kind, prefill rows, decode
    rows, preempted) and each request's preemptions."""
    rng = random.Random(seed)
    page_size, num_pages = rng.choice([1, 2, 3, 4]), rng.randint(2, 24)
    capacity = num_pages * page_size
    allocator = PageAllocator(num_pages, page_size)
    cache = PrefixCache(allocator) if rng.random() < 0.5 else None
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(1, 5),
                                      max_prefill_tokens=rng.choice([2, 4, 8]),
                                      max_model_len=capacity, num_speculative_tokens=spec),
                      allocator, prefix_cache=cache)
    runner = PageReadingRunner(allocator, random.Random(seed), p_right=0.0)
    head = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 2 * page_size + 1))]
    requests = []
    for i in range(rng.randint(2, 6)):
        prompt = ((head if rng.random() < 0.5 else [])
                  + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))])[:capacity - 1]
        requests.append(Request(str(i), prompt, SamplingParams(
            max_tokens=rng.randint(1, min(12, capacity - len(prompt))), seed=0), None))
        sched.add(requests[-1])
    sched.draining = True
    steps = []
    while sched.has_unfinished():
        plan = sched.schedule()
        names = lambda seqs: tuple(s.request.request_id for s in seqs)
        steps.append((plan.kind, names(c.seq for c in plan.prefill), names(plan.decode),
                      names(plan.preempted)))
        sched.postprocess(plan, runner.execute(plan))
        assert len(steps) < 2000, f"seed {seed}: no end"
    for r in requests:
        assert r.output_ids == alone(r.prompt_token_ids, len(r.output_ids)), (seed, r.request_id)
    return steps, {r.request_id: r.num_preemptions for r in requests}


@pytest.mark.parametrize("spec", [1, 2, 4])
def test_drafts_that_all_fail_change_no_step_and_preempt_nobody(spec: int) -> None:
    """Every draft rejected, speculation must leave each stream as it was without it: the same
    steps, rows and preemptions. An earlier row's draft slots, reserved before a later row's
    one token, took the page that row needed, and it was preempted (recomputed from scratch)."""
    differ, preempted = [], 0
    for seed in range(300):
        plain = _steps_with_drafts(seed, 0)
        drafted = _steps_with_drafts(seed, spec)
        if drafted != plain:
            differ.append(seed)
        preempted += sum(plain[1].values())
    assert not differ, f"streams that differ with {spec} draft slots: seeds {differ[:10]}"
    assert preempted > 20  # the pools are tight enough to preempt


@pytest.mark.parametrize("mixed", [False, True])
def test_a_long_prompt_is_not_starved_by_a_stream_of_small_requests(mixed: bool) -> None:
    """A long prompt that fits the pool alone, then small requests arriving as fast as they
    finish. Its chunk found no pages while newcomers kept taking what the small ones freed,
    so it never finished; admission now waits for it. Random pools, pages and chunk sizes."""
    for seed in range(150):
        rng = random.Random(seed)
        g = rng.choice([1, 2, 4])
        num_pages = rng.randint(3, 16)
        capacity = num_pages * g
        allocator = PageAllocator(num_pages, g)
        sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(2, 4),
                                          max_prefill_tokens=rng.choice([1, 2, 4, 8, 16]),
                                          max_model_len=capacity, mixed_steps=mixed),
                          allocator)
        runner = PageReadingRunner(allocator)
        big_len = rng.randint(capacity // 2, capacity - 1)
        big = Request("big", [rng.randrange(1, VOCAB) for _ in range(big_len)],
                      SamplingParams(max_tokens=1, seed=0), None)
        small_len = min(rng.randint(1, 2 * g), capacity // 2)
        small_tokens = min(rng.randint(1, 2 * g), capacity // 2)
        smalls = 0

        def add_small() -> None:
            nonlocal smalls
            smalls += 1
            sched.add(Request(f"s{smalls}", [rng.randrange(1, VOCAB) for _ in range(small_len)],
                              SamplingParams(max_tokens=small_tokens, seed=0), None))

        add_small()
        sched.add(big)
        for _ in range(500):
            if len(sched.waiting) < 2:
                add_small()
            plan = sched.schedule()
            sched.postprocess(plan, runner.execute(plan))
            if big.finished:
                break
        assert big.finished, f"seed {seed}: the long prompt starved behind {smalls} small ones"
        assert big.output_ids == alone(big.prompt_token_ids, 1), seed
