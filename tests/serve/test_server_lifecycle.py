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
