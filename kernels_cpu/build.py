"""Building, loading and registering infer's C++ CPU kernels (XLA FFI custom calls).

Each kernel is one C++ file in this folder (with the shared `parallel.h`), built on first use
with the machine's C++ compiler for the machine's own CPU (`-march=native`, a few seconds) into
`~/.cache/infer/kernels` (or $INFER_CACHE_DIR/kernels), keyed by the sources, the compiler, the
jaxlib headers, the CPU and the compile flags. The kernels need x86-64 with AVX-512 (F, BW);
without it, or without a compiler, `Kernel.available()` is False and the caller keeps XLA's
computation.
`INFER_CPU_KERNELS=0` turns them all off, to measure XLA against them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax

from infer.platform import cache_root

HERE = Path(__file__).parent
SHARED_HEADERS = (HERE / "parallel.h",)

# Engine threads trace their first programs concurrently; the lock keeps them from each
# building and registering a kernel.
_LOADING = threading.Lock()


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (else the processor's name): what the
    kernels are compiled for, and what picks `kernels_cpu.dense.ROWS`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> list[str]:
    """$CXX as make reads it: a command and its arguments (`ccache g++`, `g++ -w`)."""
    return shlex.split(os.environ.get("CXX", "")) or ["g++"]


# What every kernel is compiled with: part of the cache key (`library_path`), so that changing
# them here rebuilds the kernels instead of loading the libraries the old ones built.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


def _command(source: Path, extra_flags: tuple[str, ...], output: str) -> list[str]:
    """The compiler's command line: FLAGS, then `extra_flags` (after -march=native's features,
    so that they can turn one off), the headers and `source`, into `output`."""
    return [*_compiler(), *FLAGS, *extra_flags, "-isystem", jax.ffi.include_dir(), "-I",
            str(HERE), str(source), "-o", output]


def library_path(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where `build` keeps `source`'s library: named by a hash of the sources, the compiler and
    its version, the jax headers, the CPU, FLAGS and `extra_flags` (not the paths: a checkout
    elsewhere with the same sources shares the library)."""
    run = subprocess.run([*_compiler(), "--version"], capture_output=True, text=True, check=True)
    # Its first line names the compiler; some wrappers print it on stderr, or nothing.
    version = next(iter((run.stdout.strip() or run.stderr.strip()).splitlines()), "")
    texts = [source.read_text(), *(h.read_text() for h in SHARED_HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *_compiler(), version, jax.ffi.include_dir(),
                                     jax.__version__, cpu_flags(), *FLAGS, *extra_flags]
                                    ).encode()).hexdigest()[:16]
    return Path(cache_root()) / "kernels" / f"libinfer_{source.stem}_{key}.so"


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compiles `source` once per (sources, compiler, headers, CPU, command line) and returns
    the library (`library_path`). `extra_flags` go after -march=native (tests build the paths
    of CPUs without AVX512-BF16 with -mno-avx512bf16)."""
    library = library_path(source, extra_flags)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    print(f"infer: building the CPU {source.stem} kernel (once per machine, a few seconds)",
          file=sys.stderr)
    # Built beside its final name and renamed, so that processes building at once (pytest
    # workers) never load a half-written file. Into a new file of a folder of its own: the
    # compiler gives a file it creates the usual mode (readable by all, as the umask allows),
    # where one that mkstemp made (0600) stayed unreadable to the other users of a shared
    # cache, who would find the library and fail to load it.
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        partial = os.path.join(folder, library.name)
        subprocess.run(_command(source, tuple(extra_flags), partial), capture_output=True,
                       text=True, check=True)
        os.replace(partial, library)
    return library


def build_failure(error: Exception) -> str:
    """The line of a failed build that says why: the compiler's first `error:` line (GCC ends
    its output with the offending source line and a caret, not the reason), else its last."""
    lines = (getattr(error, "stderr", "") or str(error) or repr(error)).strip().splitlines()
    return next((line.strip() for line in lines if "error:" in line),
                lines[-1].strip() if lines else repr(error))


class Kernel:
    """One C++ kernel: `source` exports the FFI handler `symbol`, registered as `target`."""

    def __init__(self, source: Path, symbol: str, target: str) -> None:
        self.source, self.symbol, self.target = source, symbol, target
        self._register = functools.cache(self._register_build)
        self._load = functools.cache(self._load_default)
        self._library = functools.cache(
            lambda flags: ctypes.cdll.LoadLibrary(str(build(self.source, flags))))

    def available(self) -> bool:
        """Whether the kernel is built and registered with XLA:CPU. False when
        INFER_CPU_KERNELS=0, off x86-64, or when the build fails (no compiler, no AVX-512); the
        reason goes to stderr once."""
        with _LOADING:
            return self._load()

    def register(self, extra_flags: tuple[str, ...] = ()) -> str:
        """Builds the kernel with `extra_flags` (see `build`), loads it and registers it with
        XLA:CPU; returns its target name (`target` for the default build)."""
        return self._register(tuple(extra_flags))

    def _load_default(self) -> bool:
        if os.environ.get("INFER_CPU_KERNELS", "1") == "0":
            return False
        if platform.machine() not in ("x86_64", "AMD64"):
            return False
        try:
            self._register(())
        except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
            print(f"infer: the CPU {self.source.stem} kernel is off, XLA is used instead: "
                  f"{build_failure(error)}", file=sys.stderr)
            return False
        return True

    def library(self, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
        """The loaded build (once per flags), for the plain C functions it exports."""
        return self._library(tuple(extra_flags))

    def _register_build(self, extra_flags: tuple[str, ...]) -> str:
        library = self.library(extra_flags)
        target = self.target
        if extra_flags:
            target += "_" + hashlib.sha256("\0".join(extra_flags).encode()).hexdigest()[:8]
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, self.symbol)),
                                    platform="cpu")
        return target
