"""/health is 503 while warm-up compiles, 200 after, and nothing compiles while serving the
shapes warm-up covered; the static scheduler needs a finite wait behind a server."""

from __future__ import annotations

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


def test_a_data_parallel_server_gives_one_engines_tokens(smollm2_4_layers) -> None:
    """data_parallel_size=2: two engine replicas behind the one worker thread."""
    import concurrent.futures

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
