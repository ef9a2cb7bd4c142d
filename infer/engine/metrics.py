"""Serving metrics over a run: latency percentiles, throughput, slot utilization."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from infer.engine.request import RequestMetrics


def percentiles(values: Sequence[float], prefix: str) -> dict[str, float]:
    """mean, p50, p90, p99 of values under `prefix_mean`, ...; NaN when there are none."""
    v = np.asarray([x for x in values if x is not None], np.float64)
    if v.size == 0:
        return {f"{prefix}_{k}": float("nan") for k in ("mean", "p50", "p90", "p99")}
    return {f"{prefix}_mean": float(v.mean()), f"{prefix}_p50": float(np.percentile(v, 50)),
            f"{prefix}_p90": float(np.percentile(v, 90)), f"{prefix}_p99": float(np.percentile(v, 99))}


def summarize(metrics: Sequence[RequestMetrics], wall_s: float,
              records: Sequence[StepRecord] = ()) -> dict[str, float]:
    """TTFT, TPOT, inter-token and end-to-end latency (mean/p50/p90/p99, seconds), output
    tokens/s and requests/s over `wall_s`, and the slot utilization averaged over busy time."""
    out_tokens = sum(m.num_output_tokens for m in metrics)
    row: dict[str, float] = {
        "requests": len(metrics), "output_tokens": out_tokens, "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "requests_s": len(metrics) / wall_s if wall_s > 0 else float("nan"),
        "preemptions": sum(m.num_preemptions for m in metrics),
    }
    row |= percentiles([m.ttft_s for m in metrics], "ttft_s")
    row |= percentiles([m.tpot_s for m in metrics], "tpot_s")
    row |= percentiles([x for m in metrics for x in m.step_gaps], "itl_s")
    row |= percentiles([m.e2e_s for m in metrics], "e2e_s")
    if records:
        busy = [r for r in records if r.kind != "idle"]
        durations = np.asarray([r.end_s - r.start_s for r in busy])
        util = np.asarray([r.slot_utilization for r in busy])
        row["slot_utilization_mean"] = float((util * durations).sum() / durations.sum()) if busy else 0.0
        row["steps"] = len(busy)
        row |= prefill_step_split(busy)
    return row


def prefill_step_split(busy: Sequence[StepRecord]) -> dict[str, float]:
    """How much of the busy steps' time computed prompt tokens. Steps that carry a prefill
    chunk (alone or with decode rows) against steps that only decode: their number, prompt
    tokens, seconds and share of the busy time, and each kind's median step (ms; NaN where
    none ran). Every running request waits for a prompt-carrying step, so this is the part of
    continuous batching's TPOT that arriving prompts add. A prompt's last token, where its
    chunks leave it alone, runs as a decode row and is not counted here."""
    with_prefill = [r.end_s - r.start_s for r in busy if r.prefill_tokens > 0]
    decode_only = [r.end_s - r.start_s for r in busy if r.prefill_tokens == 0 and r.decode_rows > 0]
    busy_s = math.fsum(r.end_s - r.start_s for r in busy)
    prefill_s = math.fsum(with_prefill)

    def median_ms(durations: list[float]) -> float:
        return float(np.median(durations)) * 1e3 if durations else float("nan")

    return {"prefill_steps": len(with_prefill),
            "prefill_tokens_computed": sum(r.prefill_tokens for r in busy),
            "prefill_step_s": prefill_s,
            "prefill_time_share": prefill_s / busy_s if busy_s > 0 else float("nan"),
            "prefill_step_ms_p50": median_ms(with_prefill),
            "decode_step_ms_p50": median_ms(decode_only)}


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step, for slot-utilization and throughput plots."""

    index: int
    kind: str
    start_s: float
    end_s: float
    running: int  # requests holding a slot (admitted and unfinished)
    active: int  # requests that got work this step (decode rows or the prefill chunk)
    decode_rows: int
    prefill_tokens: int
    waiting: int
    free_pages: int
    slot_utilization: float  # running / max_num_seqs: a static batch's finished rows idle
    # Where the step's time went (seconds): planning it, building its device inputs on the
    # host, from dispatch until its tokens were on the host, and advancing the requests and
    # handing their outputs on. The rest (page copies, a proposer's drafts) is end - start
    # minus these.
    schedule_s: float = 0.0
    inputs_s: float = 0.0
    device_s: float = 0.0
    output_s: float = 0.0
    planned_ahead: bool = False  # dispatched before the step it follows was read back
    # Tokens the step appended to requests' outputs, and the prompt tokens of the requests
    # whose first token it brought: what vLLM's token counters add per step, so that a rate
    # over them follows generation rather than jumping when long requests finish.
    output_tokens: int = 0
    prompt_tokens_started: int = 0
    # Tokens the prefix cache's lookups in this step asked for and handed out (its stats'
    # lookup_tokens and hit_tokens): vLLM counts its prefix-cache queries and hits where the
    # scheduler looks a request up, so a request aborted while queued counts none, and a
    # preempted one counts again when it is looked up again. 0 without prefix caching.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # The latencies this step's tokens ended (seconds): arrival to first token of each request
    # it gave one, and the gap to each request's previous token (one a request, as
    # RequestMetrics.step_gaps). vLLM observes its TTFT and inter-token histograms per step,
    # as tokens come, not when a request finishes.
    first_token_s: tuple[float, ...] = ()
    token_gaps_s: tuple[float, ...] = ()


@dataclasses.dataclass
class StepTimes:
    """The runner's share of one step's time, in seconds (see StepRecord)."""

    inputs_s: float = 0.0
    device_s: float = 0.0
