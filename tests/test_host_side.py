"""The host side imports no JAX: the scheduler, the page allocator, the prefix cache, requests and
sampling parameters are plain Python, so a server process or a scheduler test never pays for
JAX's import and device set-up."""

from __future__ import annotations

import subprocess
import sys

HOST_MODULES = ("infer.engine.scheduler", "infer.engine.plan", "infer.engine.request",
                "infer.cache.page_allocator", "infer.cache.prefix_cache", "infer.sampling_params")


def test_host_modules_import_without_jax() -> None:
    code = ("import importlib, sys\n"
            f"for name in {HOST_MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "from infer import SamplingParams\n"
            "SamplingParams(temperature=0.5, top_k=3)\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
            "print(','.join(loaded))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"host modules loaded {out.stdout.strip()}"


def test_the_check_sees_jax_when_it_is_loaded() -> None:
    """The same probe over a device module reports JAX: the test above can fail."""
    code = ("import sys, infer.sampling\n"
            "print('jax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
