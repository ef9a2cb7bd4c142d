"""llama.cpp's own HTTP server, `llama-server`, as a peer of the serving benchmark
(`experiments.serve --peers=llamaserver`): continuous batching over `-np` slots, as llama.cpp
serves many users. Its weights are the bundled Q4_1 GGUF turned into F32 or BF16 by
`llama-quantize`, the weights infer computes with; the binary is built from the llama.cpp that
llama-cpp-python vendors (the steps are in experiments/serve.py's docstring)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from experiments.serve import WorkItem

LLAMA_SERVER_PEER = "llamaserver"
LLAMA_SERVER_BUILD = (
    "build it from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp with cmake (see the "
    "docstring of experiments/serve.py) and pass --llama_server=PATH or set LLAMA_SERVER")
# The GGUF weight type of each --dtype: the Q4_1 weights, dequantized, as infer holds them.
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
LLAMA_SERVER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "infer", "llama-server")


def llama_quantize_path(llama_server: str) -> str:
    """llama-quantize, which the same cmake build puts beside llama-server."""
    return os.path.join(os.path.dirname(os.path.abspath(llama_server)), "llama-quantize")


def llama_server_gguf_path(src: str, dtype: str, cache_dir: str | None = None) -> str:
    """Where the `dtype` copy of the GGUF `src` is cached (in LLAMA_SERVER_CACHE by default)."""
    stem = os.path.splitext(os.path.basename(src))[0]
    return os.path.join(cache_dir or LLAMA_SERVER_CACHE, f"{stem}.{GGUF_TYPES[dtype]}.gguf")


def llama_server_usable(llama_server: str, gguf: str, experiment: str) -> bool:
    """Whether the llama-server peer can run: the binary exists and either the GGUF in the run's
    dtype is cached or llama-quantize is there to make it. Otherwise one line says how to get
    them, before any work, as `usable_peers` does for a missing package."""
    if not llama_server or not os.path.isfile(llama_server) or not os.access(llama_server,
                                                                               os.X_OK):
        where = f"no executable at {llama_server!r}" if llama_server else "no binary given"
        print(f"[{experiment}] skipping peer {LLAMA_SERVER_PEER!r}: {where}; {LLAMA_SERVER_BUILD}")
        return False
    quantize = llama_quantize_path(llama_server)
    if not os.path.exists(gguf) and not os.access(quantize, os.X_OK):
        print(f"[{experiment}] skipping peer {LLAMA_SERVER_PEER!r}: {gguf} is not cached and "
              f"there is no llama-quantize at {quantize} to make it; {LLAMA_SERVER_BUILD} "
              "(targets llama-server llama-quantize)")
        return False
    return True


def ensure_llama_server_gguf(src: str, dtype: str, llama_quantize: str,
                             cache_dir: str | None = None) -> str:
    """The GGUF `src` with its weights in `dtype` (F32 or BF16), made once with llama-quantize
    into `cache_dir`: the Q4_1 checkpoint dequantized, the weights infer computes with."""
    out = llama_server_gguf_path(src, dtype, cache_dir)
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"  # renamed when complete: a killed run leaves no half file
    try:
        done = subprocess.run([llama_quantize, "--allow-requantize", src, tmp, GGUF_TYPES[dtype]],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"llama-quantize failed ({done.returncode}) making {out}:\n{tail}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def llama_server_command(llama_server: str, gguf: str, *, port: int, slots: int,
                         max_model_len: int, threads: int, batch: int) -> list[str]:
    """The llama-server command line of the peer. `-c` is the whole KV cache, split evenly over
    the slots when it is not unified, so each slot holds one max_model_len sequence, as each of
    infer's does (llama.cpp rounds a slot up to a multiple of 256 tokens: more room, never
    less). The logical and physical batch are infer's prefill chunk. The prompt cache
    (`--cache-ram`) is off: no prompt repeats, so saving idle slots would be pure overhead."""
    return [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * max_model_len), "--no-kv-unified", "-cb",
            "-t", str(threads), "-tb", str(threads), "-b", str(batch), "-ub", str(batch),
            "--cache-ram", "0", "--no-webui"]


def parse_completion_stream(lines: Iterable[tuple[float, bytes]]
                            ) -> tuple[list[float], dict[str, Any]]:
    """(time of each token, the final chunk) from the SSE lines of a streamed `/completion`,
    each line with the time it was read.

    A chunk carries one token (`tokens`) and the number generated so far (`tokens_predicted`);
    the server holds back a token that ends inside a UTF-8 character and sends it with the next
    one, so a chunk that completes n tokens counts n, all at its time, when the client saw
    them. The final chunk (`stop: true`) carries no token. Keep-alive comments (`:`) and blank
    lines are skipped; an `error` payload raises."""
    times: list[float] = []
    for t, raw in lines:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, `: ping` comments, `event:` lines
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"llama-server streamed an error: {chunk['error']}")
        if chunk.get("stop"):
            return times, chunk
        if chunk.get("tokens"):
            predicted = int(chunk.get("tokens_predicted", len(times) + len(chunk["tokens"])))
            times += [t] * max(predicted - len(times), len(chunk["tokens"]))
    raise RuntimeError(f"llama-server's stream ended without its final chunk after "
                       f"{len(times)} tokens")


def free_port() -> int:
    """A loopback TCP port that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "\n".join(f.read().splitlines()[-n:])


@contextlib.contextmanager
def server_process(command: list[str], port: int, *, name: str = "llama-server",
                   ready_timeout_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """Runs `command` (an HTTP server, `name` in messages, listening on `port`) until the block
    ends; returns once
    `GET /health` answers 200. A server that exits or is not ready in time raises with the tail
    of its log; the server is always terminated, killed if it does not stop."""
    log = tempfile.NamedTemporaryFile("w+b", prefix=f"{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}) before it was ready; "
                                   f"`{' '.join(command)}` logged:\n{_tail(log.name)}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    break
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {ready_timeout_s:.0f} s "
                                   f"(GET /health); it logged:\n{_tail(log.name)}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.remove(log.name)


def stream_completion(port: int, item: WorkItem, timeout_s: float = 600.0) -> list[float]:
    """Sends one request to llama-server's `/completion`, streamed; the time of each token.
    Greedy, EOS ignored (`ignore_eos` bans every end-of-generation token), and no prompt
    cache, so each request computes its whole prompt as infer's do."""
    body = json.dumps({"prompt": list(item.prompt_ids), "n_predict": item.output_len,
                       "temperature": 0.0, "stream": True, "cache_prompt": False,
                       "ignore_eos": True, "n_probs": 0})
    # The timeout bounds each socket read: a request queued for a slot may wait long for its
    # first byte, but a server gone silent for `timeout_s` is a failure, not a wait.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/completion", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:500]!r}")
        times, final = parse_completion_stream((time.perf_counter(), line) for line in resp)
    finally:
        conn.close()
    if len(times) != item.output_len or final.get("tokens_predicted") != item.output_len:
        raise RuntimeError(f"llama-server streamed {len(times)} tokens (final chunk: "
                           f"{final.get('tokens_predicted')} predicted, stop_type "
                           f"{final.get('stop_type')!r}) for {item.output_len} asked")
    return times


def serve_llama_server(llama_server: str, gguf_path: str, work: list[WorkItem], slots: int,
                       max_model_len: int, batch: int, desc: str):
    """llama.cpp's HTTP server with continuous batching over `slots` slots. Each request is
    sent at its arrival time from a thread of its own and streamed back; a request that finds
    every slot busy waits in the server's queue, as in infer's. Returns (metrics, start, wall
    s) as `serve_llamacpp` does."""
    from tqdm import tqdm

    from infer.engine.request import RequestMetrics

    port = free_port()
    command = llama_server_command(llama_server, gguf_path, port=port, slots=slots,
                                   max_model_len=max_model_len, threads=os.cpu_count() or 2,
                                   batch=batch)
    print("llama-server:", " ".join(command))
    stop = threading.Event()

    def send(item: WorkItem) -> list[float]:
        # Event.wait, not sleep: a failed run wakes the requests still waiting to be sent.
        if stop.wait(max(0.0, start + item.arrival_s - time.perf_counter())):
            raise RuntimeError("cancelled")
        return stream_completion(port, item)

    with server_process(command, port):
        # Untimed, as infer's engine is warmed up before its clock starts.
        stream_completion(port, dataclasses.replace(work[0], output_len=2))
        bar = tqdm(total=len(work), desc=desc, leave=False)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(work))
        try:
            start = time.perf_counter()
            futures = [pool.submit(send, w) for w in work]
            for done in concurrent.futures.as_completed(futures):
                done.result()  # the first failure ends the run
                bar.update(1)
            wall = time.perf_counter() - start
        finally:
            stop.set()
            # Not waiting: stopping the server ends the streams still open.
            pool.shutdown(wait=False, cancel_futures=True)
            bar.close()
    metrics = [RequestMetrics.from_token_times(start + w.arrival_s, f.result(),
                                               len(w.prompt_ids))
               for w, f in zip(work, futures)]
    return metrics, start, wall
