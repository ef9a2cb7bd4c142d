"""A server on 127.0.0.1 (uvicorn in a thread, port 0) over SmolLM2's first 4 layers: the real
tokenizer and chat template, programs that compile in seconds."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


@dataclasses.dataclass
class RunningServer:
    url: str
    server: object  # infer.serve.app.Server
    llm: object  # an LLM over the same model, for the expected outputs

    def client(self, **kw) -> "openai.OpenAI":
        # max_retries=0: the client's retries would double requests in the abort and error tests
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="EMPTY", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)


ENGINE = dict(max_num_seqs=8, max_prefill_tokens=32, max_model_len=128, page_size=8)


def start_server(model_triple, warmup: bool = False, **engine
                 ) -> tuple[object, threading.Thread, RunningServer]:
    import uvicorn

    from infer import LLM
    from infer.serve.app import Server
    from infer.serve.protocol import ServedModel

    config, model, tokenizer = model_triple
    settings = {**ENGINE, **engine}
    llm = LLM.from_loaded(config, model, tokenizer, **settings)
    server = Server(llm.engine, ServedModel(name="smollm2-4l", root="smollm2-135m[:4]",
                                            max_model_len=llm.engine.config.max_model_len,
                                            max_num_seqs=settings["max_num_seqs"],
                                            tokenizer=tokenizer), warmup=warmup)
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0,
                                         log_level="warning", lifespan="on"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    port = http.servers[0].sockets[0].getsockname()[1]
    # The expected outputs come from a second LLM over the same weights: its own engine, so
    # nothing the test does to it touches the server's.
    expected = LLM.from_loaded(config, model, tokenizer, **settings)
    return http, thread, RunningServer(f"http://127.0.0.1:{port}", server, expected)


@pytest.fixture(scope="module")
def running(smollm2_4_layers):
    http, thread, running = start_server(smollm2_4_layers)
    yield running
    http.should_exit = True
    thread.join(30)
