"""The main job (`make run`): a serving benchmark on SmolLM2-135M.

  python -m experiments.serve --num_requests=64 --rate=8 [--peers=hf,llamacpp,llamaserver]

One workload -- Poisson arrivals, prompts of real text (CPython's pydoc topics) with lengths drawn
uniformly, output lengths Pareto(shape 1.5, scale 20) capped -- is served by infer with static
batching and with continuous batching, and, in the same run, by HF transformers' batched
`generate` in static batches (and with --peers=llamacpp by llama.cpp, one request at a time, as
its Python API serves them). Every request asks for exactly its output length (EOS ignored), so
all runs produce the same tokens' worth of work.

--peers=llamaserver adds llama.cpp's own HTTP server, `llama-server`, with continuous batching
over --max_num_seqs slots (`-np`), each holding --max_model_len tokens: it is started on a free
loopback port, each request is sent to `POST /completion` at its arrival time from a thread of
its own and streamed back, and the server is stopped after the run. Its weights are those of
--dtype: the bundled Q4_1 GGUF turned into an F32 or BF16 one by `llama-quantize` (made once,
cached in ~/.cache/infer/llama-server/). --llama_server=PATH names the binary (default:
$LLAMA_SERVER); without it the peer is skipped. It has no Python package; build it from the
llama.cpp that llama-cpp-python 0.3.36 vendors:

  pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
  tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
  cmake -B build -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j2 --target llama-server llama-quantize
  export LLAMA_SERVER=$PWD/build/bin/llama-server   # llama-quantize is found beside it

Appends each run's row to results/serve.jsonl (--out) the moment it is measured, then prints a
table and plots slot utilization over time for static against continuous batching plus
throughput and latency side by side (results/serve.png, beside --out), both from the JSONL.
--resume keeps the runs already there and serves only the missing ones. A peer whose packages
are missing is skipped with a line naming the extra that installs them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Sequence

import numpy as np
from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from experiments.llama_server import (GGUF_TYPES, LLAMA_SERVER_PEER, ensure_llama_server_gguf,
                                      llama_quantize_path, llama_server_gguf_path,
                                      llama_server_usable, serve_llama_server)
from experiments.workloads import poisson_pareto, text_ids
from infer.parallel.flags import define_parallel_flags

# infer's scheduler policies, each optionally with mixed steps.
POLICIES = ["static", "continuous", "static+mixed", "continuous+mixed"]

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_integer("num_requests", 64, "requests in the workload", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("rate", 8.0, "mean arrivals per second (Poisson)", flag_values=FLAGS)
flags.DEFINE_integer("prompt_min", 16, "shortest prompt, tokens", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt_max", 128, "longest prompt, tokens", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("output_shape", 1.5, "Pareto shape of output lengths", flag_values=FLAGS)
# The shortest output is floor(scale) tokens, and a request asks for at least one.
flags.DEFINE_float("output_scale", 20.0, "Pareto scale (minimum) of output lengths",
                   lower_bound=1.0, flag_values=FLAGS)
flags.DEFINE_integer("output_cap", 256, "longest output, tokens", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_num_seqs", 16, "batch slots", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("max_prefill_tokens", 256, "prefill chunk size", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_model_len", 512, "longest sequence", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights", flag_values=FLAGS)
flags.DEFINE_string("kv_cache_dtype", "auto", "KV cache format", flag_values=FLAGS)
flags.DEFINE_list("policies", ["static", "continuous"], "infer scheduler policies: static, "
                  "continuous, continuous+mixed (a prefill chunk and the decode rows in one "
                  "step)", flag_values=FLAGS)
validate_list_flag(FLAGS, "policies", choices=POLICIES, allow_empty=True)  # empty: peers only
flags.DEFINE_list("peers", ["hf"], "peers in the same run: hf, llamacpp, llamaserver, none",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "peers", choices=["hf", "llamacpp", LLAMA_SERVER_PEER, "none"],
                   allow_empty=True)
flags.DEFINE_string("llama_server", os.environ.get("LLAMA_SERVER", ""),
                    "the llama-server binary of the llamaserver peer (default: $LLAMA_SERVER)",
                    flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "workload seed", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("out", "results/serve.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
# Above 0, which absl's inclusive bounds cannot say (NaN refused too).
flags.register_validator("rate", lambda x: x > 0, "--rate must be > 0 (arrivals per second)",
                         flag_values=FLAGS)
flags.register_validator("output_shape", lambda x: x > 0, "--output_shape must be > 0",
                         flag_values=FLAGS)
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)


@dataclasses.dataclass(frozen=True)
class WorkItem:
    arrival_s: float  # offset from the start of the run
    prompt_ids: tuple[int, ...]
    output_len: int


def make_workload(ids: Sequence[int], *, num_requests: int, rate: float, prompt_min: int,
                  prompt_max: int, output_shape: float, output_scale: float, output_cap: int,
                  seed: int) -> list[WorkItem]:
    """Poisson arrivals; prompts are slices of real text; outputs Pareto(shape, scale), capped."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    arrivals, lengths, outputs = poisson_pareto(
        rng, num_requests=num_requests, rate=rate, prompt_min=prompt_min, prompt_max=prompt_max,
        output_shape=output_shape, output_scale=output_scale, output_cap=output_cap)
    arrivals -= arrivals[0]  # the first request opens the run
    starts = rng.integers(0, len(ids) - prompt_max, num_requests)
    return [WorkItem(float(a), tuple(int(t) for t in ids[s:s + n]), int(o))
            for a, s, n, o in zip(arrivals, starts, lengths, outputs)]


def serve_infer(engine, work: list[WorkItem], desc: str, max_concurrency: int | None = None):
    """Feeds the workload to the engine in real time; returns (metrics, step records, start
    perf_counter, wall s). With `max_concurrency`, at most that many requests are unfinished: one
    that arrives while that many are holds back, in arrival order, and its clock (arrival_s, which
    TTFT and E2EL count from) starts at its release, as an HTTP client's does after its
    semaphore."""
    from tqdm import tqdm

    from infer.sampling_params import SamplingParams

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    cap = len(work) if max_concurrency is None else max_concurrency
    pending = collections.deque(work)
    ids, finished = [], {}
    freed: list[float] = []  # when each finished request gave its place up, in finishing order
    bar = tqdm(total=len(work), desc=desc, leave=False)
    start = time.perf_counter()
    first_step = engine.num_steps
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now and len(ids) - len(finished) < cap:
            item = pending.popleft()
            # In arrival order, request i gets the place the (i - cap)-th to finish gave up.
            place = freed[len(ids) - cap] if len(ids) >= cap else start
            ids.append(engine.add_request(
                prompt_token_ids=list(item.prompt_ids),
                arrival_s=max(start + item.arrival_s, place),
                # Only finished outputs are read (their metrics hold every token's time).
                params=SamplingParams(max_tokens=item.output_len, ignore_eos=True,
                                      output_kind="final")))
        full = len(ids) - len(finished) >= cap
        # A static batch waits for more requests: none comes after the last, nor while full.
        engine.scheduler.draining = not pending or full
        idle = True
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished:  # the engine forgets a finished request: keep its output now
                    finished[out.request_id] = out
                    freed.append(time.perf_counter())
                    bar.update(1)
            idle = engine.records[-1].kind == "idle"
        if idle and pending and not full:  # a static batch waits, or nothing runs: sleep
            time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    bar.close()
    return [finished[i].metrics for i in ids], engine.step_records(first_step), start, wall


def serve_hf(model, work: list[WorkItem], batch_size: int, desc: str):
    """HF transformers' batched generate in static batches of `batch_size`, in arrival order: a
    batch starts when its last request has arrived and the previous batch is done, and runs
    until its longest request ends. Per-token times come from a logits processor, which HF calls
    once per decoding step."""
    import torch
    from tqdm import tqdm
    from transformers import LogitsProcessor, LogitsProcessorList

    from infer.engine.request import RequestMetrics

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[WorkItem], clock: LogitsProcessor | None = None) -> None:
        width = max(len(w.prompt_ids) for w in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, w in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(w.prompt_ids):] = torch.tensor(w.prompt_ids)
            mask[row, width - len(w.prompt_ids):] = 1
        n = max(w.output_len for w in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock] if clock else []))

    # Untimed, as infer's engine is warmed up before its clock starts: a first call's one-off
    # costs (allocator, kernel selection) are nobody's serving time.
    generate([dataclasses.replace(work[0], output_len=2)])
    metrics = []
    bar = tqdm(total=len(work), desc=desc, leave=False)
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        time.sleep(max(0.0, batch[-1].arrival_s - (time.perf_counter() - start)))
        clock = StepClock()
        generate(batch, clock)
        # The processor runs after each forward, just before the token is chosen.
        for w in batch:
            metrics.append(RequestMetrics.from_token_times(
                start + w.arrival_s, clock.times[:w.output_len], len(w.prompt_ids)))
        bar.update(len(batch))
    bar.close()
    return metrics, start, time.perf_counter() - start


def serve_llamacpp(gguf_path: str, work: list[WorkItem], max_model_len: int, eos_id: int,
                   desc: str):
    """llama.cpp through llama-cpp-python, one request at a time in arrival order (its Python
    API serves one sequence per model instance). EOS is banned so outputs reach their length."""
    from llama_cpp import Llama
    from tqdm import tqdm

    from infer.engine.request import RequestMetrics

    llm = Llama(model_path=gguf_path, n_ctx=max_model_len, n_threads=os.cpu_count() or 2,
                n_batch=256, verbose=False, use_extra_bufts=False)
    llm.create_completion(list(work[0].prompt_ids), max_tokens=2, temperature=0.0)  # untimed
    metrics = []
    bar = tqdm(total=len(work), desc=desc, leave=False)
    start = time.perf_counter()
    for w in work:
        time.sleep(max(0.0, w.arrival_s - (time.perf_counter() - start)))
        llm.reset()
        times = []
        for _ in llm.create_completion(list(w.prompt_ids), max_tokens=w.output_len,
                                       temperature=0.0, stream=True,
                                       logit_bias={eos_id: -1e9}):
            times.append(time.perf_counter())
        # The stream ends with one more chunk than tokens: the finish chunk (finish_reason set,
        # holding any text it held back), which is no token of its own.
        if len(times) != w.output_len + 1:
            raise RuntimeError(f"llama.cpp streamed {len(times)} chunks for {w.output_len} "
                               f"tokens (expected one per token and a finish chunk)")
        metrics.append(RequestMetrics.from_token_times(start + w.arrival_s, times[:-1],
                                                       len(w.prompt_ids)))
        bar.update(1)
    bar.close()
    return metrics, start, time.perf_counter() - start


def serve_peers(peers: list[str], llama_server: str, dtype: str, experiment: str) -> list[str]:
    """The requested peers that can run, in the order asked: the Python ones through
    `usable_peers`, llama-server through `llama_server_usable` (it is a binary, no package)."""
    from experiments.common import PEERS, usable_peers

    known = set(PEERS) | {LLAMA_SERVER_PEER, "none"}
    unknown = sorted(set(peers) - known)
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {sorted(known - {'none'})} or none")
    usable = set(usable_peers([p for p in peers if p != LLAMA_SERVER_PEER], experiment))
    if LLAMA_SERVER_PEER in peers:
        from infer.io.checkpoint import smollm2_gguf_path
        gguf = llama_server_gguf_path(smollm2_gguf_path(), dtype)
        if llama_server_usable(llama_server, gguf, experiment):
            usable.add(LLAMA_SERVER_PEER)
    return [p for p in dict.fromkeys(peers) if p in usable]


def run(*, num_requests: int, rate: float, prompt_min: int, prompt_max: int,
        output_shape: float, output_scale: float, output_cap: int, max_num_seqs: int,
        max_prefill_tokens: int, max_model_len: int, dtype: str, kv_cache_dtype: str,
        policies: list[str], peers: list[str], seed: int, out: str,
        llama_server: str = "", resume: bool = False, tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, pad_heads: bool = False,
        dp_routing: str = "least_loaded") -> list[dict]:
    """Serves the workload with each policy and peer; returns this run's rows, as `out` holds
    them (each appended the moment it is measured; with `resume`, ones already there are kept
    and not measured again)."""
    from experiments.common import ResultLog, engine_devices, load_hf_smollm2, one_engine, plot_path

    # Before any work: a missing package or binary, or a policy misspelt, is one line.
    for policy in policies:
        scheduler, plus, variant = policy.partition("+")
        if scheduler not in ("static", "continuous") or (plus and variant != "mixed"):
            raise ValueError(f"policy {policy!r}: want static or continuous, optionally with "
                             f"+mixed")
    if prompt_min > prompt_max:
        raise ValueError(f"--prompt_min must be <= --prompt_max, got {prompt_min} > {prompt_max}")
    # The engine, and llama.cpp's context of max_model_len, refuse a request whose prompt +
    # max_tokens pass it (the prompts are raw token slices: no BOS or template): else found
    # after warm-up, or partway through serving when the longest request comes. HF's peer alone
    # has no such limit.
    if (policies or {"llamacpp", LLAMA_SERVER_PEER} & set(peers)) and (
            prompt_max + output_cap > max_model_len):
        raise ValueError(f"--prompt_max + --output_cap must be <= --max_model_len, got "
                         f"{prompt_max} + {output_cap} > {max_model_len}")
    devices = one_engine("serve", tensor_parallel_size=tensor_parallel_size,
                         data_parallel_size=data_parallel_size, pad_heads=pad_heads)
    del dp_routing  # one replica: nothing to route
    peers = serve_peers(peers, llama_server, dtype, "serve")
    log = ResultLog(out, resume=resume)
    from infer.engine.engine import Engine, EngineConfig
    from infer.engine.metrics import summarize
    from infer.io.checkpoint import smollm2_gguf_path

    _, model, tokenizer, mesh = devices.load(dtype)
    work = make_workload(text_ids(tokenizer, 400_000), num_requests=num_requests, rate=rate,
                         prompt_min=prompt_min, prompt_max=prompt_max, output_shape=output_shape,
                         output_scale=output_scale, output_cap=output_cap, seed=seed)
    print(f"{len(work)} requests over {work[-1].arrival_s:.1f} s; prompts "
          f"{np.mean([len(w.prompt_ids) for w in work]):.0f} tokens on average, outputs "
          f"{np.mean([w.output_len for w in work]):.0f} (max {max(w.output_len for w in work)})")
    workload = dict(experiment="serve", num_requests=num_requests, rate=rate,
                    prompt_min=prompt_min, prompt_max=prompt_max, output_shape=output_shape,
                    output_scale=output_scale, output_cap=output_cap, seed=seed,
                    max_num_seqs=max_num_seqs, dtype=dtype, **devices.point)
    runners = {}  # by mixed_steps: the programs differ

    def serve_policy(policy: str) -> dict:
        scheduler, _, variant = policy.partition("+")
        mixed = variant == "mixed"
        engine = Engine(model, tokenizer, EngineConfig(
            kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens, max_model_len=max_model_len,
            scheduler=scheduler, mixed_steps=mixed), runner=runners.get(mixed), mesh=mesh)
        if mixed not in runners:
            start = time.perf_counter()
            programs = engine.warmup(progress=True)
            print(f"compiled {programs} programs in {time.perf_counter() - start:.0f} s")
            runners[mixed] = engine.runner
        metrics, records, start, wall = serve_infer(engine, work, f"infer {policy}")
        # The plot's slot-utilization timeline travels in the row, so a resumed run can draw it.
        timeline = [[round(r.start_s - start, 4), round(r.end_s - start, 4),
                     round(r.slot_utilization, 4)] for r in records if r.kind != "idle"]
        return {**summarize(metrics, wall, records), "timeline": timeline,
                "engine_devices": engine_devices(engine)}

    def serve_hf_peer() -> dict:
        hf = load_hf_smollm2(dtype)
        metrics, _, wall = serve_hf(hf, work, max_num_seqs, "HF transformers static")
        return summarize(metrics, wall)

    def serve_llamacpp_peer() -> dict:
        metrics, _, wall = serve_llamacpp(smollm2_gguf_path(), work, max_model_len,
                                          tokenizer.eos_ids[0], "llama.cpp")
        return summarize(metrics, wall)

    def serve_llama_server_peer() -> dict:
        gguf = ensure_llama_server_gguf(smollm2_gguf_path(), dtype,
                                        llama_quantize_path(llama_server))
        metrics, _, wall = serve_llama_server(llama_server, gguf, work, max_num_seqs,
                                              max_model_len, max_prefill_tokens, "llama-server")
        return summarize(metrics, wall)

    engine_config = dict(kv_cache_dtype=kv_cache_dtype, max_prefill_tokens=max_prefill_tokens,
                         max_model_len=max_model_len)
    for policy in policies:
        log.measure({**workload, "impl": "infer", "policy": policy, **engine_config},
                    lambda policy=policy: serve_policy(policy))
    if "hf" in peers:
        log.measure({**workload, "impl": "hf-transformers", "policy": "static"}, serve_hf_peer)
    if "llamacpp" in peers:
        log.measure({**workload, "impl": "llama.cpp (Q4_1)", "policy": "one at a time",
                     "max_model_len": max_model_len}, serve_llamacpp_peer)
    if LLAMA_SERVER_PEER in peers:
        log.measure({**workload, "impl": f"llama-server ({GGUF_TYPES[dtype]})",
                     "policy": f"continuous, {max_num_seqs} slots", "max_model_len": max_model_len,
                     "max_prefill_tokens": max_prefill_tokens}, serve_llama_server_peer)
    rows = log.rows()
    report(rows)
    plot(rows, plot_path(out), max_num_seqs)
    return rows


def report(rows: list[dict]) -> None:
    """The table, and continuous batching's throughput over each other run's."""
    from experiments.common import markdown_table

    cont = next((r for r in rows if r["impl"] == "infer" and r["policy"] == "continuous"), None)
    table = []
    for r in rows:
        r = dict(r)
        for k in ("ttft_s", "tpot_s", "e2e_s"):
            for p in ("p50", "p99"):
                r[f"{k.split('_')[0]}_{p}_ms"] = r[f"{k}_{p}"] * 1e3
        table.append(r)
    print(markdown_table(table, [
        ("impl", "impl"), ("policy", "policy"), ("output_tok_s", "output tok/s"),
        ("requests_s", "req/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
        ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
        ("e2e_p50_ms", "e2e p50 ms"), ("slot_utilization_mean", "slot util")]))
    for r in rows:
        if cont is not None and r is not cont:
            print(f"continuous batching: {cont['output_tok_s'] / r['output_tok_s']:.2f}x the "
                  f"output tokens/s of {r['impl']} ({r['policy']})")
    for r in rows:
        if r.get("prefill_steps"):  # rows of earlier versions lack the split
            print(f"{r['impl']} ({r['policy']}): prompt tokens in {r['prefill_steps']} steps "
                  f"({r['prefill_tokens_computed'] / r['prefill_steps']:.0f} a step), "
                  f"{r['prefill_time_share']:.0%} of the busy time; median step "
                  f"{r['decode_step_ms_p50']:.1f} ms decoding only, "
                  f"{r['prefill_step_ms_p50']:.1f} ms with prompt tokens")


def plot(rows: list[dict], path: str, max_num_seqs: int) -> None:
    from experiments.common import new_figure, save_figure

    fig, axes = new_figure(3, figsize=(16, 4.5))
    for r in rows:
        if "timeline" not in r:
            continue
        policy, steps = r["policy"], r["timeline"]
        xs, ys = [], []
        for t0, t1, u in steps:
            xs += [t0, t1]
            ys += [100 * u, 100 * u]
        axes[0].plot(xs, ys, label=f"{policy} batching", lw=1)
    axes[0].set_xlabel("time since the first arrival (s)")
    axes[0].set_ylabel(f"slot utilization (% of {max_num_seqs} slots)")
    axes[0].set_title("slot utilization over time")
    axes[0].legend()
    labels = [f"{r['impl']}\n{r['policy']}" for r in rows]
    # One color per implementation: infer's policies side by side, each peer apart.
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    axes[1].bar(labels, [r["output_tok_s"] for r in rows],
                color=[f"C{impls.index(r['impl']) % 10}" for r in rows])
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("throughput")
    x = np.arange(len(rows))
    axes[2].bar(x - 0.2, [r["ttft_s_p50"] for r in rows], 0.4, label="TTFT p50")
    axes[2].bar(x + 0.2, [r["tpot_s_p50"] * 10 for r in rows], 0.4, label="TPOT p50 × 10")
    axes[2].set_xticks(x, labels)
    axes[2].set_ylabel("seconds")
    axes[2].set_title("latency")
    axes[2].legend()
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
