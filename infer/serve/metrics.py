"""Prometheus metrics of the server. Where infer measures what vLLM measures, the series has
vLLM's family name and labels (`model_name`, `engine`), so dashboards and `vllm bench serve`'s
parsers read it unchanged; infer's own series are under `infer:`:

  infer:compiles_total           programs compiled (or loaded from the disk cache) since start:
                                 flat after warm-up, or something recompiles while serving
  infer:step_seconds{kind}       engine step durations by kind (prefill, decode, mixed, verify)
  infer:slot_utilization         running requests / max_num_seqs after the latest step

Each server has its own registry (no process-global state)."""

from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infer.engine.engine import Engine
from infer.engine.metrics import StepRecord
from infer.engine.request import FinishReason, RequestOutput
from infer.platform import CompileCounter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def make(kind, name: str, doc: str, extra: Sequence[str] = (), **kw):
            metric = kind(name, doc, names + list(extra), registry=self.registry, **kw)
            return metric if extra else metric.labels(**labels)

        self._labels = labels
        self.running = make(Gauge, "vllm:num_requests_running", "requests holding a slot")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "requests queued for a slot")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc",
                             "fraction of KV cache pages in use (1 = full); pages only the "
                             "prefix cache holds count as free, as they are evictable")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "prompt tokens of requests "
                                  "that got their first token (counted in that step)")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "tokens generated "
                                      "(counted in the step that generated them)")
        self.success = make(Counter, "vllm:request_success", "finished requests by reason",
                            ["finished_reason"])
        self.preemptions = make(Counter, "vllm:num_preemptions", "requests preempted and "
                                "recomputed")
        self.prefix_queries = make(Counter, "vllm:prefix_cache_queries",
                                   "tokens looked up in the prefix cache (counted "
                                   "in the step that looked them up; 0 with it off)")
        self.prefix_hits = make(Counter, "vllm:prefix_cache_hits",
                                "tokens taken from the prefix cache (counted "
                                "in the step that took them)")
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         "arrival (HTTP request parsed) to first token", buckets=_LATENCY_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds",
                        "gaps between a request's tokens", buckets=_LATENCY_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        "arrival to last token", buckets=_LATENCY_BUCKETS)
        self.compiles = make(Counter, "infer:compiles", "programs compiled or loaded from the "
                             "persistent cache")
        self.compiles_after_warmup = make(Gauge, "infer:compiles_after_warmup",
                                          "programs compiled since warm-up finished")
        self.step_seconds = make(Histogram, "infer:step_seconds", "engine step durations",
                                 ["kind"], buckets=_LATENCY_BUCKETS)
        self.slot_utilization = make(Gauge, "infer:slot_utilization",
                                     "running requests / max_num_seqs after the latest step")
        self._warm = False
        self._compile_counter = CompileCounter(on_compile=self._compiled)

    # -- compilations --------------------------------------------------------------------------

    def _compiled(self) -> None:
        self.compiles.inc()
        if self._warm:
            self.compiles_after_warmup.inc()

    def __enter__(self) -> "ServerMetrics":
        self._compile_counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._compile_counter.__exit__(*exc)

    def warmed_up(self) -> None:
        self._warm = True

    # -- the engine thread's reports -------------------------------------------------------

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.success.labels(**self._labels, finished_reason=out.finish_reason.value).inc()
        self.preemptions.inc(m.num_preemptions)
        if m.e2e_s is not None and out.finish_reason != FinishReason.ABORT:
            self.e2e.observe(m.e2e_s)

    def steps(self, records: Sequence[StepRecord]) -> None:
        for r in records:
            self.step_seconds.labels(**self._labels, kind=r.kind).observe(r.end_s - r.start_s)
            self.generation_tokens.inc(r.output_tokens)
            self.prompt_tokens.inc(r.prompt_tokens_started)
            self.prefix_queries.inc(r.prefix_queried_tokens)
            self.prefix_hits.inc(r.prefix_hit_tokens)
            for latency in r.first_token_s:
                self.ttft.observe(latency)
            for gap in r.token_gaps_s:
                self.itl.observe(gap)

    def engine_state(self, replicas: Sequence[Engine]) -> None:
        running = sum(len(r.scheduler.running) for r in replicas)
        self.running.set(running)
        self.waiting.set(sum(len(r.scheduler.waiting) for r in replicas))
        pages = sum(r.allocator.num_pages for r in replicas)
        self.kv_usage.set(1 - sum(r.scheduler.pages_available() for r in replicas) / pages)
        self.slot_utilization.set(running / sum(r.config.max_num_seqs for r in replicas))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
