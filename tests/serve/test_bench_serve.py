"""experiments.bench_serve: vLLM's arrival process and random dataset, its metric definitions,
and a run against the server whose counts agree with what the server says it served."""

from __future__ import annotations

import asyncio
import json
import math
import time
import types

import numpy as np
import pytest

pytest.importorskip("aiohttp")
from experiments import bench_serve  # noqa: E402
from experiments.bench_serve import Measured, Scheduled  # noqa: E402
from infer.engine.request import RequestMetrics  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_arrivals_end_at_n_over_rate_with_gamma_gaps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, rate, burst = int(rng.integers(50, 400)), float(rng.uniform(0.5, 20)), float(
        rng.choice([0.5, 1.0, 3.0]))
    t = bench_serve.arrival_offsets(n, rate, burst, seed)
    assert t.shape == (n,) and np.all(np.diff(t) >= 0) and t[0] > 0
    assert math.isclose(t[-1], n / rate, rel_tol=1e-12)
    gaps = np.diff(np.concatenate([[0.0], t]))
    cv = gaps.std() / gaps.mean()  # a gamma of shape b has a coefficient of variation 1/sqrt(b)
    assert abs(cv - 1 / math.sqrt(burst)) < 0.35 / math.sqrt(burst), (cv, burst)
    assert np.array_equal(t, bench_serve.arrival_offsets(n, rate, burst, seed))
    assert not np.array_equal(t, bench_serve.arrival_offsets(n, rate, burst, seed + 1))
    assert not bench_serve.arrival_offsets(n, math.inf, burst, seed).any()


def test_random_dataset_lengths_follow_the_range(smollm2) -> None:
    tokenizer = smollm2[2]
    data = bench_serve.random_dataset(tokenizer, 40, 48, 20, 0.25, seed=3)
    assert len({p for p, _, _ in data}) == 40  # different offsets, different prompts
    for prompt, prompt_len, output_len in data:
        assert len(tokenizer.encode(prompt)) == prompt_len
        assert 36 - 2 <= prompt_len <= 60 + 2  # a decode/encode round trip may merge a token
        assert 15 <= output_len <= 25
    assert data == bench_serve.random_dataset(tokenizer, 40, 48, 20, 0.25, seed=3)


def test_summary_uses_vllms_definitions() -> None:
    a = Measured(ok=True, ttft_s=0.5, latency_s=2.5, itl_s=[0.5, 0.5, 1.0], output_tokens=5,
                 prompt_tokens=10, start_s=0.0)
    b = Measured(ok=True, ttft_s=2.0, latency_s=2.0, itl_s=[], output_tokens=1, prompt_tokens=7,
                 start_s=1.0)
    c = Measured(ok=False, error="HTTP 500")
    row = bench_serve.summarize([a, b, c], duration_s=4.0, percentiles=[50, 99],
                                goodput_ms={"ttft": 1000, "tpot": 600})
    assert row["completed"] == 2 and row["failed"] == 1 and row["errors"] == ["", "", "HTTP 500"]
    assert row["request_throughput"] == 0.5 and row["output_throughput"] == 6 / 4
    assert row["total_token_throughput"] == 23 / 4
    assert row["mean_tpot_ms"] == pytest.approx(500.0)  # (2.5 - 0.5) / (5 - 1); b has one token
    assert row["median_ttft_ms"] == pytest.approx(1250.0)
    assert row["mean_itl_ms"] == pytest.approx(2000 / 3)  # pooled gaps
    assert row["p99_e2el_ms"] == pytest.approx(np.percentile([2500, 2000], 99))
    assert row["request_goodput"] == 0.25  # b misses the TTFT SLO


def test_per_request_arrays_line_up_when_a_request_fails() -> None:
    """Index i of every per-request array is request i (vLLM's layout): a failed request in the
    middle holds its place with ttft and latency 0, and the statistics leave it out."""
    a = Measured(ok=True, ttft_s=0.5, latency_s=2.5, itl_s=[0.5, 0.5, 1.0], output_tokens=5,
                 prompt_tokens=10, start_s=0.0)
    c = Measured(ok=False, ttft_s=0.25, itl_s=[0.1], start_s=0.5, error="HTTP 500")
    b = Measured(ok=True, ttft_s=2.0, latency_s=3.0, itl_s=[1.0], output_tokens=2,
                 prompt_tokens=7, start_s=1.0)
    row = bench_serve.summarize([a, c, b], duration_s=4.0, percentiles=[50], goodput_ms={})
    arrays = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")
    assert {k: len(row[k]) for k in arrays} == dict.fromkeys(arrays, 3)
    assert row["ttfts"] == [0.5, 0.0, 2.0] and row["latencies"] == [2.5, 0.0, 3.0]
    assert row["start_times"] == [0.0, 0.5, 1.0] and row["errors"] == ["", "HTTP 500", ""]
    assert row["median_ttft_ms"] == pytest.approx(1250.0)  # a and b only
    assert row["mean_e2el_ms"] == pytest.approx(2750.0)
    assert row["mean_itl_ms"] == pytest.approx(3000 / 4)


def _replayed(tmp_path, saved: dict) -> str:
    path = tmp_path / "saved.jsonl"
    path.write_text(json.dumps(saved) + "\n" + json.dumps({"schedule": []}) + "\n")
    return str(path)


def test_a_replayed_row_describes_the_schedule_it_sent(tmp_path, monkeypatch) -> None:
    """Under --replay the workload fields are the saved row's, whatever the flags say, and the
    row names where its schedule came from; a model other than the schedule's is refused."""
    workload = dict(model="smollm2-4l", request_rate=16.0, burstiness=0.5, random_input_len=128,
                    random_output_len=64, random_range_ratio=0.25, seed=7)
    schedule = [dict(offset_s=0.0625 * (i + 1), prompt="x" * 10, prompt_len=128, output_len=64)
                for i in range(4)]
    path = _replayed(tmp_path, {"server": "infer", **workload, "schedule": schedule,
                                "environment": {"time": "2026-01-01T00:00:00+00:00"}})

    async def served(url, model, items, max_concurrency=None, progress=True):
        return [Measured(ok=True, ttft_s=0.1, latency_s=0.5, itl_s=[0.1] * 3, output_tokens=4,
                         prompt_tokens=128, start_s=0.0) for _ in items], 1.0

    monkeypatch.setattr(bench_serve, "run_schedule", served)
    monkeypatch.setattr(bench_serve, "environment", dict)
    row, = bench_serve.run(["url=http://127.0.0.1:1"], model="smollm2-4l", request_rate=4.0,
                           burstiness=1.0, random_input_len=32, random_output_len=8,
                           random_range_ratio=0.0, seed=0, replay=path, out="")
    assert {k: row[k] for k in workload} == workload
    assert row["num_prompts"] == 4 and row["schedule"] == schedule
    assert row["replayed_from"] == {"path": path, "server": "infer",
                                    "time": "2026-01-01T00:00:00+00:00"}
    with pytest.raises(ValueError, match="smollm2-4l"):
        bench_serve.run(["url=http://127.0.0.1:1"], model="smollm2-135m", replay=path, out="")


class _Engine:
    """An engine's loop surface (experiments.serve.serve_infer, with and without a cap): every
    unfinished request gets a token each step and finishes after `steps` of them."""

    def __init__(self, steps: int = 3) -> None:
        self.steps, self.num_steps, self.records = steps, 0, []
        self.scheduler = types.SimpleNamespace(draining=False)
        self.running: dict[str, tuple[float, list[float], int]] = {}
        self.arrivals: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.most_unfinished = 0

    def warmup(self, progress: bool = False) -> None:
        pass

    def add_request(self, *, prompt_token_ids, params, arrival_s):
        rid = str(len(self.arrivals))
        self.arrivals[rid] = arrival_s
        self.running[rid] = (arrival_s, [], len(prompt_token_ids))
        self.most_unfinished = max(self.most_unfinished, len(self.running))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        time.sleep(0.002)
        self.num_steps += 1
        self.records.append(types.SimpleNamespace(kind="decode"))
        outs = []
        for rid, (arrival, times, n) in list(self.running.items()):
            times.append(time.perf_counter())
            if len(times) == self.steps:
                del self.running[rid]
                self.finished_at[rid] = times[-1]
                outs.append(types.SimpleNamespace(
                    request_id=rid, finished=True,
                    metrics=RequestMetrics.from_token_times(arrival, times, n)))
        return outs

    def step_records(self, since: int = 0) -> list:
        return []


def test_inprocess_holds_requests_back_under_max_concurrency(tmp_path, monkeypatch) -> None:
    """--max_concurrency caps the in-process engine's unfinished requests as it caps the HTTP
    client's, and a held request's clock starts when it is released."""
    import infer
    engine = _Engine()
    monkeypatch.setattr(infer, "LLM", lambda **_: types.SimpleNamespace(
        engine=engine, tokenizer=types.SimpleNamespace(encode=lambda text: [1] * len(text))))
    monkeypatch.setattr(bench_serve, "environment", dict)
    schedule = [dict(offset_s=0.0, prompt="x" * (i + 1), prompt_len=i + 1, output_len=3)
                for i in range(5)]
    path = _replayed(tmp_path, {"model": "stub", "schedule": schedule})
    row, = bench_serve.run(["inprocess"], model="stub", replay=path, max_concurrency=2, out="")
    assert engine.most_unfinished == 2 and row["completed"] == 5 and row["max_concurrency"] == 2
    timed = list(engine.arrivals.values())[1:]  # after the untimed first request
    finished = [engine.finished_at[rid] for rid in engine.arrivals][1:]
    # The row's clocks are the engine's arrivals, i.e. the releases: each held request is
    # released only once an earlier one has finished, not at the common scheduled arrival.
    assert row["start_times"] == timed and timed == sorted(timed)
    assert timed[2] >= min(finished[:2]) and timed[4] >= sorted(finished[:4])[2]
    assert row["input_lens"] == [i + 1 for i in range(5)]
    for ttft, latency, start, end in zip(row["ttfts"], row["latencies"], timed, finished):
        assert 0 < ttft < latency == pytest.approx(end - start)


def test_a_run_against_the_server_counts_what_it_served(running) -> None:
    tokenizer = running.llm.tokenizer
    items = bench_serve.schedule(tokenizer, 6, 20, 8, 0.5, rate=20.0, burstiness=1.0, seed=1)
    results, duration = asyncio.run(bench_serve.run_schedule(
        running.url, "smollm2-4l", items, max_concurrency=4, progress=False))
    assert all(m.ok for m in results), [m.error for m in results]
    assert [m.output_tokens for m in results] == [i.output_len for i in items]
    assert [m.prompt_tokens for m in results] == [i.prompt_len for i in items]
    for m in results:
        assert 0 < m.ttft_s <= m.latency_s and len(m.itl_s) >= 1
        assert m.latency_s == pytest.approx(m.ttft_s + sum(m.itl_s))
    assert duration >= max(i.offset_s for i in items)
    row = bench_serve.summarize(results, duration, [99], {"ttft": 1e9})
    assert row["request_goodput"] == pytest.approx(row["request_throughput"])
    json.dumps(row)  # a JSONL row
    replayed = [Scheduled(**s) for s in json.loads(json.dumps(
        [i.__dict__ for i in items]))]
    assert replayed == items


@pytest.mark.parametrize("parallel", [
    dict(tensor_parallel_size=1, data_parallel_size=1, pad_heads=False, dp_routing="least_loaded"),
    dict(tensor_parallel_size=2, data_parallel_size=3, pad_heads=True, dp_routing="prefix")])
def test_the_parallel_flags_reach_infers_server_as_given(parallel) -> None:
    """What bench_serve passes on the server's command line parses back to the same flags."""
    from absl import flags

    from infer.parallel.flags import define_parallel_flags, parallel_kwargs
    server_flags = flags.FlagValues()
    define_parallel_flags(server_flags)
    server_flags(["infer.serve", *bench_serve.flag_args(parallel)])
    assert parallel_kwargs(server_flags) == parallel


class _Stream:
    """A server's answer to one streamed request, as aiohttp hands it over: SSE lines."""

    def __init__(self, lines: list[bytes]) -> None:
        self.status, self.lines = 200, lines

    async def __aenter__(self) -> "_Stream":
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    @property
    def content(self):
        async def lines():
            for line in self.lines:
                yield line
        return lines()


class _Session:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def post(self, url: str, json: dict) -> _Stream:
        return _Stream(self.lines)


def _sse(event: dict | str) -> list[bytes]:
    data = event if isinstance(event, str) else json.dumps(event)
    return [f"data: {data}\n".encode(), b"\n"]


@pytest.mark.parametrize("seed", range(4))
def test_a_stream_that_does_not_say_what_it_generated_is_a_failure(seed: int) -> None:
    """A request counts as completed only when its stream ends with the usage chunk asked for
    (stream_options.include_usage): an error event after some tokens (the server's engine
    failed) or a stream without usage leaves the request's token count unknown, and counting
    it completed with 0 tokens would lower the output throughput without a sign."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    tokens = [line for i in range(n) for line in _sse(
        {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})]
    usage = _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                           "total_tokens": 3 + n}})
    error = _sse({"error": {"message": "the engine stopped", "type": "InternalServerError",
                            "code": 500}})
    done = _sse("[DONE]")
    item = Scheduled(0.0, "p", 3, n)

    def measured(lines: list[bytes]) -> Measured:
        return asyncio.run(bench_serve._one(_Session(lines), "http://x", "m", item))

    ok = measured(tokens + usage + done)
    assert ok.ok and ok.output_tokens == n and ok.prompt_tokens == 3 and len(ok.itl_s) == n - 1
    failed = measured(tokens + error + done)
    assert not failed.ok and "the engine stopped" in failed.error
    no_usage = measured(tokens + done)
    assert not no_usage.ok and "usage" in no_usage.error
    row = bench_serve.summarize([ok, failed, no_usage], 1.0, [50], {})
    assert row["completed"] == 1 and row["failed"] == 2 and row["total_output_tokens"] == n


class _Tokenizer:
    """Token ids as words: decode and encode are each other's inverse."""

    vocab_size = 1000

    def is_special(self, t: int) -> bool:
        return t < 3

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_a_workload_outside_vllms_ranges_is_refused_in_words() -> None:
    """vLLM's random dataset takes a range ratio in [0, 1): past 1 the lower bound clips at one
    token and the lengths' mean is no longer the length asked for (input 64, ratio 1.5: mean
    80), which the row would label as 64. Empty workloads and rates that are no rate are
    refused before anything is sent, not as an IndexError or a schedule of NaNs."""
    data = bench_serve.random_dataset(_Tokenizer(), 50, 64, 32, 0.5, seed=0)
    assert all(32 <= n <= 96 and 16 <= o <= 48 for _, n, o in data)
    for ratio in (1.0, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="range_ratio"):
            bench_serve.random_dataset(_Tokenizer(), 4, 64, 32, ratio, seed=0)
    for n_in, n_out in ((0, 32), (64, 0)):
        with pytest.raises(ValueError, match="_len"):
            bench_serve.random_dataset(_Tokenizer(), 4, n_in, n_out, 0.0, seed=0)
    for num_prompts in (0, -1):
        with pytest.raises(ValueError, match="num_prompts"):
            bench_serve.arrival_offsets(num_prompts, 4.0, 1.0, 0)
        with pytest.raises(ValueError, match="num_prompts"):
            bench_serve.random_dataset(_Tokenizer(), num_prompts, 64, 32, 0.0, seed=0)
    for rate, burstiness in ((math.nan, 1.0), (-math.inf, 1.0), (0.0, 1.0), (4.0, math.nan)):
        with pytest.raises(ValueError, match="request_rate"):
            bench_serve.arrival_offsets(8, rate, burstiness, 0)


def _replay_that_must_not_run(monkeypatch, tmp_path) -> str:
    """A one-request replay file, with every way of running the benchmark made to fail: for
    settings that must be refused before any request is sent."""
    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench_serve, "run_schedule", never)
    monkeypatch.setattr(bench_serve, "in_process", never)
    schedule = [dict(offset_s=0.0, prompt="x", prompt_len=1, output_len=2)]
    return _replayed(tmp_path, {"model": "stub", "schedule": schedule})


@pytest.mark.parametrize("percentile", [-1.0, 100.5, 150.0, math.nan])
def test_percentiles_outside_0_100_are_refused_before_any_request(percentile, monkeypatch,
                                                                    tmp_path) -> None:
    """A percentile numpy refuses used to stop the run after the whole benchmark (the row
    lost), or, with no completed request, to be written as a silent None."""
    path = _replay_that_must_not_run(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="percentile"):
        bench_serve.run(["url=http://127.0.0.1:1"], model="stub", replay=path, out="",
                        metric_percentiles=[50.0, percentile])
    with pytest.raises(ValueError, match="percentile"):
        bench_serve.summarize([], 0.0, [percentile], {})


@pytest.mark.parametrize("max_concurrency", [0, -2])
def test_a_concurrency_cap_below_one_is_refused_before_any_request(max_concurrency, monkeypatch,
                                                                   tmp_path) -> None:
    """The HTTP client took --max_concurrency=0 as no cap (a falsy semaphore size) and wrote 0
    in its row, while the in-process server refused it, after the HTTP servers had run."""
    path = _replay_that_must_not_run(monkeypatch, tmp_path)
    for servers in (["url=http://127.0.0.1:1"], ["inprocess"]):
        with pytest.raises(ValueError, match="max_concurrency"):
            bench_serve.run(servers, model="stub", replay=path, out="",
                            max_concurrency=max_concurrency)


@pytest.mark.parametrize("slo", ["ttft:-5", "tpot:nan", "e2el:fast"])
def test_an_slo_that_is_no_duration_is_refused_before_any_request(slo, monkeypatch,
                                                                  tmp_path) -> None:
    """A negative or NaN SLO made every request miss it (goodput 0 without a word); a word
    for a number failed with float()'s error, which names no flag."""
    path = _replay_that_must_not_run(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="--goodput"):
        bench_serve.run(["url=http://127.0.0.1:1"], model="stub", replay=path, out="",
                        goodput=["ttft:1000", slo])


def test_the_duration_runs_until_every_request_has_ended(monkeypatch) -> None:
    """vLLM's duration ends when the last request does, failed ones included: a request that
    fails after the others have completed lengthens it. (It ended at the last completed
    request's last token, so late failures raised request and output throughput.) On a clock
    that moves only as the server answers."""
    import aiohttp

    rng = np.random.default_rng()
    clock = [100.0]
    token_s, fail_at = float(rng.uniform(0.5, 2.0)), float(rng.uniform(10.0, 50.0))
    n = int(rng.integers(2, 6))

    class Answer(_Stream):
        def __init__(self, prompt: str) -> None:
            super().__init__([])
            self.status = 500 if prompt == "fails" else 200

        async def text(self) -> str:
            clock[0] = 100.0 + fail_at
            return "overloaded"

        @property
        def content(self):
            async def lines():
                for i in range(n):
                    clock[0] += token_s
                    for line in _sse({"choices": [{"index": 0, "text": f"t{i}"}]}):
                        yield line
                for line in _sse({"choices": [], "usage": {"prompt_tokens": 1,
                                                           "completion_tokens": n}}):
                    yield line
            return lines()

    class Session:
        def __init__(self, **kwargs) -> None:
            pass

        async def __aenter__(self) -> "Session":
            return self

        async def __aexit__(self, *exc) -> None:
            pass

        def post(self, url: str, json: dict) -> Answer:
            return Answer(json["prompt"])

    monkeypatch.setattr(aiohttp, "ClientSession", Session)
    monkeypatch.setattr(bench_serve.time, "perf_counter", lambda: clock[0])
    items = [Scheduled(0.0, "completes", 1, n), Scheduled(0.0, "fails", 1, n)]
    results, duration = asyncio.run(bench_serve.run_schedule("http://x", "m", items,
                                                             progress=False))
    assert results[0].ok and not results[1].ok
    assert results[0].latency_s == pytest.approx(n * token_s)
    assert duration == pytest.approx(max(fail_at, n * token_s))


def test_a_run_with_no_percentiles_prints_its_table(monkeypatch, tmp_path) -> None:
    """--metric_percentiles= (none: mean, median and std only) is valid for the summary; the
    table named its last percentile's columns and failed with an IndexError after the run."""
    async def served(url, model, items, max_concurrency=None, progress=True):
        return [Measured(ok=True, ttft_s=0.1, latency_s=0.5, itl_s=[0.2, 0.2], output_tokens=3,
                         prompt_tokens=1, start_s=0.0) for _ in items], 1.0

    monkeypatch.setattr(bench_serve, "run_schedule", served)
    monkeypatch.setattr(bench_serve, "environment", dict)
    schedule = [dict(offset_s=0.0, prompt="x", prompt_len=1, output_len=3)]
    path = _replayed(tmp_path, {"model": "stub", "schedule": schedule})
    row, = bench_serve.run(["url=http://127.0.0.1:1"], model="stub", replay=path, out="",
                           metric_percentiles=[])
    assert row["median_tpot_ms"] == pytest.approx(200.0)
    assert not any(k.startswith("p") and k.endswith("_ms") for k in row)


@pytest.mark.parametrize("seed", range(4))
def test_peak_token_rate_and_concurrency_follow_vllms_definitions(seed: int) -> None:
    """`max_output_tokens_per_s`: token events per 1-s bucket from the earliest send, at most;
    `max_concurrent_requests`: requests in flight over [send, last token) at once, at most
    (checked at every send, where the count can rise); completed requests only. The texts
    gathered come back per request, in order."""
    rng = np.random.default_rng(seed)
    results = []
    for i in range(int(rng.integers(1, 12))):
        gaps = rng.exponential(0.3, int(rng.integers(0, 8))).tolist()
        ttft = float(rng.exponential(0.5))
        start = float(rng.integers(0, 8)) * 0.5  # ties between sends and ends
        results.append(Measured(ok=bool(rng.random() < 0.8), ttft_s=ttft, itl_s=gaps,
                                latency_s=ttft + sum(gaps), output_tokens=len(gaps) + 1,
                                start_s=start, text=f"text {i}"))
    row = bench_serve.summarize(results, 10.0, [50], {})
    assert row["generated_texts"] == [f"text {i}" for i in range(len(results))]
    ok = [m for m in results if m.ok]
    if not ok:
        assert (row["max_output_tokens_per_s"], row["max_concurrent_requests"]) == (0.0, 0)
        return
    origin = min(m.start_s for m in ok)
    counts: dict[int, int] = {}
    for m in ok:
        t = m.start_s + m.ttft_s
        for gap in [0.0] + m.itl_s:
            t += gap
            counts[int(t - origin)] = counts.get(int(t - origin), 0) + 1
    assert row["max_output_tokens_per_s"] == max(counts.values())
    assert row["max_concurrent_requests"] == max(
        sum(o.start_s <= m.start_s < o.start_s + o.latency_s for o in ok) for m in ok)
