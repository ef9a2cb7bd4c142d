"""The serving engine: requests in, a scheduler deciding each step, a runner executing it.

    plan = self.scheduler.schedule()
    sampled = self.runner.execute(plan)
    done = self.scheduler.postprocess(plan, sampled)

Requests may be added, stepped and aborted at any time; a per-request callback streams each
request's outputs as its tokens arrive.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Callable, Iterator, Sequence

import jax.numpy as jnp

from infer.draft import load_draft, self_draft
from infer.drafters import DraftModelProposer, EagleProposer
from infer.eagle import load_eagle
from infer.model import Llama
from infer.page_allocator import PageAllocator
from infer.prefix_cache import PrefixCache
from infer.proposers import NgramProposer, Proposer
from infer.request import Request, RequestOutput
from infer.runner import Runner, RunnerConfig
from infer.sampling import SamplingParams
from infer.scheduler import Scheduler, SchedulerConfig, StepRecord
from infer.tokenizer import Tokenizer

Callback = Callable[[RequestOutput], None]


WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")
SPECULATIVE_METHODS = ("ngram", "draft", "self_draft", "eagle")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={"method": "eagle", "num_tokens": 4})`.

    Methods: `ngram` (prompt lookup over the request's own tokens), `draft` (a small Llama
    distilled from the target, `experiments.train_draft`), `self_draft` (the target's first
    `self_draft_layers` layers with its norm and head, untrained), `eagle` (an EAGLE head over
    the target's features, `experiments.train_eagle`)."""

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    draft_path: str = os.path.join(WEIGHTS_DIR, "draft_smollm2.safetensors")
    eagle_path: str = os.path.join(WEIGHTS_DIR, "eagle_smollm2.safetensors")
    self_draft_layers: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: "
                             f"{SPECULATIVE_METHODS}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens must be in [1, 16], got {self.num_tokens}")
        path = {"draft": self.draft_path, "eagle": self.eagle_path}.get(self.method)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"speculative method {self.method!r} needs its weights at "
                                    f"{path!r}; train them with experiments.train_"
                                    f"{self.method} or pass {self.method}_path")


def make_proposer(config: SpeculativeConfig, model: Llama, runner_config: RunnerConfig
                  ) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if config.method == "draft":
        return DraftModelProposer(load_draft(model, config.draft_path), runner_config)
    if config.method == "self_draft":
        return DraftModelProposer(self_draft(model, config.self_draft_layers), runner_config)
    if config.method == "eagle":
        return EagleProposer(load_eagle(model.config, config.eagle_path), model, runner_config)
    raise ValueError(f"no proposer for {config.method!r}")


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


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer | None, config: EngineConfig,
                 runner: Runner | None = None) -> None:
        """`runner` reuses another engine's compiled programs and cache pool (its shapes must
        match this config; it must not serve two engines at once)."""
        self.model_config = model.config
        self.tokenizer = tokenizer
        max_model_len = min(config.max_model_len, model.config.max_position_embeddings)
        num_pages = config.num_pages or config.max_num_seqs * -(-max_model_len // config.page_size)
        kv_format = config.kv_cache_dtype
        if kv_format == "auto":
            kv_format = jnp.dtype(model.embed[...].dtype).name
        self.config = dataclasses.replace(config, max_model_len=max_model_len, num_pages=num_pages,
                                          kv_cache_dtype=kv_format)
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.prefix_cache = PrefixCache(self.allocator) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
            max_model_len=max_model_len, policy=config.scheduler,
            static_max_wait_s=config.static_max_wait_s,
            num_speculative_tokens=config.speculative.num_tokens if config.speculative else 0),
            self.allocator, prefix_cache=self.prefix_cache)
        runner_config = RunnerConfig(
            num_pages=num_pages, page_size=config.page_size, kv_format=kv_format,
            attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs,
            max_prefill_tokens=config.max_prefill_tokens, max_model_len=max_model_len,
            num_speculative_tokens=config.speculative.num_tokens if config.speculative else 0)
        if runner is not None and runner.config != runner_config:
            raise ValueError(f"the runner was built for {runner.config}, not {runner_config}")
        proposer = None
        if config.speculative and runner is None:
            proposer = make_proposer(config.speculative, model, runner_config)
        self.runner = runner or Runner(model, runner_config, proposer)
        self.records: list[StepRecord] = []
        self._callbacks: dict[str, Callback] = {}
        self._next_id = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                    arrival_s: float | None = None, callback: Callback | None = None) -> str:
        """Validates and queues a request; raises ValueError (changing nothing) if it is bad."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt is empty or not a string: {prompt!r}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        request = Request(request_id, ids, params, self.tokenizer, eos, prompt=prompt,
                          arrival_s=arrival_s)
        self.scheduler.add(request)  # raises on over-long prompts, before anything changed
        if callback is not None:
            self._callbacks[request_id] = callback
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its pages; returns its final output (None if unknown or
        already finished)."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        out = seq.request.output()
        self._notify(out)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, request_id: str) -> RequestOutput:
        return self.scheduler.seqs[request_id].request.output()

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one device step; returns the outputs of the requests that
        got a token (finished ones included)."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        running = len(self.scheduler.running)  # requests holding a slot during this step
        sampled = self.runner.execute(plan)
        advanced = self.scheduler.postprocess(plan, sampled)
        end = time.perf_counter()
        self.records.append(StepRecord(
            index=len(self.records), kind=plan.kind, start_s=start, end_s=end, running=running,
            active=len(plan.decode) + len(plan.prefill), decode_rows=len(plan.decode),
            prefill_tokens=sum(len(c.token_ids) for c in plan.prefill),
            waiting=len(self.scheduler.waiting), free_pages=self.allocator.num_free(),
            slot_utilization=running / self.config.max_num_seqs))
        outputs = [seq.request.output() for seq in advanced]
        for out in outputs:
            self._notify(out)
            if out.finished and self.runner.proposer is not None:
                self.runner.proposer.forget(out.request_id)
        return outputs

    def _notify(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if callback is None:
            return
        try:
            callback(out)
        except Exception:  # a consumer's bug must not take the engine, or other requests, down
            logging.exception("stream callback of request %s raised; aborting that request",
                              out.request_id)
            self._callbacks.pop(out.request_id, None)
            self.scheduler.abort(out.request_id)

    def run_until_done(self) -> None:
        self.scheduler.draining = True
        while self.has_unfinished():
            self.step()

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every queued request has finished, yielding outputs as tokens arrive."""
        self.scheduler.draining = True
        while self.has_unfinished():
            yield from self.step()

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

    def warmup(self, progress: bool = False) -> int:
        """Compiles every shape a run can use; returns the number of programs."""
        return self.runner.warmup(progress)
