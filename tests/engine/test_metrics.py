"""Serving summaries from step records: the split of busy time between steps that compute
prompt tokens and steps that only decode."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.engine.metrics import StepRecord, summarize
from infer.sampling_params import SamplingParams
from tests.engines import tiny_engine


def record(index: int, start: float, duration: float, *, kind: str, decode_rows: int,
           prefill_tokens: int) -> StepRecord:
    return StepRecord(index=index, kind=kind, start_s=start, end_s=start + duration, running=4,
                      active=decode_rows + (prefill_tokens > 0), decode_rows=decode_rows,
                      prefill_tokens=prefill_tokens, waiting=0, free_pages=0,
                      slot_utilization=0.5)


@pytest.mark.parametrize("seed", range(5))
def test_the_split_counts_each_step_by_what_it_computed(seed: int) -> None:
    """Random runs of prefill-only, mixed, decode-only and idle steps, each kind's durations
    drawn from its own range: the prompt-carrying steps' count, tokens, seconds and median,
    and the decode-only median, are those drawn for them; idle steps count nowhere."""
    rng = np.random.default_rng(seed)
    drawn: dict[str, list[tuple[float, int]]] = {"prefill": [], "mixed": [], "decode": []}
    records, t = [], 0.0
    for i in range(int(rng.integers(5, 60))):
        kind = str(rng.choice(["prefill", "mixed", "decode", "idle"]))
        tokens = int(rng.integers(1, 257)) if kind in ("prefill", "mixed") else 0
        rows = int(rng.integers(1, 17)) if kind in ("mixed", "decode") else 0
        duration = float(rng.uniform(0.05, 0.2) if tokens else rng.uniform(0.01, 0.04))
        if kind != "idle":
            drawn[kind].append((duration, tokens))
        records.append(record(i, t, duration, kind=kind, decode_rows=rows, prefill_tokens=tokens))
        t += duration + float(rng.uniform(0, 0.01))
    row = summarize([], 1.0, records)

    prompt = drawn["prefill"] + drawn["mixed"]
    busy_s = math.fsum(d for kind in drawn.values() for d, _ in kind)
    assert row["prefill_steps"] == len(prompt)
    assert row["prefill_tokens_computed"] == sum(n for _, n in prompt)
    assert row["prefill_step_s"] == pytest.approx(math.fsum(d for d, _ in prompt), rel=1e-12)
    if busy_s > 0:
        assert row["prefill_time_share"] == pytest.approx(row["prefill_step_s"] / busy_s, rel=1e-12)
    for key, durations in (("prefill_step_ms_p50", [d for d, _ in prompt]),
                           ("decode_step_ms_p50", [d for d, _ in drawn["decode"]])):
        if durations:
            assert row[key] == pytest.approx(np.median(durations) * 1e3, rel=1e-12)
        else:
            assert math.isnan(row[key])


@pytest.mark.parametrize("mixed", [False, True])
def test_an_engine_run_records_every_prompt_token_once(tiny_model, mixed: bool) -> None:
    """Through the engine, prompts longer than a chunk and more requests than slots: the
    summary's prompt tokens are the prompts' tokens, each counted once, in mixed steps as in
    alternating ones. A prompt's last token, where the chunks before it leave it alone, runs
    as a decode row (the same computation) and counts there; lengths 1, 17 and 33 do that."""
    rng = np.random.default_rng(7 + mixed)
    chunk = 16
    lengths = [1, chunk + 1, 2 * chunk + 1] + [int(n) for n in rng.integers(2, 40, size=5)]
    prompts = [[int(t) for t in rng.integers(3, 200, size=n)] for n in rng.permutation(lengths)]
    engine = tiny_engine(tiny_model, mixed_steps=mixed, num_pages=128, max_prefill_tokens=chunk)
    for p in prompts:
        engine.add_request(prompt_token_ids=p, params=SamplingParams(
            max_tokens=int(rng.integers(1, 12)), ignore_eos=True))
    finished = [out for out in engine.stream() if out.finished]
    records = engine.step_records()
    row = summarize([out.metrics for out in finished], 1.0, records)

    assert row["preemptions"] == 0  # a preempted request computes its prompt again
    lone_last_tokens = sum((len(p) - 1) % chunk == 0 for p in prompts)
    assert row["prefill_tokens_computed"] == sum(map(len, prompts)) - lone_last_tokens
    assert row["prefill_steps"] == sum(r.kind in ("prefill", "mixed") for r in records)
    assert (row["prefill_steps"] > sum(r.kind == "prefill" for r in records)) == mixed
    assert 0 < row["prefill_time_share"] < 1


@pytest.mark.parametrize("case", ["plain", "preempted_async", "ngram"])
def test_step_records_count_each_output_token_and_each_started_prompt_once(
        tiny_model, case: str) -> None:
    """Summed over the step records, `output_tokens` is every token the requests got and
    `prompt_tokens_started` every prompt of a request that got a first token (a preempted and
    recomputed request's counted once; one aborted while waiting not at all); each step's
    count is what its requests' outputs grew by, several tokens a row with speculation."""
    from infer.spec.config import SpeculativeConfig

    rng = np.random.default_rng(len(case))
    overrides = {"plain": {}, "preempted_async": dict(num_pages=16, async_scheduling=True),
                 "ngram": dict(speculative=SpeculativeConfig("ngram", 3))}[case]
    engine = tiny_engine(tiny_model, max_model_len=96, **overrides)
    prompts = [[int(t) for t in rng.integers(3, 60, size=n)] for n in rng.integers(1, 30, 9)]
    prompts += [[5, 6, 7, 8] * 4]  # the n-gram proposer drafts on it
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=int(rng.integers(1, 32)), ignore_eos=True)) for p in prompts]
    never = engine.add_request(prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=5))
    engine.abort(never)  # still waiting: no first token, no prompt counted
    seen: dict[str, int] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        first = engine.num_steps
        outputs = engine.step()
        (record,) = engine.step_records(first)
        grown = 0
        for out in outputs:
            grown += len(out.token_ids) - seen.get(out.request_id, 0)
            seen[out.request_id] = len(out.token_ids)
        assert record.output_tokens == grown, record
    finished = [engine.output(i) for i in ids]
    records = engine.step_records()
    assert sum(r.output_tokens for r in records) == sum(len(o.token_ids) for o in finished)
    assert sum(r.prompt_tokens_started for r in records) == sum(map(len, prompts))
    if case == "preempted_async":
        assert sum(o.metrics.num_preemptions for o in finished) > 0
    if case == "ngram":
        assert max(r.output_tokens - r.decode_rows - bool(r.prefill_tokens)
                   for r in records) > 0  # a step brought a row more than one token
