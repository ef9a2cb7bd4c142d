"""Process-level JAX settings that the entry points (CLI, experiments) apply before JAX starts.

XLA:CPU matmul flags were tried and are not set: routing matmuls through oneDNN
(--xla_cpu_use_onednn=true with the YNNPACK fusions off) sped a [2048, 576] x [576, 1536]
product from 135 to 164 GFLOP/s, but made the [M, 576] x [576, 49152] vocabulary projection take
100-125 ms for M = 2..6 instead of 11 (measured on the development machine), which a serving
engine hits at every small decode batch.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Callable

import jax


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_revision() -> str:
    """The checkout's commit (short), with "-dirty" when tracked files differ from it;
    "unknown" outside a git checkout (an installed wheel)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def configure_xla_cpu() -> None:
    """Quiets JAX's notice that it found no TPU (it logs one at every start on a CPU machine)."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def logger() -> logging.Logger:
    """infer's logger ("infer"), at INFO. When the application has configured no logging, its
    lines go to stderr as `infer: ...`; otherwise they reach the application's handlers."""
    log = logging.getLogger("infer")
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("infer: %(message)s"))
        log.addHandler(handler)
    return log


def cache_root() -> str:
    """Where infer keeps what it builds once per machine (compiled programs, CPU kernels):
    $INFER_CACHE_DIR, else ~/.cache/infer."""
    return os.environ.get("INFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                             "infer")


def enable_compilation_cache(path: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (default `~/.cache/infer/xla`, or
    $INFER_CACHE_DIR/xla): a second run of an experiment loads its compiled programs from disk
    instead of compiling them again. Returns the directory."""
    import jax

    if path is None:
        path = os.path.join(cache_root(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


class CompileCounter:
    """Counts programs made executable while active, through JAX's monitoring events. The
    event times `compile_or_get_cached`, so it fires once per program whether XLA compiles it or
    loads it from the persistent compilation cache (a program an earlier engine or process
    compiled is still one this process had not run)."""

    EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT

    def __init__(self, on_compile: Callable[[], None] | None = None) -> None:
        """`on_compile` is called at each program too (the server's Prometheus counter)."""
        self.count = 0
        self._on_compile = on_compile

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1
            if self._on_compile is not None:
                self._on_compile()

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        from jax._src import monitoring
        monitoring.unregister_event_duration_listener(self._listener)
