"""The llama-server peer of the serving benchmark: its SSE stream is counted token by token
(the final chunk is no token, a held-back token still counts), a missing binary is one line
before any work, the F32/BF16 GGUF is made once, a server that never gets ready is an error and
not a hang, and the requests are sent at their arrival times and timed. A fake server (a Python
script speaking llama-server's protocol) runs everything without the binary; with $LLAMA_SERVER
set, the real one serves three tiny requests."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import sys
import textwrap
import time

import pytest

from experiments import llama_server, serve
from experiments.llama_server import parse_completion_stream
from experiments.serve import WorkItem


def sse(*chunks: dict | str) -> list[bytes]:
    """The lines of an SSE stream: each chunk as a `data:` line and the blank line after it; a
    str is sent as it is (a comment)."""
    lines = []
    for c in chunks:
        lines += [c.encode() if isinstance(c, str) else b"data: " + json.dumps(c).encode() + b"\n",
                  b"\n"]
    return lines


def token(tok: int, predicted: int) -> dict:
    return {"index": 0, "content": f"t{tok}", "tokens": [tok], "stop": False, "id_slot": -1,
            "tokens_predicted": predicted, "tokens_evaluated": 5}


FINAL = {"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": 3,
         "stop_type": "limit"}


def test_the_stream_counts_token_chunks_with_their_times_and_not_the_final_chunk() -> None:
    lines = sse(token(29, 1), ": ping\n", token(6693, 2), token(1183, 3), FINAL)
    times, final = parse_completion_stream(enumerate(lines))
    # Each token at the time its data line was read (its index here); the ping and the blank
    # separators are no tokens, and the final chunk is returned, not counted.
    assert times == [0, 4, 6]
    assert final["stop"] and final["tokens_predicted"] == 3


def test_a_token_held_back_inside_a_utf8_character_counts_at_the_next_chunks_time() -> None:
    # The server sends nothing for a token that ends mid-character: the next chunk completes two.
    times, _ = parse_completion_stream(enumerate(sse(token(1, 1), token(3, 3), FINAL)))
    assert times == [0, 2, 2]


def test_an_error_or_a_stream_cut_short_raises() -> None:
    with pytest.raises(RuntimeError, match="streamed an error"):
        parse_completion_stream(enumerate(sse(token(1, 1), {"error": {"code": 500}})))
    with pytest.raises(RuntimeError, match="without its final chunk after 2 tokens"):
        parse_completion_stream(enumerate(sse(token(1, 1), token(2, 2))))
    with pytest.raises(RuntimeError, match="without its final chunk after 1 tokens"):
        parse_completion_stream(enumerate(sse(token(1, 1)) + [b"data: [DONE]\n"]))


def executable(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_missing_binary_skips_the_peer_with_one_line_before_any_work(tmp_path, monkeypatch,
                                                                      capsys) -> None:
    import infer.io.loader

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(infer.io.loader, "load_on_host", load)
    monkeypatch.setattr(llama_server, "LLAMA_SERVER_CACHE", str(tmp_path / "cache"))
    args = dict(num_requests=2, rate=1.0, prompt_min=4, prompt_max=8, output_shape=1.5,
                output_scale=2.0, output_cap=4, max_num_seqs=2, max_prefill_tokens=16,
                max_model_len=64, dtype="float32", kv_cache_dtype="auto", policies=["static"],
                seed=0, out=str(tmp_path / "serve.jsonl"))
    missing = str(tmp_path / "build" / "llama-server")
    with pytest.raises(Loaded):  # the check ran, then the work began
        serve.run(peers=["llamaserver"], llama_server=missing, **args)
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipping" in line]
    assert len(lines) == 1
    assert lines[0].startswith(f"[serve] skipping peer 'llamaserver': no executable at "
                               f"{missing!r}; build it from the llama-cpp-python 0.3.36 sdist")
    assert "--llama_server=PATH" in lines[0]
    assert serve.serve_peers(["llamaserver", "none"], "", "float32", "serve") == []
    assert "no binary given" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"unknown peers \['vllm'\].*'llamaserver'"):
        serve.run(peers=["llamaserver", "vllm"], llama_server=missing, **args)

    # A binary without llama-quantize beside it can run only if the GGUF is already made.
    binary = executable(tmp_path / "llama-server", "#!/bin/sh\n")
    assert serve.serve_peers(["llamaserver"], binary, "bfloat16", "serve") == []
    assert "is not cached and there is no llama-quantize" in capsys.readouterr().out
    executable(tmp_path / "llama-quantize", "#!/bin/sh\n")
    assert serve.serve_peers(["llamaserver", "hf"], binary, "bfloat16", "serve") == [
        "llamaserver", "hf"]  # in the order asked


def test_the_gguf_in_the_runs_dtype_is_made_once_and_a_failure_leaves_no_file(tmp_path) -> None:
    calls = tmp_path / "calls"
    quantize = executable(tmp_path / "llama-quantize", textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {calls}
        [ "$4" = F32 ] || {{ echo "unknown type $4" >&2; exit 1; }}
        cp "$2" "$3"
        """))
    src = tmp_path / "Model.Q4_1.gguf"
    src.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    out = llama_server.ensure_llama_server_gguf(str(src), "float32", quantize, str(cache))
    assert out == str(cache / "Model.Q4_1.F32.gguf") and pathlib.Path(out).read_bytes() == b"GGUF"
    assert llama_server.ensure_llama_server_gguf(str(src), "float32", quantize, str(cache)) == out
    assert len(calls.read_text().splitlines()) == 1  # cached: llama-quantize ran once
    assert calls.read_text().split()[:2] == ["--allow-requantize", str(src)]
    with pytest.raises(RuntimeError, match="llama-quantize failed .*\n.*unknown type BF16"):
        llama_server.ensure_llama_server_gguf(str(src), "bfloat16", quantize, str(cache))
    assert sorted(p.name for p in cache.iterdir()) == ["Model.Q4_1.F32.gguf"]


def test_the_command_gives_each_slot_max_model_len_and_every_core() -> None:
    cmd = llama_server.llama_server_command("/bin/llama-server", "/m.gguf", port=4242, slots=4,
                                     max_model_len=512, threads=8, batch=256)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "/bin/llama-server" and flags["-m"] == "/m.gguf"
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "4242")
    assert (flags["-np"], flags["-c"], flags["-t"], flags["-b"]) == ("4", "2048", "8", "256")
    assert "--no-kv-unified" in cmd  # else -c would be one pool, not max_model_len per slot


def test_a_server_that_dies_or_never_gets_ready_raises_with_its_log(tmp_path) -> None:
    port = llama_server.free_port()
    with pytest.raises(RuntimeError, match=r"exited \(3\) before it was ready(.|\n)*bad model"):
        with llama_server.server_process(["sh", "-c", "echo bad model >&2; exit 3"], port):
            pass
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not ready within 1 s(.|\n)*loading"):
        with llama_server.server_process(
                ["sh", "-c", f"echo $$ > {pid_file}; echo loading; exec sleep 60"], port,
                ready_timeout_s=1.0):
            pass
    assert time.monotonic() - start < 15
    with pytest.raises(ProcessLookupError):  # terminated, not left running
        os.kill(int(pid_file.read_text()), 0)


# A stand-in for llama-server: its flags, /health (503 while "loading"), and /completion
# streamed one token per chunk, each request logged to $FAKE_LOG.
FAKE_SERVER = f"""#!{sys.executable}
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if "FAKE_PID" in os.environ:
    open(os.environ["FAKE_PID"], "w").write(str(os.getpid()))
ready_at = time.monotonic() + 0.3
lock = threading.Lock()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() > ready_at
        self.send_response(200 if ok else 503)
        self.end_headers()

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock, open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({{"t": time.time(), "req": req, "args": args}}) + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = req["n_predict"] - int(os.environ.get("FAKE_SHORT", "0"))
        for i in range(1, n + 1):
            time.sleep(0.02)
            chunk = {{"content": "x", "tokens": [i], "stop": False, "tokens_predicted": i}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
            self.wfile.flush()
        final = {{"content": "", "tokens": [], "stop": True, "tokens_predicted": n}}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\\n\\n")

ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()
"""

WORK = [WorkItem(0.0, (1, 2, 3), 4), WorkItem(0.3, (4, 5), 1), WorkItem(0.35, (6,), 6)]


def test_requests_are_sent_at_their_arrival_times_and_timed_token_by_token(
        tmp_path, monkeypatch) -> None:
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    binary = executable(tmp_path / "llama-server", FAKE_SERVER)
    before = time.time()
    metrics, start, wall = llama_server.serve_llama_server(binary, "/m.gguf", WORK, slots=2,
                                                    max_model_len=64, batch=32, desc="fake")
    start_wall = time.time() - (time.perf_counter() - start)  # the clock's start, as time.time
    assert [m.num_output_tokens for m in metrics] == [4, 1, 6]
    assert [len(m.itl_s) for m in metrics] == [3, 0, 5]
    assert metrics[1].tpot_s is None and metrics[2].tpot_s > 0.01  # the fake's 20 ms a token
    for m, w in zip(metrics, WORK):
        assert m.arrival_s == pytest.approx(start + w.arrival_s)
        assert 0 < m.ttft_s <= m.e2e_s < wall and m.num_prompt_tokens == len(w.prompt_ids)
    warmup, *sent = sorted((json.loads(line) for line in log.read_text().splitlines()),
                           key=lambda r: r["t"])
    # One untimed request first, as infer's engine is warmed up before its clock starts.
    assert (warmup["req"]["prompt"], warmup["req"]["n_predict"]) == (list(WORK[0].prompt_ids), 2)
    assert warmup["t"] < start_wall
    assert [tuple(r["req"]["prompt"]) for r in sent] == [w.prompt_ids for w in WORK]
    # The clock starts once the server is ready (>= 0.3 s here), each request at its offset.
    t0 = sent[0]["t"]
    assert t0 - before >= 0.3
    assert [r["t"] - t0 for r in sent] == pytest.approx([0.0, 0.3, 0.35], abs=0.1)
    req = sent[0]["req"]
    assert (req["n_predict"], req["temperature"], req["stream"], req["cache_prompt"],
            req["ignore_eos"]) == (4, 0.0, True, False, True)
    assert (sent[0]["args"]["-np"], sent[0]["args"]["-c"]) == ("2", "128")


def test_a_request_short_of_its_tokens_fails_the_run_and_stops_the_server(
        tmp_path, monkeypatch) -> None:
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "requests.jsonl"))
    monkeypatch.setenv("FAKE_PID", str(pid_file))
    monkeypatch.setenv("FAKE_SHORT", "1")
    binary = executable(tmp_path / "llama-server", FAKE_SERVER)
    with pytest.raises(RuntimeError, match=r"streamed 1 tokens .* for 2 asked"):  # the warm-up
        llama_server.serve_llama_server(binary, "/m.gguf", WORK[:1], slots=2, max_model_len=64,
                                 batch=32, desc="fake")
    with pytest.raises(ProcessLookupError):  # the server was stopped, and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_the_real_llama_server_serves_tiny_requests_with_every_token() -> None:
    binary = os.environ.get("LLAMA_SERVER", "")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("no llama-server binary: set LLAMA_SERVER to one (see experiments/serve.py)")
    from infer.io.checkpoint import smollm2_gguf_path

    gguf = llama_server.ensure_llama_server_gguf(smollm2_gguf_path(), "float32",
                                          llama_server.llama_quantize_path(binary))
    # Two slots for three requests: the third waits in the server's queue for a free slot.
    work = [WorkItem(0.0, (504, 3458, 282, 253, 1345), 5), WorkItem(0.01, (1, 2, 3), 1),
            WorkItem(0.02, tuple(range(100, 140)), 8)]
    metrics, _, wall = llama_server.serve_llama_server(binary, gguf, work, slots=2, max_model_len=64,
                                                batch=64, desc="llama-server")
    assert [m.num_output_tokens for m in metrics] == [5, 1, 8]
    assert [len(m.itl_s) for m in metrics] == [4, 0, 7]
    assert all(0 < m.ttft_s <= m.e2e_s < wall for m in metrics)
