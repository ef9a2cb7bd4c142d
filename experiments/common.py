"""Shared by the experiment scripts: environment record, machine ceilings, timing, JSONL output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "results")


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_revision(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "num_devices": jax.device_count(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, its result blocked on before the clock stops."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_ceilings(copy_bytes: int = 1 << 30, matmul_n: int = 2048,
                     dtype: jnp.dtype = jnp.float32) -> dict[str, float]:
    """This machine's copy bandwidth (bytes read + written per second, through XLA) and dense
    matmul FLOP/s, measured now, on the default device."""
    n = copy_bytes // 4
    # Donated, so the output reuses the input's pages: a fresh 1 GiB output every call would
    # time the kernel's page faults rather than the memory bus.
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = [jnp.ones((n,), jnp.float32)]

    def step() -> jax.Array:
        box[0] = copy(box[0])
        return box[0]

    bandwidth = 2 * n * 4 / median_time(step, repeats=7)
    del box
    a = jnp.asarray(np.random.default_rng(0).standard_normal((matmul_n, matmul_n)), dtype)
    mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    flops = 2 * matmul_n**3 / median_time(lambda: mm(a), repeats=5)
    return {"copy_bandwidth_Bps": bandwidth, "matmul_flops": flops,
            "matmul_dtype": jnp.dtype(dtype).name}


class JsonlWriter:
    """Appends one JSON object per line; every row carries the run's environment."""

    def __init__(self, path: str, env: dict[str, Any] | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.env = environment() if env is None else env

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**row, "env": self.env}, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """rows as a Markdown table; columns are (key, header) and floats print with 3 significant
    figures or as integers when large."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(h for _, h in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def real_text(min_chars: int, offset: int = 0) -> str:
    """English prose and code that ships with CPython (pydoc's topic help), no download."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    if offset + min_chars > len(text):
        raise ValueError(f"asked for {min_chars} chars at {offset}; pydoc topics hold {len(text)}")
    return text[offset:offset + min_chars]


def run_experiment(main: Callable[[list[str]], None], experiment_flags: Any) -> None:
    """`app.run` for an experiment whose flags live in their own `flags.FlagValues`, so that
    experiment modules can be imported side by side (tests, notebooks, one experiment calling
    another) without redefining each other's flags. absl's own flags are parsed first."""
    from absl import app, flags

    app.run(main, flags_parser=lambda argv: experiment_flags(flags.FLAGS(argv, known_only=True)))


def load_hf_smollm2(dtype: str) -> Any:
    """HF transformers' LlamaForCausalLM from the bundled SmolLM2 GGUF, in eval mode: the peer
    that the benchmarks run on the same requests."""
    import torch
    import transformers

    from infer.checkpoint import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path),
        dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
    return model.eval()
