"""An OpenAI-compatible server over infer's engine:

  python -m infer.serve --model=smollm2-135m --host=127.0.0.1 --port=8000

Endpoints: /v1/completions, /v1/chat/completions (SSE when "stream": true), /v1/models, /health
(503 until warm-up has compiled every program), /metrics (Prometheus), /tokenize, /detokenize.
"""

from __future__ import annotations

import math
import os

from absl import app, flags

import infer.parallel.flags
from infer.parallel.flags import define_parallel_flags, parallel_kwargs

flags.DEFINE_string("model", "smollm2-135m", "bundled preset, GGUF file or HF directory")
flags.DEFINE_string("served_model_name", None, "the name clients send as `model` (default: "
                    "--model)")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8000, "port to listen on (0: any free one; see --port_file)")
flags.DEFINE_string("port_file", None, "write the bound port here once listening")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight dtype")
flags.DEFINE_string("kv_cache_dtype", "auto", "KV format (auto: the weights' dtype)")
flags.DEFINE_integer("max_num_seqs", 8, "requests decoded together at most")
flags.DEFINE_integer("max_model_len", 2048, "prompt + output tokens per request at most")
flags.DEFINE_integer("max_prefill_tokens", 256, "prompt tokens per engine step at most")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("num_pages", None, "KV pages in the pool (default: every slot at full "
                     "length)")
flags.DEFINE_enum("scheduler", "continuous", ["continuous", "static"], "batching policy")
flags.DEFINE_float("static_max_wait_s", 0.05, "static batching: how long a partial batch waits")
flags.DEFINE_bool("enable_prefix_caching", False, "reuse KV pages of shared prompt prefixes")
flags.DEFINE_enum("attention_backend", "reference", ["reference", "pallas"], "attention kernels")
flags.DEFINE_bool("mixed_steps", False, "prefill chunks and decode rows in one step")
flags.DEFINE_bool("warmup", True, "compile every program before /health says ok")
define_parallel_flags()
# Defined in infer.parallel.flags, so absl's --help would leave them to --helpfull.
flags.adopt_module_key_flags(infer.parallel.flags)


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    import uvicorn

    from infer import LLM
    from infer.platform import configure_xla_cpu
    from infer.serve.app import Server
    from infer.serve.protocol import ServedModel
    configure_xla_cpu()
    llm = LLM(model=f.model, dtype=f.dtype, kv_cache_dtype=f.kv_cache_dtype,
              page_size=f.page_size, max_num_seqs=f.max_num_seqs, scheduler=f.scheduler,
              enable_prefix_caching=f.enable_prefix_caching,
              attention_backend=f.attention_backend, max_model_len=f.max_model_len,
              max_prefill_tokens=f.max_prefill_tokens, num_pages=f.num_pages,
              static_max_wait_s=f.static_max_wait_s if f.scheduler == "static" else math.inf,
              mixed_steps=f.mixed_steps, **parallel_kwargs())
    server = Server(llm.engine, ServedModel(
        name=f.served_model_name or f.model, root=f.model,
        max_model_len=llm.engine.config.max_model_len,
        max_num_seqs=llm.engine.config.max_num_seqs, tokenizer=llm.tokenizer),
        warmup=f.warmup)
    config = uvicorn.Config(server.app, host=f.host, port=f.port, log_level="info",
                            lifespan="on", timeout_graceful_shutdown=5)
    http = uvicorn.Server(config)
    if f.port_file:
        _write_port_when_listening(http, f.port_file)
    http.run()


def _write_port_when_listening(http, path: str) -> None:
    """uvicorn binds in `startup`; the port is known only then (with --port=0)."""
    startup = http.startup

    async def startup_then_write(sockets=None) -> None:
        await startup(sockets)
        port = http.servers[0].sockets[0].getsockname()[1]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(port))
        os.replace(tmp, path)

    http.startup = startup_then_write


if __name__ == "__main__":
    app.run(main)
