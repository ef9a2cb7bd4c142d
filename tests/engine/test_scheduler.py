"""The scheduler against a hand-computable mock runner (no JAX): the mock "model" reads every
token back through the page tables, so a page mix-up, a lost page or a wrong recompute changes
the output, which must equal the reference continuation of the true sequence."""

from __future__ import annotations

import random

import pytest

from infer.cache.page_allocator import PageAllocator
from infer.engine.plan import SeqState, StepPlan
from infer.engine.request import FinishReason, Request
from infer.engine.scheduler import Scheduler, SchedulerConfig
from infer.sampling_params import SamplingParams
from tests.mock_runner import EOS, VOCAB
from tests.mock_runner import PageReadingRunner as MockRunner
from tests.mock_runner import alone as reference


def tracked(sched: Scheduler) -> Scheduler:
    """Keeps every added request's state in `sched.history`: the scheduler itself forgets a
    request when it finishes."""
    sched.history = {}
    add = sched.add

    def add_and_keep(request: Request) -> SeqState:
        seq = sched.history[request.request_id] = add(request)
        return seq

    sched.add = add_and_keep
    return sched


def make(num_pages: int = 64, page_size: int = 4, **config) -> tuple[Scheduler, MockRunner]:
    allocator = PageAllocator(num_pages, page_size)
    clock = iter(range(10**9))
    sched = Scheduler(SchedulerConfig(**config), allocator, clock=lambda: float(next(clock)))
    return tracked(sched), MockRunner(allocator)


def request(rid: str, prompt_len: int, max_tokens: int, seed: int = 0, **params) -> Request:
    rng = random.Random(f"{rid}/{seed}")
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), None,
                   eos_ids=(EOS,), arrival_s=0.0)


def run(sched: Scheduler, runner: MockRunner, max_steps: int = 100_000) -> list[StepPlan]:
    plans = []
    sched.draining = True
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.postprocess(plan, runner.execute(plan))
        plans.append(plan)
        assert len(plans) < max_steps, "no progress"
    return plans


def check_outputs(sched: Scheduler) -> None:
    assert not sched.seqs, "finished requests must be forgotten"
    for seq in sched.history.values():
        r = seq.request
        if r.finish_reason == FinishReason.ABORT:
            continue
        assert r.output_ids == reference(r.prompt_token_ids, len(r.output_ids)), r.request_id
        assert len(r.output_ids) == r.params.max_tokens


def test_continuous_outputs_equal_reference_and_pages_return() -> None:
    sched, runner = make(max_num_seqs=4, max_prefill_tokens=8)
    for i in range(10):
        sched.add(request(str(i), prompt_len=3 + 5 * i, max_tokens=2 + 3 * (i % 4)))
    plans = run(sched, runner)
    check_outputs(sched)
    assert sched.allocator.num_free() == sched.allocator.num_pages
    sched.allocator.check_invariants()
    # chunked prefill: no chunk above the budget, and a 48-token prompt needed several
    assert max(len(c.token_ids) for p in plans for c in p.prefill) <= 8
    assert sum(c.seq.request.request_id == "9" for p in plans for c in p.prefill) >= 6


def test_prefill_and_decode_alternate_when_both_pending() -> None:
    sched, runner = make(max_num_seqs=4, max_prefill_tokens=4)
    sched.add(request("short", 2, 30))
    sched.add(request("long", 40, 5))
    plans = run(sched, runner)
    kinds = [p.kind for p in plans]
    for a, b in zip(kinds, kinds[1:]):
        if a == b == "prefill":
            pytest.fail(f"two prefill steps in a row while a request was decoding: {kinds}")
    check_outputs(sched)


def test_preemption_recomputes_and_keeps_outputs() -> None:
    """A pool too small for everyone: requests are preempted and recomputed, outputs unchanged."""
    sched, runner = make(num_pages=12, page_size=4, max_num_seqs=6, max_prefill_tokens=16)
    for i in range(6):
        sched.add(request(str(i), prompt_len=6, max_tokens=20))
    run(sched, runner)
    assert sum(s.request.num_preemptions for s in sched.history.values()) > 0
    check_outputs(sched)
    assert sched.allocator.num_free() == 12


def test_stop_token_and_max_tokens() -> None:
    sched, runner = make()
    prompt = request("a", 5, 50).prompt_token_ids
    ref = reference(prompt, 50)
    stop_at = next(i for i in range(3, 50) if ref[i] not in ref[:i])  # its first occurrence
    r = Request("a", prompt, SamplingParams(max_tokens=50, stop_token_ids=(ref[stop_at],)), None)
    sched.add(r)
    run(sched, runner)
    assert r.output_ids == ref[:stop_at + 1] and r.finish_reason == FinishReason.STOP


def test_static_batches_wait_and_hold_their_slots() -> None:
    sched, runner = make(max_num_seqs=3, policy="static", max_prefill_tokens=16)
    for i, n in enumerate([2, 10, 3, 4]):
        sched.add(request(str(i), 4, n))
    plan = sched.schedule()  # 4 waiting >= 3: the first batch is admitted
    assert [s.request.request_id for s in sched.running] == ["0", "1", "2"]
    utilizations, running_ids = [], []
    sched.postprocess(plan, runner.execute(plan))
    while sched.running:
        plan = sched.schedule()
        running_ids.append({s.request.request_id for s in sched.running})
        utilizations.append(sched.slot_utilization())
        sched.postprocess(plan, runner.execute(plan))
    # request 3 never joined the first batch, and slots emptied as members finished
    assert all("3" not in ids for ids in running_ids)
    assert utilizations[0] == 1.0 and utilizations[-1] == pytest.approx(1 / 3)
    run(sched, runner)
    check_outputs(sched)


def test_seconds_until_work_follow_the_static_deadline() -> None:
    now = [0.0]
    allocator = PageAllocator(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, policy="static", static_max_wait_s=10.0),
                      allocator, clock=lambda: now[0])
    assert sched.seconds_until_work() == float("inf")
    sched.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=2), None, arrival_s=1.0))
    now[0] = 4.0
    assert sched.seconds_until_work() == 7.0  # arrived at 1, waits until 11
    assert sched.schedule().kind == "idle"
    now[0] = 11.5
    assert sched.seconds_until_work() == 0.0 and sched.schedule().kind == "prefill"
    sched.add(Request("b", [4, 5], SamplingParams(max_tokens=1), None, arrival_s=11.5))
    assert sched.seconds_until_work() == 0.0  # a running batch steps
    for policy, draining, want in (("static", True, 0.0), ("continuous", False, 0.0)):
        other = Scheduler(SchedulerConfig(max_num_seqs=2, policy=policy), PageAllocator(16, 4),
                          clock=lambda: now[0])
        other.draining = draining
        other.add(Request("c", [1], SamplingParams(max_tokens=1), None, arrival_s=0.0))
        assert other.seconds_until_work() == want


def test_static_does_not_start_a_partial_batch_until_drained() -> None:
    sched, runner = make(max_num_seqs=4, policy="static")
    sched.add(request("a", 3, 3))
    assert sched.schedule().kind == "idle" and not sched.running
    sched.draining = True
    assert sched.schedule().kind != "idle"


def test_abort_frees_pages_and_others_continue() -> None:
    sched, runner = make(max_num_seqs=4)
    for i in range(3):
        sched.add(request(str(i), 10, 30))
    for _ in range(8):
        plan = sched.schedule()
        sched.postprocess(plan, runner.execute(plan))
    used_before = sched.allocator.num_used()
    held = len(sched.seqs["1"].pages.pages)
    assert held > 0
    sched.abort("1")
    assert sched.allocator.num_used() == used_before - held
    assert sched.history["1"].request.finish_reason == FinishReason.ABORT
    assert "1" not in sched.seqs
    run(sched, runner)
    check_outputs(sched)
    assert sched.allocator.num_free() == sched.allocator.num_pages


def test_over_long_request_rejected_without_side_effects() -> None:
    sched, _ = make(max_model_len=32)
    sched.add(request("ok", 10, 5))
    with pytest.raises(ValueError, match="exceed max_model_len=32"):
        sched.add(request("big", 30, 5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(request("ok", 3, 3))
    assert [s.request.request_id for s in sched.waiting] == ["ok"]


def test_thousand_requests_with_aborts_return_every_page() -> None:
    rng = random.Random(0)
    sched, runner = make(num_pages=40, page_size=4, max_num_seqs=8, max_prefill_tokens=8)
    ids = []
    for i in range(1000):
        sched.add(request(str(i), rng.randrange(1, 20), rng.randrange(1, 12)))
        ids.append(str(i))
        if rng.random() < 0.5:
            plan = sched.schedule()
            sched.postprocess(plan, runner.execute(plan))
        if rng.random() < 0.2:
            sched.abort(rng.choice(ids))
    run(sched, runner)
    check_outputs(sched)
    assert sched.allocator.num_free() == 40
    sched.allocator.check_invariants()
    assert sum(s.request.finish_reason == FinishReason.ABORT for s in sched.history.values()) > 50


def test_prefix_cache_reuses_pages_and_keeps_outputs() -> None:
    """Requests sharing prefixes (system prompts, earlier turns) take cached pages, compute
    less, and produce the reference outputs; the mock reads every token back through the
    pages, so a wrong shared page would change them. Evicting everything returns every page."""
    from infer.cache.prefix_cache import PrefixCache
    allocator = PageAllocator(48, 4)
    cache = PrefixCache(allocator)
    clock = iter(range(10**9))
    sched = tracked(Scheduler(SchedulerConfig(max_num_seqs=3, max_prefill_tokens=8), allocator,
                              clock=lambda: float(next(clock)), prefix_cache=cache))
    runner = MockRunner(allocator)
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(21)]
    computed = 0
    for i in range(8):
        user = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))]
        sched.add(Request(f"r{i}", system + user, SamplingParams(max_tokens=6), None, (EOS,)))
        plans = run(sched, runner)
        computed += sum(len(c.token_ids) for p in plans for c in p.prefill)
    # a second turn extends the first request's whole conversation
    first = sched.history["r0"].request
    turn2 = first.prompt_token_ids + first.output_ids + [3, 4, 5]
    sched.add(Request("turn2", turn2, SamplingParams(max_tokens=6), None, (EOS,)))
    run(sched, runner)
    check_outputs(sched)
    assert sched.history["turn2"].request.num_cached_tokens >= 24  # 21 + 6 tokens -> 6 full pages
    assert all(sched.history[f"r{i}"].request.num_cached_tokens == 20 for i in range(1, 8))
    # One lookup per request; its own pages, found again before each chunk, are no hit.
    stats = cache.stats()
    assert (stats["lookups"], stats["hits"]) == (9, 8)
    assert stats["hit_tokens"] == 7 * 20 + sched.history["turn2"].request.num_cached_tokens
    cache.check_invariants()
    allocator.check_invariants()
    cache.evict(allocator.num_pages)
    assert allocator.num_free() == allocator.num_pages


def test_prefix_cache_under_memory_pressure() -> None:
    """A pool barely big enough: cached pages are evicted to admit work, requests are
    preempted, outputs stay exact and no page leaks."""
    from infer.cache.prefix_cache import PrefixCache
    allocator = PageAllocator(14, 4)
    cache = PrefixCache(allocator)
    sched = tracked(Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens=8), allocator,
                              prefix_cache=cache))
    runner = MockRunner(allocator)
    rng = random.Random(6)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    for i in range(30):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 10))]
        sched.add(Request(str(i), (shared if i % 2 else []) + tail,
                          SamplingParams(max_tokens=rng.randrange(1, 12)), None, (EOS,)))
    run(sched, runner)
    check_outputs(sched)
    assert cache.stats()["evicted_pages"] > 0
    cache.evict(allocator.num_pages)
    assert allocator.num_free() == 14
    allocator.check_invariants()


def test_a_decode_row_that_preempts_itself_leaves_its_pages_to_a_prompt() -> None:
    """A request decoding, admitted after one still mid-prompt, runs out of pages: it can
    preempt only itself. The step goes on with the prompt's chunk in the pages it freed, never
    as a decode step with no rows."""
    sched, runner = make(num_pages=4, page_size=4, max_num_seqs=2, max_prefill_tokens=4,
                         max_model_len=16)
    sched.add(request("a", 14, 2))  # 16 slots: the whole pool
    sched.add(request("b", 1, 10))  # a 1-token prompt decodes from its first step
    plans = run(sched, runner)
    check_outputs(sched)
    assert all(p.prefill or p.decode for p in plans)
    assert sched.history["b"].request.num_preemptions >= 1


def test_a_prompt_found_cached_before_its_chunk_decodes_without_preemption() -> None:
    """Two requests with one prompt, admitted together: the second finds the first's pages
    before its chunk, which leaves it nothing to prefill; it decodes next, preempting nobody."""
    from infer.cache.prefix_cache import PrefixCache
    allocator = PageAllocator(64, 4)
    cache = PrefixCache(allocator)
    sched = tracked(Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens=16),
                              allocator, prefix_cache=cache))
    runner = MockRunner(allocator)
    a = request("a", 9, 1)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=4), None, (EOS,))
    sched.add(a)
    sched.add(b)
    plans = run(sched, runner)
    check_outputs(sched)
    assert [p.kind for p in plans] == ["prefill"] + ["decode"] * 4
    assert b.num_preemptions == 0 and b.num_cached_tokens == 8


def test_a_full_batch_plans_ahead_while_requests_wait_for_a_slot() -> None:
    """Continuous batching with every slot taken and requests queued: no request can be admitted
    before one finishes, so decode steps are still planned ahead (async scheduling). With a slot
    free while a request waits (its pages short, in a small pool), nothing is planned ahead, so
    it is admitted as soon as pages free up. Outputs stay exact and every page returns."""
    rng = random.Random()
    ahead_while_waiting = 0
    for _ in range(40):
        slots = rng.randint(1, 4)
        sched, runner = make(num_pages=rng.randint(10, 40), max_num_seqs=slots,
                             max_prefill_tokens=8)
        for i in range(slots + rng.randint(1, 4)):
            sched.add(request(str(i), rng.randint(1, 12), rng.randint(4, 24), seed=rng.random()))
        sched.draining = True
        in_flight = None
        while sched.has_unfinished():
            step, in_flight = sched.next_steps(in_flight, runner.dispatch, plan_ahead=True)
            # The queue and the slots as the step ahead was planned (before `step`'s tokens).
            if in_flight is not None and sched.waiting:
                assert len(sched.running) == slots, "planned ahead past an admission"
                ahead_while_waiting += 1
            sched.postprocess(step.plan, step.result())
        check_outputs(sched)
        assert sched.allocator.num_free() == sched.allocator.num_pages
    assert ahead_while_waiting > 0
