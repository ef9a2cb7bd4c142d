"""Which requests run at each engine step, and where their tokens go. Host side: plain Python,
no JAX, testable with a mock runner.

A request moves WAITING -> RUNNING -> FINISHED (and back to WAITING when preempted); it is
FINISHED exactly when its `Request` is (has a finish reason). Its KV lives in pages from the
`PageAllocator`; their `num_tokens` (read as `SeqState.num_computed`) counts the tokens whose KV
is in them, the one count: preemption releases the pages (count 0), adopting cached pages sets it
past them, a step's postprocess moves it forward, and rejected drafts' slots are truncated.

- Prefill: a running request whose tokens are not all computed gets a chunk of at most
  `max_prefill_tokens` of them. When a chunk reaches the last token, the step samples the next
  one. A preempted request comes back through prefill over prompt + output ("recompute"); it
  then samples exactly the token it would have sampled next, since each request's PRNG stream
  depends only on its seed and its token index.
- Decode: every request whose tokens are all computed but the last sampled one feeds that one.

Steps alternate by default: a prefill step (one chunk: see `Scheduler.schedule`) or a decode
step over all decode-ready requests; when both kinds of work are pending they take turns, so a
long prompt never stalls running requests for more than one step. With `mixed_steps`, a step
with both pending carries every decode row and one chunk (kind "mixed", one forward: the
weights are read once for both; `Runner._mixed`). Why alternating is the default: on this CPU
prefill is compute-bound, so fusing a 128-token chunk with a 16-row decode saved about 10% of
the pair's time (the weight read of the decode step), and each chunk bucket is one more compiled
program per page-table width.

Policies:
- continuous: re-decides the batch every step; a finished request frees its slot and pages at
  once and a waiting one takes them (iteration-level scheduling, Orca / vLLM).
- static: admits a batch only when none is running -- when `max_num_seqs` requests wait, or
  the oldest has waited `static_max_wait_s`, or the caller says no more will come (`drain`) --
  and admits nothing more until every request of the batch has finished. Its decode steps keep
  the batch's full width, finished rows included, as a padded batch does (HF `generate`).

Admission is FCFS and by free pages: a waiting request is admitted when a slot is free and its
first chunk's pages can be had. While an admitted request's chunk finds no pages, nobody is
admitted: the pages that running requests free go to it, not to newcomers, which could
otherwise take them forever (a steady stream of small requests starved a long prompt).

With a prefix cache, an admitted request first takes the cached pages of the longest page-aligned
prefix of its tokens (all but the last, which must be computed for its logits, so no write ever
lands in a shared page) and starts computing after them; it looks again before each prefill
chunk, so requests admitted together share what the first of them computes. Its full pages are
inserted into the cache as they are computed. Cached pages nobody uses are evicted, LRU, when the
pool runs short.

When pages run out during decode, the most recently admitted running request is preempted: its
pages are freed and it goes back to the front of the queue.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Sequence

from infer.cache.page_allocator import OutOfPages, PageAllocator
from infer.cache.prefix_cache import PrefixCache
from infer.engine.plan import (EmittedLogprobs, InFlight, PrefillChunk, SeqState, Status,
                               StepPlan, check_step_kinds)
from infer.engine.request import Request, RequestLimits, TokenLogprob, validate_request

POLICIES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_prefill_tokens: int = 256  # tokens of one prefill chunk
    max_model_len: int = 2048
    policy: str = "continuous"
    static_max_wait_s: float = float("inf")
    num_speculative_tokens: int = 0  # drafts a decode row may verify per step
    mixed_steps: bool = False  # a chunk and the decode rows in one step, when both are pending
    # Drafts stay in the page of the row's next position: a cache whose state a rollback
    # cannot restore once a write crossed into the next page (int4_kivi's window ring, where
    # that page's entry evicts the previous page's exact copy) verifies no further.
    drafts_within_page: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_prefill_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_step_kinds(self.mixed_steps, self.num_speculative_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator,
                 clock: Callable[[], float] = time.perf_counter,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            allocator.set_reclaimer(prefix_cache.evict)
        self.clock = clock
        # What only the scheduler knows a request must fit (the engine adds the vocabulary).
        self.limits = RequestLimits(max_model_len=config.max_model_len,
                                    pool_tokens=allocator.num_pages * allocator.page_size)
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []
        self.seqs: dict[str, SeqState] = {}
        self.draining = False  # static policy: no more requests will come
        self._batch_width = 0  # static policy: size of the running batch when admitted
        self._admissions = 0
        self._last_kind = "idle"
        # The earliest-admitted request whose prefill chunk found no pages at the last try:
        # admission waits until it gets one (see the module docstring).
        self._stalled: SeqState | None = None

    # -- requests ------------------------------------------------------------------------------

    def add(self, request: Request) -> SeqState:
        """Queues a request. One validated against limits at least as tight as the scheduler's
        (`Request.validated`, set by `Engine.make_request`) is not checked again."""
        if request.request_id in self.seqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not (request.validated is not None and request.validated.implies(self.limits)):
            try:
                validate_request(request.prompt_token_ids, request.params, self.limits)
            except ValueError as e:
                raise ValueError(f"request {request.request_id!r}: {e}") from None
        seq = SeqState(request=request, pages=self.allocator.new_sequence())
        self.seqs[request.request_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> SeqState | None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return None
        self._finish(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def seconds_until_work(self) -> float:
        """How long until a step would compute something: 0 with requests running or
        admissible now; inf with none at all. A static batch that waits to fill starts when
        its oldest request has waited `static_max_wait_s` (inf: when drained or full)."""
        if self.running or (self.waiting and self.config.policy == "continuous"):
            return 0.0
        if not self.waiting:
            return float("inf")
        if len(self.waiting) >= self.config.max_num_seqs or self.draining:
            return 0.0
        deadline = self.waiting[0].request.arrival_s + self.config.static_max_wait_s
        return max(0.0, deadline - self.clock())

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans one step; pages for its tokens are reserved (copy-on-write copies listed).

        Admission runs once, first; a request preempted here is not re-admitted before the next
        step, so the pages it gives up go to the requests admitted before it."""
        self._admit()
        preempted: list[SeqState] = []
        while True:
            want_prefill = any(s.in_prefill for s in self.running)
            want_decode = any(s.decode_ready for s in self.running)
            plan = None
            if want_prefill and want_decode and self.config.mixed_steps:
                plan = self._plan_mixed()
            elif want_prefill and (not want_decode or self._last_kind != "prefill"):
                plan = self._plan_prefill()
            # A chunk-time prefix-cache hit can complete a prompt without a chunk: look again.
            if (plan is None or plan.empty) and any(s.decode_ready for s in self.running):
                if plan is not None:
                    preempted += plan.preempted
                plan = self._plan_decode()
            if plan is not None and not plan.empty:
                self._last_kind = plan.kind
                plan.preempted[:0] = preempted
                return plan
            if plan is not None and plan.preempted:
                # Every row it planned preempted itself (a decode row admitted after a request
                # mid-prompt preempts only itself): the pages it freed may let others run now.
                # Each such pass removes a running request, so the loop ends.
                preempted += plan.preempted
                continue
            if not any(s.in_prefill for s in self.running):
                self._last_kind = "idle"
                return StepPlan(kind="idle", preempted=preempted)
            # Every running request is mid-prompt and the pages are gone: give the latest
            # admitted one's pages to the others, or nothing would ever move again. Each pass
            # removes one running request, so the loop ends.
            victim = max(self.running, key=lambda s: s.admitted_at)
            self._preempt(victim)
            preempted.append(victim)

    def _admit(self) -> None:
        # A static batch starts only when none runs and its wait is over.
        if self.config.policy == "static" and (self.running or self.seconds_until_work() > 0):
            return
        if self._stalled is not None and self._stalled.status == Status.RUNNING:
            return  # its pages come first: a newcomer would take what running requests free
        self._batch_width = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            first_chunk = min(seq.num_tokens, len(cached) * self.allocator.page_size
                              + self.config.max_prefill_tokens)
            needed = -(-first_chunk // self.allocator.page_size) - len(cached)
            # The matched pages stop being evictable once this request holds them.
            if needed > self.pages_available(pinned=cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if self.prefix_cache is not None:
                # Every token of the request, as vLLM's queries count (`queries +=
                # request.num_tokens`), though the last is never matched: it must be computed.
                self.prefix_cache.record(lookups=1, lookup_tokens=seq.num_tokens)
            self._take_cached(seq, cached)
            seq.admitted_at = self._admissions  # RUNNING from now on
            self._admissions += 1
            self.running.append(seq)
            self._batch_width += 1

    def _cached_prefix(self, seq: SeqState) -> list[int]:
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(seq.request.all_token_ids[:-1])

    def _take_cached(self, seq: SeqState, cached: list[int]) -> None:
        """Adopts cached pages beyond those the sequence holds: its computation resumes after
        them. Requests admitted together find nothing at admission; before each of their chunks
        they look again, and take what the earlier ones have computed meanwhile."""
        held = len(seq.pages.pages)
        if len(cached) <= held:
            return  # nothing new: at most the sequence's own pages, cached as it computed them
        # Take the references before anything allocates: the reclaimer could otherwise evict
        # pages just matched.
        self.allocator.incref(cached[held:])
        seq.pages.pages.extend(cached[held:])
        seq.pages.mark_computed(len(cached) * self.allocator.page_size)
        taken = (len(cached) - held) * self.allocator.page_size
        if held == 0:
            seq.cached_prefix = taken
        self.prefix_cache.record(hits=int(seq.reused_tokens == 0), hit_tokens=taken)
        seq.reused_tokens += taken
        request = seq.request
        # vLLM's count: the prompt tokens its first admission found cached. A recompute after
        # a preemption finds the request's own pages, cached as it was sent back.
        if request.num_preemptions == 0:
            request.num_cached_tokens = max(request.num_cached_tokens,
                                            min(seq.reused_tokens, len(request.prompt_token_ids)))

    def pages_available(self, pinned: Sequence[int] = ()) -> int:
        """Free pages plus cached pages an allocation could evict, `pinned` ones excluded: what
        admission can count on, and what a usage gauge should call free (vLLM's free queue
        holds cached blocks that nobody references)."""
        if self.prefix_cache is None:
            return self.allocator.num_free()
        return self.allocator.num_free() + self.prefix_cache.num_evictable(pinned)

    def _cache_pages(self, seq: SeqState) -> None:
        """Offers the sequence's computed full pages to the prefix cache."""
        if self.prefix_cache is not None and seq.num_computed >= self.allocator.page_size:
            tokens = seq.request.all_token_ids[:seq.num_computed]
            full_pages = seq.pages.pages[:seq.num_computed // self.allocator.page_size]
            self.prefix_cache.insert(tokens, full_pages)

    def _plan_prefill(self) -> StepPlan:
        """One chunk of the earliest-admitted request still in prefill (one row per prefill
        step: on a compute-bound CPU, rows of one chunk each cost the same per token, and one
        row keeps the compiled shapes few)."""
        plan = StepPlan(kind="prefill")
        self._stalled = None
        for seq in sorted((s for s in self.running if s.in_prefill), key=lambda s: s.admitted_at):
            if seq.num_computed == seq.pages.capacity:  # page-aligned, nothing reserved ahead
                self._take_cached(seq, self._cached_prefix(seq))
                if not seq.in_prefill:
                    continue  # the cache held the whole prompt: it decodes next step
            end = min(seq.num_tokens, seq.num_computed + self.config.max_prefill_tokens)
            try:
                self.allocator.reserve(seq.pages, end)
                plan.page_copies += self.allocator.prepare_write(seq.pages, seq.num_computed, end)
            except OutOfPages:
                # Decode steps will finish or preempt someone, and nobody is admitted meanwhile
                # (`_admit`); try the next request.
                if self._stalled is None:
                    self._stalled = seq
                continue
            ids = seq.request.all_token_ids[seq.num_computed:end]
            plan.prefill.append(PrefillChunk(seq=seq, start=seq.num_computed, token_ids=tuple(ids)))
            break
        return plan

    def _plan_mixed(self) -> StepPlan:
        """Every decode row and one prefill chunk in one step. Decode rows are planned first:
        a chunk that finds no pages waits, while a decode row short of pages preempts."""
        decode = self._plan_decode()
        prefill = self._plan_prefill()
        if not prefill.prefill:
            return decode
        if not decode.decode:
            prefill.preempted[:0] = decode.preempted
            return prefill
        return StepPlan(kind="mixed", prefill=prefill.prefill, decode=decode.decode,
                        page_copies=decode.page_copies + prefill.page_copies,
                        preempted=decode.preempted, draft_limits=decode.draft_limits)

    def _plan_decode(self) -> StepPlan:
        static = self.config.policy == "static"
        plan = StepPlan(kind="decode", decode_width=self._batch_width if static else 0)
        # Every row's one token first, earliest admitted first: when pages run out, the latest
        # admitted is preempted.
        ready = sorted((s for s in self.running if s.decode_ready), key=lambda s: s.admitted_at)
        for seq in ready:
            if seq.status != Status.RUNNING:
                continue  # preempted below while making room for an earlier request
            while True:
                try:
                    end = seq.num_computed + 1
                    self.allocator.reserve(seq.pages, end)
                    plan.page_copies += self.allocator.prepare_write(
                        seq.pages, seq.num_computed, end)
                    plan.decode.append(seq)
                    break
                except OutOfPages:
                    victim = max((s for s in self.running if s is not seq
                                  and s not in plan.decode), key=lambda s: s.admitted_at,
                                 default=None)
                    if victim is None or victim.admitted_at < seq.admitted_at:
                        victim = seq
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is seq:
                        break
        # Then drafts, optional work: only from pages free now. Reserved before the later rows'
        # tokens, an earlier row's drafts (mostly rejected, their pages freed again within the
        # step) took the page a later row needed, which was preempted; taken with a reclaim,
        # they would evict cached prefixes.
        for seq in plan.decode:
            drafts = self._draft_limit(seq)
            while drafts and not self._fits_free(seq, seq.num_computed + 1 + drafts):
                drafts -= 1
            if drafts:
                end = seq.num_computed + 1 + drafts
                self.allocator.reserve(seq.pages, end)
                plan.page_copies += self.allocator.prepare_write(
                    seq.pages, seq.num_computed + 1, end)
            plan.draft_limits.append(drafts)
        return plan

    def _fits_free(self, seq: SeqState, end: int) -> bool:
        """Whether `seq`'s positions up to `end` can be held and written with free pages alone:
        the pages to add, and a copy of each shared page past its first position to write (an
        overcount where a shared page lies past `end`)."""
        g = self.allocator.page_size
        shared = sum(self.allocator.refcount(p) > 1
                     for p in seq.pages.pages[(seq.num_computed + 1) // g:])
        return self.allocator.can_allocate(seq.pages.pages_needed(end) + shared)

    def next_steps(self, in_flight: InFlight | None,
                   dispatch: Callable[[StepPlan, InFlight | None], InFlight],
                   plan_ahead: bool = True) -> tuple[InFlight, InFlight | None]:
        """The step whose tokens come next, and the step left in flight behind it.

        `in_flight` is the step left by the previous call (None: plan one now); `dispatch`
        starts a plan on the device, after the step in flight it follows when planned ahead.
        With `plan_ahead`, a decode step's successor is planned and dispatched before the
        caller reads the step's tokens: postprocess the first step returned, then pass the
        second to the next call."""
        if in_flight is not None and not in_flight.live():
            in_flight = None  # every row finished or was aborted meanwhile: nothing to read
        current = in_flight or dispatch(self.schedule(), None)
        ahead = self.plan_ahead(current.plan) if plan_ahead else None
        return current, (dispatch(ahead, current) if ahead is not None else None)

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The decode step after `plan` (a decode step now in flight), planned before its tokens
        are known, so that the host plans and dispatches step n+1 while the device runs step n
        (vLLM's async scheduling). Each row feeds the token step n samples for it, straight from
        the device, one slot further on. None when the next step could differ from that: a
        request to admit (waiting with a slot free; with every slot taken none can be admitted
        before a row finishes, and a row that finishes in step n leaves step n + 1 planned
        after it, so admission waits one step) or to prefill, speculation, a request whose last
        token is in flight, or pages to find or copy. A row whose request finishes in step n (an
        eos or stop) computes once for nothing: its token is dropped and its pages, freed, are
        written before anyone reuses them, since steps run in order."""
        if (plan.kind != "decode" or not plan.decode or self.config.num_speculative_tokens
                or len(plan.decode) != len(self.running)
                or (self.waiting and self.config.policy == "continuous"
                    and len(self.running) < self.config.max_num_seqs)):
            return None
        g = self.allocator.page_size
        for seq in plan.decode:
            slot = seq.num_computed + 1  # step n writes num_computed, step n+1 the next slot
            if (seq.status != Status.RUNNING or seq.in_prefill
                    or seq.request.constraint is not None  # its mask needs the token in flight
                    or len(seq.request.output_ids) + 1 >= seq.request.params.max_tokens
                    or slot + 1 > self.config.max_model_len):
                return None
            if slot < seq.pages.capacity and self.allocator.refcount(seq.pages.pages[slot // g]) > 1:
                return None  # a shared page: its copy-on-write waits for a planned step
        for seq in plan.decode:
            try:
                # All or nothing per sequence; capacity reserved before a failure is used by the
                # next planned step.
                self.allocator.reserve(seq.pages, seq.num_computed + 2)
            except OutOfPages:
                return None
        return StepPlan(kind="decode", decode=list(plan.decode), decode_width=plan.decode_width,
                        draft_limits=[0] * len(plan.decode), ahead=True)

    def _draft_limit(self, seq: SeqState) -> int:
        """Drafts worth verifying: none past max_tokens (the step emits drafts + 1 tokens),
        past max_model_len, or (drafts_within_page) past the page of the row's next position;
        none for a row asking for logprobs or structured output, which
        hold for one position (it samples as a plain step would, beside batch-mates that
        verify drafts)."""
        if seq.request.params.plain_steps_only:
            return 0
        left = seq.request.params.max_tokens - len(seq.request.output_ids) - 1
        room = self.config.max_model_len - seq.num_computed - 1
        if self.config.drafts_within_page:
            g = self.allocator.page_size
            room = min(room, g - 1 - seq.num_computed % g)
        return max(0, min(self.config.num_speculative_tokens, left, room))

    def _preempt(self, seq: SeqState) -> None:
        """Back to the queue's front. One that held no pages (admitted, its first chunk not yet
        planned) loses nothing and is not counted as preempted: FCFS still sends it back, so
        that the requests admitted before it get the pages first."""
        if seq.pages.pages:
            seq.request.num_preemptions += 1
        self._cache_pages(seq)  # its recompute may then find them
        self.allocator.release(seq.pages)  # nothing computed: it recomputes from the start
        seq.admitted_at = -1  # WAITING
        seq.cached_prefix = seq.reused_tokens = 0  # its next admission looks up afresh
        if self._stalled is seq:
            self._stalled = None  # it waits in the queue now, at its front
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # -- after the device step -----------------------------------------------------------------

    def postprocess(self, plan: StepPlan, emitted: Iterable[Sequence[int]],
                    now: float | None = None, logprobs: EmittedLogprobs = None
                    ) -> list[SeqState]:
        """Advances the planned sequences. `emitted` holds, in plan order, the tokens each
        prefill chunk and then each decode row produced: one token, or with speculative
        decoding the accepted drafts plus the target's own token; `logprobs`, theirs where
        the step computed them. Returns the sequences that got tokens."""
        now = self.clock() if now is None else now
        emitted = list(emitted)
        row_logprobs = [[None] * len(t) for t in emitted] if logprobs is None else logprobs
        got_token = []
        for chunk, tokens, lps in zip(plan.prefill, emitted, row_logprobs):
            seq = chunk.seq
            if seq.status != Status.RUNNING:
                continue  # aborted since the plan: its pages are gone
            seq.pages.mark_computed(chunk.start + len(chunk.token_ids))
            self._cache_pages(seq)
            if chunk.completes:
                self._append(seq, tokens, now, lps)
                got_token.append(seq)
        decoded = zip(plan.decode, emitted[len(plan.prefill):], row_logprobs[len(plan.prefill):])
        for i, (seq, tokens, lps) in enumerate(decoded):
            if seq.status != Status.RUNNING:
                continue
            # The step wrote KV for the fed token and every accepted draft: one per emitted
            # token, the last emitted one (the target's own) not yet in the cache.
            filled_before = seq.num_computed // self.allocator.page_size
            seq.pages.mark_computed(seq.num_computed + len(tokens))
            if plan.draft_limits and plan.draft_limits[i]:
                # Pages of rejected drafts. (Without drafts there are none, and the pages
                # beyond may be reserved for a step in flight.)
                self.allocator.truncate(seq.pages, seq.num_computed)
            self._append(seq, tokens, now, lps)
            got_token.append(seq)
            # A page just filled: offered once the accepted drafts it holds are the request's
            # tokens (a request that finished offered its pages as it ended).
            if (seq.status == Status.RUNNING
                    and seq.num_computed // self.allocator.page_size > filled_before):
                self._cache_pages(seq)
        return got_token

    def _append(self, seq: SeqState, tokens: Sequence[int], now: float,
                logprobs: Sequence[TokenLogprob | None]) -> None:
        for token, logprob in zip(tokens, logprobs, strict=True):
            if seq.request.append(token, now, logprob):
                self._finish(seq)
                return

    def _finish(self, seq: SeqState) -> None:
        """Drops a request that finished (or aborts it): FINISHED is its request's state."""
        seq.request.abort()  # no-op when it has a finish reason already
        if seq.admitted_at >= 0:
            self.running.remove(seq)
            self._cache_pages(seq)
            seq.admitted_at = -1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.pages)
        # A long-running engine keeps no record of finished requests: their outputs went to
        # the caller with the step that finished them.
        self.seqs.pop(seq.request.request_id, None)

    def slot_utilization(self) -> float:
        """Slots whose request still produces tokens, over max_num_seqs. Under the static policy
        a finished request keeps its slot until the batch ends: that slot counts as idle."""
        return len(self.running) / self.config.max_num_seqs
