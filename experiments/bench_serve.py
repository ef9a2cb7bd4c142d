"""A serving benchmark over HTTP with `vllm bench serve`'s definitions, so that infer's numbers
sit beside anyone's:

  python -m experiments.bench_serve --servers=infer[,llamaserver] --num_prompts=32 \\
      --request_rate=4 --random_input_len=64 --random_output_len=32

The client (aiohttp, streaming `/v1/completions`) sends each request at its arrival time and
measures on the client:
  TTFT   send -> the first SSE event with non-empty `choices` (even if its text is "")
  ITL    the gaps between a request's later such events, pooled over all requests
  E2EL   send -> the last token event (the usage event does not move it)
  TPOT   (E2EL - TTFT) / (output tokens - 1), per request with more than one token
  output tokens: the usage chunk's `completion_tokens` (`stream_options.include_usage`); a
         stream without one, or with an error event, is a failed request
Aggregates: request and output throughput over the duration (first send to the end of the last
request, failed or not),
mean / median / std / --metric_percentiles of each, and goodput: requests per second meeting
every --goodput SLO (e.g. ttft:1000,tpot:100, milliseconds).

Workload: vLLM's `random` dataset with infer's tokenizer (lengths uniform over
[floor(L(1-r)), ceil(L(1+r))], consecutive token ids from a random offset over the non-special
vocabulary, decoded and re-encoded to the length), `ignore_eos` so every server generates the
same tokens; arrivals with gamma gaps of shape --burstiness (1: Poisson) rescaled so the last
arrival is at num_prompts / rate (rate inf: all at once); --seed fixes both. The realised
schedule (offsets, prompts, output lengths) is saved in each row; --replay=ROWS.jsonl sends a
saved one again, to another server (its rows keep the saved row's workload fields and name where
it came from, `replayed_from`).

--servers: `infer` starts `python -m infer.serve` (waits for /health, i.e. warm-up), `llamaserver`
llama.cpp's `llama-server` on the same GGUF in the same dtype (see experiments/serve.py for the
build), `url=http://host:port` a server already running, and `inprocess` feeds the same schedule
to the same engine in this process with no HTTP (experiments.serve's loop, latencies from each
scheduled arrival, or from its release under --max_concurrency): the difference is what the HTTP
layer costs. One row per server is appended to results/bench_serve.jsonl (--out) with vLLM's
result keys (an `inprocess` row's `generated_texts` are "": that loop keeps no text).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np
from absl import flags

from experiments.common import (check_output_path, environment, markdown_table, run_main,
                                validate_list_flag, validate_output_flag)
from experiments.llama_server import (ensure_llama_server_gguf, free_port, llama_quantize_path,
                                      llama_server_command, llama_server_gguf_path,
                                      llama_server_usable, server_process)
from infer.parallel.flags import define_parallel_flags

SERVERS = ("infer", "llamaserver", "inprocess")  # or url=http://HOST:PORT


def check_servers(servers: Sequence[str]) -> None:
    """Refuses an unknown server before any is benchmarked, not after those before it."""
    if not servers:
        raise ValueError("--servers must name at least one server")
    for server in servers:
        if server not in SERVERS and not server.startswith(("url=http://", "url=https://")):
            raise ValueError(f"--servers: unknown server {server!r}: "
                             f"{', '.join(SERVERS)} or url=http://HOST:PORT")


def _valid_servers(servers: list[str]) -> bool:
    try:
        check_servers(servers)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


FLAGS = flags.FlagValues()
flags.DEFINE_list("servers", ["infer", "inprocess"], "infer, llamaserver, inprocess (the "
                  "engine without HTTP), or url=http://HOST:PORT", flag_values=FLAGS)
flags.register_validator("servers", _valid_servers, flag_values=FLAGS)
flags.DEFINE_string("model", "smollm2-135m", "the model every server serves", flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights", flag_values=FLAGS)
flags.DEFINE_integer("num_prompts", 32, "requests", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("request_rate", 4.0, "mean arrivals per second (inf: all at once)",
                   flag_values=FLAGS)
flags.DEFINE_float("burstiness", 1.0, "gamma shape of the gaps (1: Poisson)", flag_values=FLAGS)
flags.DEFINE_integer("max_concurrency", None, "requests in flight at most (client side)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("random_input_len", 64, "prompt tokens (mean)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("random_output_len", 32, "output tokens (mean)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("random_range_ratio", 0.0, "lengths uniform in L(1 -+ r)", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "dataset and arrival seed", lower_bound=0, flag_values=FLAGS)
# Bounds absl's inclusive ones cannot say (NaN refused too), as arrival_offsets and
# random_dataset would refuse them, but only once the tokenizer has made the prompts.
flags.register_validator("request_rate", lambda x: x > 0,
                         "--request_rate must be > 0 (inf: all at once)", flag_values=FLAGS)
flags.register_validator("burstiness", lambda x: 0 < x < math.inf,
                         "--burstiness must be > 0 and finite", flag_values=FLAGS)
flags.register_validator("random_range_ratio", lambda x: 0 <= x < 1,
                         "--random_range_ratio must be in [0, 1)", flag_values=FLAGS)
flags.DEFINE_string("replay", None, "a bench_serve JSONL: send its first row's schedule again "
                    "(the workload flags are then unused: the rows take the saved row's)",
                    flag_values=FLAGS)
flags.DEFINE_list("metric_percentiles", ["50", "90", "99"], "percentiles reported",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "metric_percentiles", parse=float, lower_bound=0, upper_bound=100,
                   allow_empty=True)  # none: mean, median and std only
flags.DEFINE_list("goodput", ["ttft:1000", "tpot:100"], "SLOs in ms (ttft, tpot, e2el)",
                  flag_values=FLAGS)
flags.DEFINE_integer("max_num_seqs", 8, "server slots (infer's max_num_seqs, llama-server's -np)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("max_model_len", 512, "server context per slot", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_prefill_tokens", 256, "prefill chunk (llama-server's batch)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("llama_server", os.environ.get("LLAMA_SERVER", ""), "llama-server binary",
                    flag_values=FLAGS)
# infer's server and the in-process engine (llama-server's own parallelism is not infer's).
define_parallel_flags(FLAGS)
flags.DEFINE_string("out", "results/bench_serve.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out", allow_empty=True)  # empty: the table only


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One request of the schedule: when it is sent, what it asks."""

    offset_s: float
    prompt: str
    prompt_len: int
    output_len: int


def random_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, seed: int) -> list[tuple[str, int, int]]:
    """vLLM's `random` dataset: (prompt text, its token count, output length) per request."""
    _check_num_prompts(num_prompts)
    # vLLM's range: from 1 on the lower bound clips at one token, and the lengths' mean is no
    # longer the length the row names.
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"random_input_len and random_output_len must be >= 1, got "
                         f"{input_len}, {output_len}")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    lo_out = max(1, math.floor(output_len * (1 - range_ratio)))
    hi_out = math.ceil(output_len * (1 + range_ratio))
    allowed = np.array([t for t in range(tokenizer.vocab_size) if not tokenizer.is_special(t)])
    out = []
    for _ in range(num_prompts):
        n = int(rng.integers(max(1, lo_in), hi_in + 1))
        offset = int(rng.integers(0, len(allowed)))
        ids = allowed[(offset + np.arange(n)) % len(allowed)].tolist()
        # Decoding and re-encoding merges some tokens: re-encode, then cut or pad to n.
        ids = tokenizer.encode(tokenizer.decode(ids), add_bos=False)[:n]
        while len(ids) < n:
            ids = tokenizer.encode(tokenizer.decode(ids + allowed[:n - len(ids)].tolist()),
                                   add_bos=False)[:n]
        text = tokenizer.decode(ids)
        out.append((text, len(tokenizer.encode(text)), int(rng.integers(lo_out, hi_out + 1))))
    return out


def _check_num_prompts(num_prompts: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")


def arrival_offsets(num_prompts: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times from 0: gamma gaps (shape `burstiness`, mean 1/rate) cumulated and rescaled so
    that the last one is num_prompts / rate, as vLLM does; all zero for an infinite rate."""
    _check_num_prompts(num_prompts)
    if rate == math.inf:
        return np.zeros(num_prompts)
    if not (0 < rate < math.inf and 0 < burstiness < math.inf):  # NaN too
        raise ValueError(f"request_rate and burstiness must be > 0, got {rate}, {burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), num_prompts)
    times = np.cumsum(gaps)
    return times * (num_prompts / rate) / times[-1]


def schedule(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
             range_ratio: float, rate: float, burstiness: float, seed: int) -> list[Scheduled]:
    data = random_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    offsets = arrival_offsets(num_prompts, rate, burstiness, seed)
    return [Scheduled(float(t), p, n, o) for t, (p, n, o) in zip(offsets, data)]


@dataclasses.dataclass
class Measured:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    start_s: float = 0.0
    text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (tokens - 1); None for a request of one token."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def _one(session: Any, url: str, model: str, item: Scheduled) -> Measured:
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.output_len,
            "temperature": 0.0, "repetition_penalty": 1.0, "logprobs": None, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    m = Measured(ok=False, start_s=start)
    last = usage = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                m.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return m
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("error"):
                    # The server failed after its 200 (infer's engine stopping mid-stream):
                    # what it generated is unknown, so the request is not completed.
                    error = event["error"]
                    m.error = (f"error event: {error.get('message', error)}"
                               if isinstance(error, dict) else f"error event: {error}")
                    return m
                if event.get("choices"):
                    if last is None:
                        m.ttft_s = now - start
                    else:
                        m.itl_s.append(now - last)
                    last = now
                    m.text += event["choices"][0].get("text") or ""
                if event.get("usage"):
                    usage = event["usage"]
                    m.output_tokens = event["usage"]["completion_tokens"]
                    m.prompt_tokens = event["usage"]["prompt_tokens"]
        if last is None:
            m.error = "no token event"
            return m
        if usage is None:
            # Asked for (include_usage): without it the token count, hence throughput and
            # TPOT, would be 0 for a request counted as completed.
            m.error = "no usage chunk: the stream did not say how many tokens it generated"
            return m
        m.latency_s = last - start
        m.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        m.error = repr(e)
    return m


def check_max_concurrency(max_concurrency: int | None) -> None:
    """None (no cap) or >= 1, for the HTTP client and the in-process loop alike: 0 must not
    mean no cap to one of them and an error to the other."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None (no cap), got {max_concurrency}")


async def run_schedule(url: str, model: str, items: Sequence[Scheduled],
                       max_concurrency: int | None = None, progress: bool = True
                       ) -> tuple[list[Measured], float]:
    """Sends every request at its offset; (measurements in schedule order, duration s)."""
    import aiohttp
    from tqdm import tqdm
    check_max_concurrency(max_concurrency)
    limit = asyncio.Semaphore(len(items) if max_concurrency is None else max_concurrency)
    bar = tqdm(total=len(items), desc=f"requests to {url}", disable=not progress)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=1 << 20,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        first = time.perf_counter()

        async def send(item: Scheduled) -> Measured:
            await asyncio.sleep(max(0.0, first + item.offset_s - time.perf_counter()))
            async with limit:
                m = await _one(session, url, model, item)
            bar.update(1)
            return m

        results = await asyncio.gather(*(send(i) for i in items))
        # vLLM's: until every request has ended, failed ones too (a failure after the last
        # completion is part of the run that the throughputs divide by).
        duration = time.perf_counter() - first
    bar.close()
    return list(results), duration


def check_percentiles(percentiles: Sequence[float]) -> None:
    """Refuses a percentile numpy would: before the benchmark runs, not after it (or, with no
    completed request, never: the row would hold None for it)."""
    bad = [p for p in percentiles if not 0 <= p <= 100]
    if bad:
        raise ValueError(f"metric percentiles must be in [0, 100], got {bad}")


def summarize(results: Sequence[Measured], duration_s: float, percentiles: Sequence[float],
              goodput_ms: dict[str, float]) -> dict[str, Any]:
    """vLLM's result keys."""
    check_percentiles(percentiles)
    ok = [m for m in results if m.ok]
    ttft = [m.ttft_s for m in ok]
    tpot = [m.tpot_s for m in ok if m.tpot_s is not None]
    itl = [g for m in ok for g in m.itl_s]
    e2el = [m.latency_s for m in ok]
    out_tokens = sum(m.output_tokens for m in ok)
    in_tokens = sum(m.prompt_tokens for m in ok)

    def good(m: Measured) -> bool:
        per = {"ttft": m.ttft_s, "e2el": m.latency_s, "tpot": m.tpot_s or 0.0}
        return all(per[k] * 1e3 <= v for k, v in goodput_ms.items())

    row: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "request_goodput": sum(map(good, ok)) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = np.asarray(values, float) * 1e3
        row[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        row[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else None
        row[f"std_{name}_ms"] = float(ms.std()) if ms.size else None
        for p in percentiles:
            row[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    # One entry per request in every array, in schedule order, so that index i is request i
    # throughout (as vLLM's); a failed request's ttft and latency are 0, as vLLM's defaults,
    # and its `errors` entry is non-empty ("" for a request that succeeded).
    row.update(input_lens=[m.prompt_tokens for m in results],
               output_lens=[m.output_tokens for m in results],
               ttfts=[m.ttft_s if m.ok else 0.0 for m in results],
               itls=[m.itl_s for m in results],
               latencies=[m.latency_s if m.ok else 0.0 for m in results],
               start_times=[m.start_s for m in results],
               generated_texts=[m.text for m in results],
               errors=[m.error if not m.ok else "" for m in results])
    row.update(peak_rates(ok))
    return row


def peak_rates(ok: Sequence[Measured]) -> dict[str, float]:
    """vLLM's `max_output_tokens_per_s` and `max_concurrent_requests` over the completed
    requests: the most token events (the first, then one per inter-token gap) in one 1-s
    bucket counted from the earliest send, and the most requests in flight at once, each in
    flight over [send, last token) (one that ends as another is sent does not overlap it)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    origin = min(m.start_s for m in ok)
    end = max(m.start_s + m.latency_s for m in ok)
    per_second = np.zeros(int(np.ceil(end - origin)) + 1)
    for m in ok:
        t = m.start_s + m.ttft_s
        for gap in [0.0, *m.itl_s]:  # added one by one, as vLLM's: the same bucket edges
            t += gap
            if 0 <= int(t - origin) < per_second.size:
                per_second[int(t - origin)] += 1
    # Ends sort before sends at the same time: half-open intervals.
    events = sorted([(m.start_s, 1) for m in ok] + [(m.start_s + m.latency_s, -1) for m in ok])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return {"max_output_tokens_per_s": float(per_second.max()), "max_concurrent_requests": peak}


def flag_args(values: dict[str, Any]) -> list[str]:
    """absl command-line arguments that set each flag to its value (--x / --nox for a bool)."""
    return [f"--{'' if v else 'no'}{name}" if isinstance(v, bool) else f"--{name}={v}"
            for name, v in values.items()]


@contextlib.contextmanager
def launched(server: str, model: str, dtype: str, max_num_seqs: int, max_model_len: int,
             max_prefill_tokens: int, llama_server: str, parallel: dict[str, Any]
             ) -> Iterator[tuple[str, str]]:
    """(base url, served model name) of a running server, started here unless given by url;
    infer's with the `parallel` flags (`infer.parallel.flags.parallel_kwargs`)."""
    if server.startswith("url="):
        yield server[4:].rstrip("/"), model
        return
    port = free_port()
    if server == "infer":
        command = [sys.executable, "-m", "infer.serve", f"--model={model}", f"--dtype={dtype}",
                   f"--port={port}", f"--max_num_seqs={max_num_seqs}",
                   f"--max_model_len={max_model_len}",
                   f"--max_prefill_tokens={max_prefill_tokens}", *flag_args(parallel)]
        with server_process(command, port, name="infer.serve", ready_timeout_s=1800):
            yield f"http://127.0.0.1:{port}", model
        return
    if server == "llamaserver":
        src = _gguf(model)
        gguf = llama_server_gguf_path(src, dtype)
        ensure_llama_server_gguf(src, dtype, llama_quantize_path(llama_server))
        command = llama_server_command(llama_server, gguf, port=port, slots=max_num_seqs,
                                       max_model_len=max_model_len, threads=os.cpu_count() or 1,
                                       batch=max_prefill_tokens)
        with server_process(command, port):
            yield f"http://127.0.0.1:{port}", model
        return
    raise ValueError(f"unknown server {server!r}: infer, llamaserver or url=http://HOST:PORT")


def in_process(items: Sequence[Scheduled], model: str, dtype: str, max_num_seqs: int,
               max_model_len: int, max_prefill_tokens: int, parallel: dict[str, Any],
               max_concurrency: int | None = None) -> tuple[list[Measured], float]:
    """The same schedule fed straight to the engine in this process (experiments.serve's loop,
    warmed up first), measured from each request's scheduled arrival, or from its release under
    `max_concurrency`: what HTTP costs."""
    from experiments.serve import WorkItem, serve_infer
    from infer import LLM
    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_prefill_tokens=max_prefill_tokens, **parallel)
    llm.engine.warmup(progress=True)
    work = [WorkItem(i.offset_s, tuple(llm.tokenizer.encode(i.prompt)), i.output_len)
            for i in items]
    serve_infer(llm.engine, work[:1], "untimed first request")  # as the HTTP client does
    metrics, _, _, wall = serve_infer(llm.engine, work, "in process", max_concurrency)
    return [Measured(ok=True, ttft_s=m.ttft_s, latency_s=m.e2e_s, itl_s=list(m.step_gaps),
                     output_tokens=m.num_output_tokens, prompt_tokens=m.num_prompt_tokens,
                     start_s=m.arrival_s) for m in metrics], wall


def run(servers: list[str], model: str = "smollm2-135m", dtype: str = "float32",
        num_prompts: int = 32, request_rate: float = 4.0, burstiness: float = 1.0,
        max_concurrency: int | None = None, random_input_len: int = 64,
        random_output_len: int = 32, random_range_ratio: float = 0.0, seed: int = 0,
        replay: str | None = None, metric_percentiles: list[float] = (50, 90, 99),
        goodput: list[str] = ("ttft:1000", "tpot:100"), max_num_seqs: int = 8,
        max_model_len: int = 512, max_prefill_tokens: int = 256, llama_server: str = "",
        out: str = "results/bench_serve.jsonl", tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, pad_heads: bool = False,
        dp_routing: str = "least_loaded") -> list[dict[str, Any]]:
    check_servers(servers)
    if out:  # "": no file
        check_output_path(out, flag="out")
    saved = read_replay(replay) if replay else None
    # The servers started here hold --max_model_len tokens a request: one past it is refused
    # (an HTTP 400 a row counts as failed, or the in-process engine's error after warm-up).
    started = [s for s in servers if not s.startswith("url=")]
    if started and saved is None:
        longest_in = math.ceil(random_input_len * (1 + random_range_ratio))
        longest_out = math.ceil(random_output_len * (1 + random_range_ratio))
        if longest_in + longest_out > max_model_len:
            raise ValueError(
                f"--random_input_len + --random_output_len must be <= --max_model_len for "
                f"{', '.join(started)}: up to {longest_in} + {longest_out} tokens (with "
                f"--random_range_ratio={random_range_ratio:g}) > {max_model_len}")
    parallel = dict(tensor_parallel_size=tensor_parallel_size,
                    data_parallel_size=data_parallel_size, pad_heads=pad_heads,
                    dp_routing=dp_routing)
    if "inprocess" in servers and data_parallel_size != 1:
        raise ValueError("inprocess feeds one engine's loop (experiments.serve): run "
                         "data-parallel replicas through --servers=infer")
    check_percentiles([float(p) for p in metric_percentiles])
    check_max_concurrency(max_concurrency)
    slos = {}
    for g in goodput:
        name, _, ms = g.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if name not in ("ttft", "tpot", "e2el") or not value >= 0:  # no request meets NaN
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, e2el:MS with MS a number "
                             f">= 0; got {g!r}")
        slos[name] = value
    if "llamaserver" in servers and not llama_server_usable(
            llama_server, llama_server_gguf_path(_gguf(model), dtype), "bench_serve"):
        servers = [s for s in servers if s != "llamaserver"]
    workload: dict[str, Any] = dict(
        model=model, request_rate=request_rate, burstiness=burstiness,
        random_input_len=random_input_len, random_output_len=random_output_len,
        random_range_ratio=random_range_ratio, seed=seed, replayed_from=None)
    if saved is not None:
        items = [Scheduled(**s) for s in saved["schedule"]]
        # The prompts and their lengths are the saved model's tokenizer's: another model's row
        # would label a workload it was not made for.
        if (saved.get("model") or model) != model:
            raise ValueError(f"--replay={replay} holds a schedule made for model "
                             f"{saved['model']!r}, not {model!r}: pass --model={saved['model']}")
        # The row describes the schedule it sent, not the flags, which made none of it; a field
        # the saved row lacks is unknown (None).
        workload.update({k: saved.get(k) for k in workload if k != "model"}, replayed_from={
            "path": os.path.abspath(replay), "server": saved.get("server"),
            "time": (saved.get("environment") or {}).get("time")})
    else:
        from infer.io.loader import load_on_host
        items = schedule(load_on_host(model)[2], num_prompts, random_input_len,
                         random_output_len, random_range_ratio, request_rate, burstiness, seed)
    # Exact now: the prompts' token counts (a BOS, re-encoding), or a replayed schedule's.
    need = max(i.prompt_len + i.output_len for i in items)
    if started and need > max_model_len:
        raise ValueError(f"a request of the {'--replay ' if replay else ''}schedule needs {need} "
                         f"tokens (prompt + output), more than --max_model_len={max_model_len} "
                         f"of {', '.join(started)}")
    rows = []
    for server in servers:
        if server == "inprocess":
            results, duration = in_process(items, model, dtype, max_num_seqs, max_model_len,
                                           max_prefill_tokens, parallel, max_concurrency)
        else:
            with launched(server, model, dtype, max_num_seqs, max_model_len,
                          max_prefill_tokens, llama_server, parallel) as (url, served):
                # One request first, untimed, as vLLM's client sends: connections, lazy setup.
                asyncio.run(run_schedule(url, served, items[:1], progress=False))
                results, duration = asyncio.run(run_schedule(url, served, items,
                                                             max_concurrency))
        row = {"server": server, "dtype": dtype, "num_prompts": len(items), **workload,
               "max_concurrency": max_concurrency, "max_num_seqs": max_num_seqs,
               "goodput_slo_ms": slos,
               # infer's devices; llama-server and a url= server run as they were started.
               **(parallel if server in ("infer", "inprocess") else {}),
               **summarize(results, duration, [float(p) for p in metric_percentiles], slos),
               "schedule": [dataclasses.asdict(i) for i in items], "environment": environment()}
        rows.append(row)
        if out:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    # The last percentile asked for beside the medians (none asked: the medians alone).
    p = [f"p{float(x):g}" for x in metric_percentiles[-1:]]
    print(markdown_table(rows, [
        ("server", "server"), ("completed", "done"), ("request_throughput", "req/s"),
        ("output_throughput", "out tok/s"), ("request_goodput", "goodput req/s"),
        ("median_ttft_ms", "TTFT p50 ms"), *[(f"{q}_ttft_ms", f"TTFT {q} ms") for q in p],
        ("median_tpot_ms", "TPOT p50 ms"), ("median_itl_ms", "ITL p50 ms"),
        *[(f"{q}_itl_ms", f"ITL {q} ms") for q in p], ("median_e2el_ms", "E2EL p50 ms")]))
    return rows


def read_replay(path: str) -> dict[str, Any]:
    """The first row of a bench_serve JSONL, refused in words unless it holds a schedule."""
    with open(path) as fh:
        line = fh.readline()
    if not line.strip():
        raise ValueError(f"--replay={path} is empty: want a bench_serve JSONL, whose first row "
                         f"holds the schedule to send")
    try:
        saved = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--replay={path}: its first line is not JSON ({e}): want a "
                         f"bench_serve row") from None
    entries = saved.get("schedule") if isinstance(saved, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--replay={path}: its first row holds no schedule (a non-empty list "
                         f"under \"schedule\", as bench_serve's rows have)")
    fields = {f.name for f in dataclasses.fields(Scheduled)}
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != fields:
            raise ValueError(f"--replay={path}: schedule entry {n} is {entry!r:.120}; want the "
                             f"fields {', '.join(sorted(fields))}")
    return saved


def _gguf(model: str) -> str:
    """The GGUF file llama-server reads for `model` (the bundled preset's, or the path)."""
    from infer.io.checkpoint import smollm2_gguf_path
    return smollm2_gguf_path() if model == "smollm2-135m" else model


if __name__ == "__main__":
    run_main(run, FLAGS)
