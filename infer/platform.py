"""Process-level JAX settings that the entry points (CLI, experiments) apply before JAX starts.

XLA:CPU matmul flags were tried and are not set: routing matmuls through oneDNN
(--xla_cpu_use_onednn=true with the YNNPACK fusions off) sped a [2048, 576] x [576, 1536]
product from 135 to 164 GFLOP/s, but made the [M, 576] x [576, 49152] vocabulary projection take
100-125 ms for M = 2..6 instead of 11 (measured on the development machine), which a serving
engine hits at every small decode batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from typing import Callable, Iterator

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


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) until the block ends, then raises KeyboardInterrupt; a second
    Ctrl-C raises at once. An engine step hands its KV cache to a program that donates it and
    keeps what comes back: stopped between the two, the engine would hold freed buffers, and
    Python checks for signals right after a long device call returns. Only in the main
    thread, and only over Python's own SIGINT handler (an application's is left alone)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    held: list[bool] = []

    def hold(signum: int, frame: object) -> None:
        if held:  # asked twice: the caller would rather stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        held.append(True)
        logger().info("interrupt held until this engine step ends (press Ctrl-C again to stop "
                      "at once)")

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


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


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (default `~/.cache/infer/xla`, or
    $INFER_CACHE_DIR/xla): a second run of an experiment loads its compiled programs from disk
    instead of compiling them again. Returns the directory; None in a multi-process job
    (`jax.distributed`), where it stays off (`infer.parallel.distributed.initialize` turns it
    off): with it on, the two processes of tests/parallel/test_multihost.py ran steps whose
    collectives disagreed (gloo: "received data size doesn't match"), each process with a
    fresh directory of its own or not."""
    import jax

    if jax.distributed.is_initialized():
        logger().info("a multi-process job: the persistent compilation cache stays off")
        return None
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
