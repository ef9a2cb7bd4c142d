"""/health is 503 while warm-up compiles, 200 after, and nothing compiles while serving the
shapes warm-up covered; the static scheduler needs a finite wait behind a server; an engine
that dies answers every client, and a client gone early is no server error."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from tests.serve.conftest import start_server


def test_health_waits_for_warmup_and_serving_compiles_nothing(smollm2_4_layers) -> None:
    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=2, max_model_len=32,
                                         max_prefill_tokens=16, warmup=True)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 503
        r = httpx.post(f"{running.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 300
        while httpx.get(f"{running.url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for prompt in ("Hello there", "A much longer prompt, of more than a few tokens, here"):
            r = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 8, "n": 2, "temperature": 0.7})
            assert r.status_code == 200, r.text
        text = httpx.get(f"{running.url}/metrics").text
        assert 'infer:compiles_after_warmup{engine="0",model_name="smollm2-4l"} 0.0' in text
        assert 'infer:compiles_total{engine="0",model_name="smollm2-4l"} 0.0' not in text
    finally:
        http.should_exit = True
        thread.join(30)


def test_static_scheduler_needs_a_finite_wait(smollm2_4_layers) -> None:
    with pytest.raises(ValueError, match="static_max_wait_s"):
        start_server(smollm2_4_layers, scheduler="static")


def test_a_static_batch_waits_for_its_deadline_without_stepping(smollm2_4_layers) -> None:
    """One request under the static scheduler waits out static_max_wait_s for company: the
    engine thread sleeps through it, running no idle steps."""
    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=4, max_model_len=32,
                                         max_prefill_tokens=16, scheduler="static",
                                         static_max_wait_s=0.5)
    try:
        start = time.monotonic()
        r = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert time.monotonic() - start >= 0.5
        kinds = [rec.kind for rec in running.server.engine.records]
        assert "idle" not in kinds and len(kinds) <= 4, kinds  # a prefill and 3 tokens
    finally:
        http.should_exit = True
        thread.join(30)


def test_a_data_parallel_server_gives_one_engines_tokens(smollm2_4_layers) -> None:
    """data_parallel_size=2: two engine replicas behind the one worker thread."""

    from infer import SamplingParams
    from infer.parallel.replicas import ReplicatedEngine

    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=2, max_model_len=64,
                                         max_prefill_tokens=16, data_parallel_size=2)
    try:
        assert isinstance(running.server.engine, ReplicatedEngine)
        prompts = ["The capital of France is", "def add(a, b):", "Rivers of Europe:", "Once"]

        def complete(prompt: str) -> str:
            r = httpx.post(f"{running.url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, prompts))
        from infer import LLM
        one = LLM.from_loaded(*smollm2_4_layers, max_num_seqs=2, max_model_len=64,
                              max_prefill_tokens=16)
        want = one.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert texts == [w.text for w in want]
        assert all(r.num_steps > 0 for r in running.server.engine.replicas)  # both served
        text = httpx.get(f"{running.url}/metrics").text
        assert 'vllm:num_requests_running{engine="0",model_name="smollm2-4l"} 0.0' in text
    finally:
        http.should_exit = True
        thread.join(30)


def test_an_engine_that_fails_mid_stream_ends_the_stream_with_an_error(smollm2_4_layers) -> None:
    """The engine thread dies after a few steps: the stream already open gets an error event
    and [DONE] (not a usage chunk for choices that never finished), /health turns 503."""
    import json

    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=2, max_model_len=64,
                                         max_prefill_tokens=16)
    engine = running.server.engine
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    try:
        with httpx.stream("POST", f"{running.url}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        assert "device lost" in payloads[-1]["error"]["message"]
        assert all(p.get("choices") for p in payloads[:-1])  # tokens, then the error: no usage
        assert len(payloads) > 1
        assert httpx.get(f"{running.url}/health").status_code == 503
    finally:
        http.should_exit = True
        thread.join(30)


def test_a_job_stream_ends_when_its_error_is_read_not_when_it_arrives() -> None:
    """Tokens and then an error can arrive before the stream's reader wakes: the reader must
    still see the tokens, then the error, and only then is the stream done."""
    import asyncio
    from types import SimpleNamespace

    from infer.serve.app import _JobStream
    from infer.serve.protocol import Job

    job = Job("completion", "cmpl-x", "m", 0, [SimpleNamespace(request_id="cmpl-x-0.0")], 1,
              True, False, False)
    stream = _JobStream(job)
    tokens = [SimpleNamespace(request_id="cmpl-x-0.0", finished=False)]
    stream.put(tokens)
    stream.put(RuntimeError("device lost"))
    assert not stream.done

    async def read() -> list:
        seen = []
        while not stream.done:
            seen.append(await stream.next())
        return seen

    first, error = asyncio.run(read())
    assert first is tokens and isinstance(error, RuntimeError) and stream.done


def test_requests_queued_while_the_engine_dies_hear_of_it(smollm2_4_layers) -> None:
    """Requests submitted while the step that kills the engine thread runs wait in its inbox,
    not yet in the engine: each must still get an error, not wait for ever."""
    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=2, max_model_len=64,
                                         max_prefill_tokens=16)
    engine, worker = running.server.engine, running.server.worker
    entered, fail = threading.Event(), threading.Event()

    def failing_step():
        entered.set()
        fail.wait(60)
        raise RuntimeError("device lost")

    engine.step = failing_step
    url = f"{running.url}/v1/completions"
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(httpx.post, url, timeout=60,
                                json={"prompt": "Once upon a time", "max_tokens": 4})
            assert entered.wait(60)
            queued = [pool.submit(httpx.post, url, timeout=20, json={
                "prompt": "Hello", "max_tokens": 4, "stream": stream})
                for stream in (False, True, False)]
            deadline = time.monotonic() + 60
            while worker._inbox.qsize() < len(queued):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            fail.set()
            assert first.result().status_code == 500
            for q in queued:
                r = q.result()  # httpx.ReadTimeout: the request was never answered
                assert r.status_code in (200, 500), r.text
                assert "device lost" in r.text, r.text  # a stream's 200 carries an error event
        assert httpx.get(f"{running.url}/health").status_code == 503
    finally:
        fail.set()
        http.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_fails_while_taking_a_request_answers_it(smollm2_4_layers,
                                                                 stream: bool) -> None:
    """The engine thread dies inside engine.submit: the job was out of the inbox and not yet
    among the requests the engine serves, so no one told it and its client waited for ever.
    /metrics then still counted the requests the dying thread freed as running."""
    http, thread, running = start_server(smollm2_4_layers, max_num_seqs=2, max_model_len=64,
                                         max_prefill_tokens=16)
    engine = running.server.engine
    url = running.url
    try:
        # One request running when the engine dies: its pages are freed, and /metrics says so.
        step = engine.step
        started = threading.Event()

        def slow_step():
            started.set()
            time.sleep(0.05)
            return step()

        engine.step = slow_step
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running_one = pool.submit(httpx.post, f"{url}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True})
            assert started.wait(60)

            def failing_submit(request, callback=None):
                raise RuntimeError("injected: submit failed")

            engine.submit = failing_submit
            r = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 4, "stream": stream})
            assert r.status_code in (200, 500) and "submit failed" in r.text, r.text
            assert running_one.result().status_code == 500
        assert httpx.get(f"{url}/health").status_code == 503
        assert not engine.scheduler.seqs
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r"^vllm:num_requests_running\S* 0\.0$", metrics, re.M), metrics
    finally:
        http.should_exit = True
        thread.join(30)


def test_a_client_gone_while_sending_its_body_is_no_internal_error(smollm2_4_layers,
                                                                   caplog) -> None:
    """The body's upload ends with the connection: Starlette raises ClientDisconnect from
    request.body(), which the catch-all answered as a 500 and logged with a traceback."""
    http, thread, running = start_server(smollm2_4_layers)
    host, port = running.url.removeprefix("http://").split(":")
    try:
        with caplog.at_level(logging.INFO, logger="infer"):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                          b'{"prompt": "Hi"')
                time.sleep(0.3)
            time.sleep(0.5)
            assert httpx.get(f"{running.url}/health").status_code == 200
        assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    finally:
        http.should_exit = True
        thread.join(30)
