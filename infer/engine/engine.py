"""The serving engine: requests in, a scheduler deciding each step, a runner executing it.

    plan = self.scheduler.schedule()
    sampled = self.runner.execute(plan)
    done = self.scheduler.postprocess(plan, sampled)

(with async scheduling the next decode step is dispatched before `sampled` is read back).

Requests may be added, stepped and aborted at any time; a per-request callback streams each
request's outputs as its tokens arrive (only its final one under `output_kind="final"`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from infer.cache import kivi
from infer.cache.page_allocator import PageAllocator
from infer.cache.paged import ATTENTION_BACKENDS, reads_in_place, window_slots
from infer.cache.prefix_cache import PrefixCache
from infer.engine.buckets import MIN_WINDOW
from infer.engine.metrics import StepRecord, StepTimes
from infer.engine.plan import InFlight, StepPlan
from infer.engine.request import Request, RequestIds, RequestOutput, validate_request
from infer.engine.runner import Runner, RunnerConfig, check_speculation_fits
from infer.engine.scheduler import POLICIES, Scheduler, SchedulerConfig
from infer.io.tokenizer import Tokenizer
from infer.model.config import LlamaConfig
from infer.model.llama import Llama, tile_weights
from infer.platform import interrupts_deferred
from infer.sampling_params import SamplingParams, is_real
from infer.spec.config import SpeculativeConfig, make_proposer
from infer.structured import GrammarCompiler
from kernels_pallas.kv_quant import resolve_kv_format
from kernels_pallas.paged_attention.api import check_backend_limits

Callback = Callable[[RequestOutput], None]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    kv_cache_dtype: str = "auto"  # auto: the weights' dtype
    page_size: int = 16
    max_num_seqs: int = 32
    max_prefill_tokens: int = 256
    max_model_len: int = 2048  # capped by the model's context
    num_pages: int | None = None  # default: every slot can hold a max_model_len sequence
    scheduler: str = "continuous"
    static_max_wait_s: float = math.inf
    attention_backend: str = "reference"
    speculative: SpeculativeConfig | None = None
    enable_prefix_caching: bool = False
    # Smallest attention window in tokens (RunnerConfig.min_window); None: max_model_len where
    # every step reads its rows' tokens in place (CPU, float32 or bfloat16 pages, one device, no
    # trees: `infer.cache.paged.reads_in_place`), so that one page-table width serves every
    # length and each step kind compiles once, else MIN_WINDOW.
    min_window: int | None = None
    # Plan and dispatch the next decode step while the device runs this one (Engine.step).
    async_scheduling: bool = True
    # A prefill chunk and the decode rows in one forward when both are pending, rather than
    # alternating steps (see infer.engine.scheduler); not with speculative decoding.
    mixed_steps: bool = False
    # A long-running engine's memory stays bounded: it keeps the latest step records and the
    # outputs of the latest finished requests only (consumers take them from step()).
    max_step_records: int = 65_536
    max_finished_outputs: int = 4_096

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_prefill_tokens", "max_model_len",
                     "max_step_records", "max_finished_outputs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_pages is not None and (isinstance(self.num_pages, bool)
                                           or not isinstance(self.num_pages, int)
                                           or self.num_pages < 1):
            raise ValueError(f"num_pages must be an int >= 1 or None (one max_model_len "
                             f"sequence per slot), got {self.num_pages!r}")
        # Every value checked here, when the config is made: LLM makes it before reading the
        # checkpoint, and the scheduler would otherwise take a bad wait silently (a negative
        # or NaN one starts at once, a string fails the first static step).
        if self.scheduler not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {self.scheduler!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")
        kv_format = self._kv_format()  # raises if unknown
        if not (is_real(self.static_max_wait_s) and self.static_max_wait_s >= 0):
            raise ValueError(f"static_max_wait_s must be a number of seconds >= 0 (inf: wait "
                             f"for a full batch), got {self.static_max_wait_s!r}")
        for name in ("enable_prefix_caching", "async_scheduling", "mixed_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if kv_format == kivi.KIVI_FORMAT:
            kivi.check_backend(self.attention_backend)
        if self.speculative is not None:
            check_speculation_fits(self.speculative.tree_shape, self.speculative.reserved_slots,
                                   kv_format, self.mixed_steps)

    def check_model(self, model_config: LlamaConfig) -> None:
        """What the model's shapes rule out of these settings (LLM asks before it reads the
        weights, an Engine when it is made): int4_kivi's page geometry over the model's head
        dim; what this host's Pallas kernels cannot lower (a GPU's Triton blocks: a page size
        or int4 group count that is not a power of two), refused here rather than when the
        first step is traced."""
        kv_format = self._kv_format()
        if kv_format == kivi.KIVI_FORMAT:
            kivi.check_geometry(model_config.head_dim, self.page_size)
        elif self.attention_backend == "pallas":
            # "auto" is the weights' float32 or bfloat16, whose limits are the same.
            check_backend_limits("auto", self.page_size, model_config.head_dim,
                                 "float32" if kv_format == "auto" else kv_format)

    def _kv_format(self) -> str:
        """The cache format's canonical name; "auto" (the weights' dtype, never a quantized
        format) as it is."""
        if self.kv_cache_dtype == "auto":
            return "auto"
        return resolve_kv_format(self.kv_cache_dtype, page_formats=True)


def check_speculation_devices(config: EngineConfig, devices: int) -> None:
    """Speculative decoding runs on one device: its proposers are not placed on a mesh, so an
    engine over `devices` > 1 (tensor parallelism) refuses it."""
    if config.speculative and devices > 1:
        raise ValueError(f"speculative decoding runs on one device: its proposers are not "
                         f"placed on a mesh (the engine spans {devices}; data parallelism "
                         f"gives each replica one)")


def check_request_id(request_id: object) -> None:
    """Request ids are strings (the engine numbers its own "0", "1", ...): an int would name no
    request, and abort(0) would stop nothing without a word."""
    if not isinstance(request_id, str):
        raise ValueError(f"request ids are strings, got {request_id!r}")


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer | None, config: EngineConfig,
                 runner: Runner | None = None, mesh: jax.sharding.Mesh | None = None) -> None:
        """`runner` reuses another engine's compiled programs and cache pool (its shapes must
        match this config; it must not serve two engines at once). `mesh`: the one the model's
        weights are placed on (`infer.parallel`), for tensor parallelism. On one CPU device the
        engine runs a copy of the model with its projections in the CPU kernel's tile layout
        where that layout applies (`infer.model.llama.tile_weights`; `self.model`)."""
        config.check_model(model.config)
        if mesh is None and runner is None:
            model = tile_weights(model)
        self.model = model
        self.model_config = model.config
        # The model may sample any id of its vocabulary, which can be padded past the
        # tokenizer's (a tokenizer not built by `infer.load` knows nothing of it): those ids
        # decode to "", as in HF, rather than fail the step that samples one.
        if tokenizer is not None and tokenizer.num_ids < model.config.vocab_size:
            tokenizer = tokenizer.for_model(model.config.vocab_size)
        self.tokenizer = tokenizer
        max_model_len = min(config.max_model_len, model.config.max_position_embeddings)
        num_pages = config.num_pages
        if num_pages is None:
            num_pages = config.max_num_seqs * -(-max_model_len // config.page_size)
        dtype = jnp.dtype(model.embed[...].dtype)  # the weights' and activations'
        kv_format = config.kv_cache_dtype
        if kv_format == "auto":
            kv_format = dtype.name
        kv_format = resolve_kv_format(kv_format, page_formats=True)  # "fp8" is e4m3
        tree = config.speculative.tree_shape if config.speculative else None
        min_window = config.min_window
        if min_window is None:
            one_width = (tree is None and (mesh is None or mesh.size == 1)
                         and reads_in_place(kv_format, config.attention_backend, dtype,
                                            model.config.head_dim))
            min_window = max_model_len if one_width else MIN_WINDOW
        self.config = dataclasses.replace(config, max_model_len=max_model_len, num_pages=num_pages,
                                          kv_cache_dtype=kv_format, min_window=min_window)
        self.allocator = PageAllocator(num_pages, config.page_size,
                                       num_windows=window_slots(kv_format, config.max_num_seqs))
        self.prefix_cache = PrefixCache(self.allocator) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
            max_model_len=max_model_len, policy=config.scheduler,
            static_max_wait_s=config.static_max_wait_s,
            num_speculative_tokens=config.speculative.reserved_slots if config.speculative else 0,
            mixed_steps=config.mixed_steps,
            drafts_within_page=kv_format == kivi.KIVI_FORMAT),
            self.allocator, prefix_cache=self.prefix_cache)
        runner_config = RunnerConfig(
            num_pages=num_pages, page_size=config.page_size, kv_format=kv_format,
            attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs,
            max_prefill_tokens=config.max_prefill_tokens, max_model_len=max_model_len,
            num_speculative_tokens=config.speculative.reserved_slots if config.speculative else 0,
            min_window=min_window, mixed_steps=config.mixed_steps, tree=tree)
        if runner is not None and runner.config != runner_config:
            raise ValueError(f"the runner was built for {runner.config}, not {runner_config}")
        proposer = None
        check_speculation_devices(config, 1 if mesh is None else mesh.size)
        if config.speculative and runner is None:
            proposer = make_proposer(config.speculative, model, runner_config)
        self.runner = runner or Runner(model, runner_config, proposer, mesh)
        # The scheduler's limits and the vocabulary: a request checked here is not checked again.
        self.limits = dataclasses.replace(self.scheduler.limits,
                                          vocab_size=model.config.vocab_size)
        self.records: collections.deque[StepRecord] = collections.deque(
            maxlen=config.max_step_records)
        self.num_steps = 0
        self._finished: collections.OrderedDict[str, RequestOutput] = collections.OrderedDict()
        self._callbacks: dict[str, Callback] = {}
        self._ids = RequestIds()
        self._in_flight: InFlight | None = None  # a step dispatched ahead (async_scheduling)
        self._grammar_compiler: GrammarCompiler | None = None

    # -- requests -------------------------------------------------------------------------------

    def make_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                     prompt_token_ids: Sequence[int] | None = None,
                     request_id: str | None = None,
                     arrival_s: float | None = None) -> Request:
        """A validated request, not yet queued (tokenized here, once). Raises ValueError,
        changing nothing, if it is bad. A request without a seed gets a fresh one."""
        params = SamplingParams() if params is None else params
        if request_id is not None:
            check_request_id(request_id)
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt is empty or not a string: {prompt!r}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = validate_request(prompt_token_ids, params, self.limits)
        constraint = None
        if params.structured is not None:
            if self.runner.mirror is not None:
                # Mirrored plans carry their requests to the other hosts, and a grammar
                # matcher's state neither pickles nor would stay in step there.
                raise ValueError("structured output is not supported across hosts "
                                 "(jax.distributed): serve it from one process")
            constraint = self._grammars().constraint(params.structured)
        if request_id is None:
            request_id = self._ids.fresh(
                lambda i: i in self.scheduler.seqs or i in self._finished)
        eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        return Request(request_id, ids, params.with_resolved_seed(), self.tokenizer, eos,
                       prompt=prompt, arrival_s=arrival_s, validated=self.limits,
                       constraint=constraint)

    def _grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer, built on first use."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the engine's tokenizer")
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def submit(self, request: Request, callback: Callback | None = None) -> str:
        """Queues a request from `make_request` (one made otherwise is validated by the
        scheduler, against its limits)."""
        self.scheduler.add(request)
        self._finished.pop(request.request_id, None)  # an id may be reused once finished
        if callback is not None:
            self._callbacks[request.request_id] = callback
        return request.request_id

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                    arrival_s: float | None = None, callback: Callback | None = None) -> str:
        """Validates and queues a request; raises ValueError (changing nothing) if it is bad."""
        request = self.make_request(prompt, params, prompt_token_ids=prompt_token_ids,
                                    request_id=request_id, arrival_s=arrival_s)
        return self.submit(request, callback)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its pages; returns its final output (None if unknown or
        already finished)."""
        check_request_id(request_id)
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        out = seq.request.output()
        self._notify(out)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def seconds_until_work(self) -> float:
        """How long a caller stepping on demand may wait before `step` computes anything
        (`Scheduler.seconds_until_work`): a server sleeps that long, not in idle steps."""
        return self.scheduler.seconds_until_work()

    def output(self, request_id: str) -> RequestOutput:
        """The output so far of a queued or running request, or the final one of a request
        among the latest `max_finished_outputs` finished."""
        seq = self.scheduler.seqs.get(request_id)
        if seq is not None:
            return seq.request.output()
        if request_id in self._finished:
            return self._finished[request_id]
        raise KeyError(f"request {request_id!r} is unknown, or finished longer ago than the "
                       f"latest {self.config.max_finished_outputs} (take outputs from step(), "
                       f"stream() or a callback)")

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's tokens: the outputs of the requests that got a token, each streamed one
        (`SamplingParams.output_kind` "cumulative") and each that finished (any kind).

        With `async_scheduling`, while a decode step runs on the device the next one is planned
        (`Scheduler.plan_ahead`) and dispatched before this step's tokens are read back, so the
        host's planning, input building and output handling overlap the device's work; that
        step's tokens are the next call's. A step planned ahead is one the engine would have
        run anyway, so the tokens are the same either way."""
        with interrupts_deferred():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.runner.times = StepTimes()
        looked_up = self._prefix_lookups()
        # The step planned ahead is kept only once this step's tokens are recorded: it feeds
        # them, so after a failure in between (a device error) it would add its tokens to rows
        # that lack the ones before them. Dropped, the next step is planned from what was
        # recorded, and rewrites what the dropped steps wrote.
        in_flight, self._in_flight = self._in_flight, None
        pending, ahead = self.scheduler.next_steps(in_flight, self._dispatch,
                                                   self.config.async_scheduling)
        plan = pending.plan
        running = len(self.scheduler.running)  # requests holding a slot during this step
        # Less the runner's time: building inputs, and the device for a step done on dispatch.
        times = self.runner.times
        scheduled = time.perf_counter() - start - times.inputs_s - times.device_s
        sampled = pending.result()
        executed = time.perf_counter()
        had = {id(seq): len(seq.request.output_ids)
               for seq in [chunk.seq for chunk in plan.prefill] + list(plan.decode)}
        advanced = self.scheduler.postprocess(plan, sampled, logprobs=pending.logprobs())
        self._in_flight = ahead
        added = [(seq, len(seq.request.output_ids) - had[id(seq)]) for seq in advanced]
        outputs = [self._notify(seq.request.output()) for seq in advanced
                   if seq.request.params.streams or seq.request.finished]
        end = time.perf_counter()
        queried, hit = (b - a for a, b in zip(looked_up, self._prefix_lookups()))
        firsts, gaps = [], []
        for seq, n in added:
            if n > 0 and had[id(seq)] == 0:
                firsts.append(seq.request.metrics().ttft_s)  # one token: cheap
            gaps += seq.request.gaps_since(had[id(seq)])
        self.records.append(StepRecord(
            index=self.num_steps, kind=plan.kind, start_s=start, end_s=end, running=running,
            active=len(plan.decode) + len(plan.prefill), decode_rows=len(plan.decode),
            prefill_tokens=sum(len(c.token_ids) for c in plan.prefill),
            waiting=len(self.scheduler.waiting), free_pages=self.allocator.num_free(),
            slot_utilization=running / self.config.max_num_seqs,
            schedule_s=scheduled, inputs_s=times.inputs_s, device_s=times.device_s,
            output_s=end - executed, planned_ahead=plan.ahead,
            output_tokens=sum(n for _, n in added),
            prompt_tokens_started=sum(len(seq.request.prompt_token_ids) for seq, n in added
                                      if n and had[id(seq)] == 0),
            prefix_queried_tokens=queried, prefix_hit_tokens=hit,
            first_token_s=tuple(firsts), token_gaps_s=tuple(gaps)))
        self.num_steps += 1
        return outputs

    def _prefix_lookups(self) -> tuple[int, int]:
        """The prefix cache's lookup and hit tokens so far (differences over a step count
        that step's lookups, whatever resets the stats between steps)."""
        if self.prefix_cache is None:
            return 0, 0
        stats = self.prefix_cache.stats()
        return int(stats["lookup_tokens"]), int(stats["hit_tokens"])

    def _dispatch(self, plan: StepPlan, after: InFlight | None) -> InFlight:
        if self.runner.proposer is not None and not self.runner.proposer.state_from_tokens:
            # A recomputed request's pages will hold other data than its draft state saw. A
            # host proposer's index stays: rebuilt, a long prompt's took seconds again.
            for seq in plan.preempted:
                self.runner.proposer.forget(seq.request.request_id)
        return self.runner.dispatch(plan, after)

    def step_records(self, since: int = 0) -> list[StepRecord]:
        """The step records with index >= `since` (`num_steps` before a run: its steps).
        Raises if the window no longer holds all of them, rather than summarize part of a run."""
        oldest = self.records[0].index if self.records else self.num_steps
        if since < oldest:
            raise ValueError(f"step records from {since} on were asked for, but only the latest "
                             f"{self.config.max_step_records} are kept (from {oldest}); raise "
                             f"EngineConfig.max_step_records")
        return [r for r in self.records if r.index >= since]

    def _notify(self, out: RequestOutput) -> RequestOutput:
        """Hands an output to its callback; a finished request's engine state is released.
        Returns the output that stands: the aborted one when the callback raised or aborted
        its request itself, so that a caller of `step` (a data-parallel front, a server) sees
        the request end."""
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._release(out)
        if callback is None:
            return out
        # The request as it runs now: a callback may end it (abort), and even start another
        # under its id, before it returns or raises.
        live = None if out.finished else self.scheduler.seqs.get(out.request_id)
        try:
            callback(out)
        except Exception:  # a consumer's bug must not take the engine, or other requests, down
            logging.exception("stream callback of request %s raised; aborting that request",
                              out.request_id)
            if live is not None and self.scheduler.seqs.get(out.request_id) is live:
                self.scheduler.abort(out.request_id)
                self._release(live.request.output())
        if live is not None and self.scheduler.seqs.get(out.request_id) is not live:
            out = live.request.output()  # it ended during the callback: its end stands
        return out

    def _release(self, final: RequestOutput) -> None:
        self._callbacks.pop(final.request_id, None)
        if self.runner.proposer is not None:
            self.runner.proposer.forget(final.request_id)
        self._finished[final.request_id] = final
        self._finished.move_to_end(final.request_id)
        while len(self._finished) > self.config.max_finished_outputs:
            self._finished.popitem(last=False)

    def run_until_done(self) -> None:
        for _ in self.stream():
            pass

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every queued request has finished, yielding outputs as tokens arrive.
        The drain lasts this call only: a request added after it waits for its static batch
        to fill again (`Scheduler.draining`), as on a fresh engine."""
        self.scheduler.draining = True
        try:
            while self.has_unfinished():
                yield from self.step()
        finally:
            self.scheduler.draining = False

    def speculative_stats(self) -> dict[str, float]:
        """Verify steps, drafts proposed and accepted, acceptance rate and tokens emitted per
        verifying row since the engine (or its runner) was made; {} without speculation."""
        if self.runner.proposer is None:
            return {}
        return self.runner.spec_stats.summary()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Hit rates by requests and tokens, prefill tokens saved, evictions ({} when off)."""
        if self.prefix_cache is None:
            return {}
        stats = dict(self.prefix_cache.stats())
        stats["prefill_tokens_saved"] = stats["hit_tokens"]
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drops every cached page that no request holds (vLLM's `reset_prefix_cache`): True
        when the cache is left empty; a running request's pages stay cached until it ends."""
        if self.prefix_cache is None:
            return True
        self.prefix_cache.evict(len(self.prefix_cache))
        return len(self.prefix_cache) == 0

    def warmup(self, progress: bool = False) -> int:
        """Compiles every shape a run can use; returns the number of programs."""
        return self.runner.warmup(progress)
