"""Bad input gets a clear exception that names the problem."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from infer.engine.simple_loop import validate_prompts
from infer.io import loader
from infer.io.loader import load, resolve_path
from infer.model.config import get_config
from infer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2):
    from infer.llm import LLM
    return LLM.from_loaded(*smollm2, max_num_seqs=4, max_model_len=8192, num_pages=64)


def test_empty_prompt(llm) -> None:
    with pytest.raises(ValueError, match="prompt 0: prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(prompt_token_ids=[[5], []])


def test_prompt_longer_than_context(llm) -> None:
    too_long = [[1] * (llm.config.max_position_embeddings - 3)]
    with pytest.raises(ValueError, match=r"prompt 0: 8189 prompt tokens \+ max_tokens=10 exceed "
                                         r"max_model_len=8192"):
        llm.generate(prompt_token_ids=too_long, sampling_params=SamplingParams(max_tokens=10))


def test_token_outside_vocabulary(llm) -> None:
    with pytest.raises(ValueError, match=r"prompt 0: token ids outside the vocabulary \[0, 49152\): "
                                         r"\[49152\]"):
        llm.generate(prompt_token_ids=[[1, 2, 49152]])
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        llm.generate(prompt_token_ids=[[-1]])


def test_validate_prompts_names_the_prompt() -> None:
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        validate_prompts([[1], []], 10, 100, [SamplingParams(max_tokens=1)] * 2)
    with pytest.raises(ValueError, match="no prompts"):
        validate_prompts([], 10, 100, [])


def test_missing_model_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "nope.gguf"))


def test_corrupt_model_file(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ValueError, match="bad.gguf"):
        load(str(bad))


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'"):
        get_config("llama-9")
    with pytest.raises(ValueError, match="unknown model 'smollm3'"):
        resolve_path("smollm3")
    with pytest.raises(ValueError, match="no bundled weights"):
        resolve_path("llama-3-8b")


def test_bad_weight_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported weight dtype 'int3'"):
        load("smollm2-135m", "int3")


@pytest.mark.parametrize("dtype", ["int3", "float16", jnp.int8, np.float64, "auto", None])
def test_bad_weight_dtype_fails_before_the_file_is_read(tmp_path, monkeypatch, dtype) -> None:
    """A typo in dtype costs no checkpoint read (seconds for a GGUF, minutes for a large model),
    and a dtype object outside the supported ones is refused too, not loaded."""
    def read(path):
        raise AssertionError(f"read {path} before checking the dtype")

    monkeypatch.setattr(loader, "read_checkpoint", read)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="unsupported weight dtype.*choose one of"):
        load(str(path), dtype)
    for ok in ("float32", "bfloat16", jnp.float32, jnp.bfloat16, np.dtype("float32")):
        assert jnp.dtype(loader.resolve_dtype(ok)).name in loader.DTYPES


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-2), "top_k must be"),
    (dict(top_k=2.5), "top_k must be"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(seed=-1), "seed must be"),
    (dict(max_tokens=True), "max_tokens must be"),
    (dict(seed=True), "seed must be"),
    (dict(stop=[""]), "stop must be non-empty"),
])
def test_invalid_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match(llm) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
             "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "tie_word_embeddings": True}


@pytest.mark.parametrize("change, tokenizer, error, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, True, ValueError,
     "unsupported rope_scaling type 'linear'"),
    ({"attention_bias": True}, True, ValueError, "attention_bias=true is not supported"),
    ({}, False, FileNotFoundError, "no tokenizer.json")])
def test_load_refuses_a_hf_dir_before_reading_its_weights(tmp_path, monkeypatch, change: dict,
                                                          tokenizer: bool, error: type,
                                                          message: str) -> None:
    """`load` of a HF directory whose config infer cannot run, or which holds no tokenizer,
    fails before its shards are read (a large model's minutes); LLM() did, load() read every
    tensor first."""
    import json

    from infer.io import checkpoint

    def read(path):
        raise AssertionError(f"read {path} before the config and tokenizer were checked")

    monkeypatch.setattr(checkpoint, "_read_safetensors", read)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG | change))
    (tmp_path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(error, match=message):
        load(str(tmp_path))
    if change:  # the same directory with a config infer runs does reach the read
        (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
        with pytest.raises(AssertionError, match="before the config and tokenizer"):
            load(str(tmp_path))
