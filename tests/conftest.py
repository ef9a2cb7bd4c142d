"""Session-wide fixtures: the real model is loaded once, by infer and by HF transformers."""

from __future__ import annotations

import os

import jax
import pytest

# Eight virtual CPU devices for the multi-device tests (tests/parallel), set before JAX starts its
# backend; every other test keeps to the default device, as a one-device program does.
VIRTUAL_DEVICES = int(os.environ.get("INFER_TEST_DEVICES", "8"))
jax.config.update("jax_num_cpu_devices", VIRTUAL_DEVICES)
# Compiling, not running, is most of the suite's time (hundreds of small step programs), and no
# test times anything: LLVM's O0 compiles a tiny engine's programs in two thirds of the time and
# runs SmolLM2's no slower. Also read by the processes tests start (multi-host workers).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory) -> str | None:
    """JAX's persistent compilation cache in a directory of this session only. Each `Engine`
    jits its steps afresh, so without it every test that builds an engine on SmolLM2 compiled
    the same 30-layer programs again; with it the second engine loads them. A fresh directory
    per session: no test ever sees a program compiled by older code."""
    import jax

    from infer.platform import enable_compilation_cache

    path = enable_compilation_cache(str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from infer.io.checkpoint import smollm2_gguf_path
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2():
    """(config, model, tokenizer) of SmolLM2-135M-Instruct in float32, loaded by infer."""
    from infer.io.loader import load
    return load("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def smollm2_4_layers(smollm2):
    """SmolLM2's first 4 layers with its final norm and head, sharing its arrays: the real
    weights, heads and page shapes for tests of a mechanism that works layer by layer (an
    attention kernel, draft bookkeeping), at an eighth of the 30-layer programs' compile time."""
    from infer.spec.draft_model import self_draft
    config, model, tokenizer = smollm2
    sliced = self_draft(model, 4)
    return sliced.config, sliced, tokenizer


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str):
    """HF transformers' LlamaForCausalLM from the same GGUF, float32, eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # One thread: beside another test worker, torch's OpenMP threads fought that worker's XLA
    # threads for the 2 cores (the HF greedy test: 30 s against 20 s with one thread, a kivi
    # test running beside it; 98 s in a CI run).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model():
    """The `tiny` preset with random weights, float32: fast engines whose exactness does not
    depend on real weights."""
    import jax.numpy as jnp
    from flax import nnx

    from infer.model.config import get_config
    from infer.model.llama import Llama
    return Llama(get_config("tiny"), jnp.float32, nnx.Rngs(3))


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory) -> dict[str, str]:
    """A random draft, a random EAGLE head and a random EAGLE-3 head (its fuse random too, so
    that its drafts depend on the taps) for `tiny_model`: exactness must not depend on how
    good the proposals are."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from infer.model.config import get_config
    from infer.model.llama import Llama
    from infer.spec.draft_model import draft_config, save_draft
    from infer.spec.eagle_head import EagleHead, save_eagle
    tiny = get_config("tiny")
    root = tmp_path_factory.mktemp("tiny_weights")
    paths = {name: str(root / f"{name}.safetensors") for name in ("draft", "eagle", "eagle3")}
    save_draft(Llama(draft_config(tiny, 1), jnp.float32, nnx.Rngs(6)), paths["draft"])
    save_eagle(EagleHead(tiny, jnp.float32, nnx.Rngs(5)), paths["eagle"])
    eagle3 = EagleHead(tiny, jnp.float32, nnx.Rngs(8), feature_layers=(0,))
    eagle3.fuse.set_value(jax.random.normal(jax.random.key(9), eagle3.fuse[...].shape) / 8)
    save_eagle(eagle3, paths["eagle3"])
    return paths


@pytest.fixture
def fresh_programs():
    """A test that counts compilations, or patches what a trace reads (a kernel's threshold, a
    verification rule), starts and leaves with no shared programs (`infer.model.programs`):
    it compiles its own, and no later test runs a patched one."""
    from infer.model.programs import PROGRAMS
    PROGRAMS.clear()
    yield PROGRAMS
    PROGRAMS.clear()
