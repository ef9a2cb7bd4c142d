"""Model configurations: frozen dataclasses and the named presets.

Shapes of the presets come from the models' published `config.json` files. The Llama-3 presets
use the Llama-3.1 release (same shapes as Llama-3, 128k context through RoPE scaling), since
405B exists only there.

A HF `config.json` reaches a config one way, `normalize_hf_config`, whether through the
checkpoint readers or `LlamaConfig.from_hf_dict`: one set of defaults and refusals.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    params_billions: float | None = None  # published size, for memory budgets of unloaded models

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads served by one KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameters of the architecture, counting a tied embedding once."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], name: str = "hf") -> "LlamaConfig":
        """Builds a config from a HF `config.json` dictionary of a Llama-architecture model,
        checked and defaulted as the loader does (`normalize_hf_config`)."""
        return cls._from_normalized(normalize_hf_config(hf, name), name)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> "LlamaConfig":
        with open(path) as f:
            hf = normalize_hf_config(json.load(f), os.fspath(path))
        return cls._from_normalized(hf, name=os.path.basename(os.path.dirname(path)))

    @classmethod
    def _from_normalized(cls, hf: Mapping[str, Any], name: str) -> "LlamaConfig":
        scaling = hf["rope_scaling"]
        if scaling is not None:
            kind = scaling.get("rope_type")
            if kind != "llama3":
                raise ValueError(f"{name}: unsupported rope_scaling type {kind!r} "
                                 "(only 'llama3' is)")
            for key in ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"):
                if key not in scaling:
                    raise ValueError(f"{name}: llama3 rope_scaling has no {key!r}")
            scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        return cls(
            name=name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            rope_theta=hf["rope_theta"],
            rope_scaling=scaling,
            rms_norm_eps=hf["rms_norm_eps"],
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=hf["tie_word_embeddings"],
        )


def normalize_hf_config(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A HF Llama `config.json` dictionary in one form: what this model does not implement
    refused, HF's defaults filled in, transformers 4 and 5 spellings of RoPE settings unified
    (`rope_scaling` None or a dict with "rope_type"). Idempotent: a normalized dict is returned
    unchanged, so every path into `LlamaConfig` can pass through it."""
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (only llama)")
    # transformers' MistralConfig gives a config without the key a 4096-token window.
    if model_type == "mistral" and raw.get("sliding_window", 4096) is not None:
        window = raw.get("sliding_window", "4096, the default when the key is absent")
        raise ValueError(f"{where}: sliding-window attention is not supported (sliding_window "
                         f"{window}; null means full attention)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{where}: {flag}=true is not supported")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: one function
        raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if not isinstance(raw.get(key), int):
            raise ValueError(f"{where}: config has no integer {key!r}")

    # transformers 5 reads RoPE from one dict, "rope_parameters", or from "rope_scaling" (4's
    # spelling) in its place when a config has one, the dict's rope_theta first; its config and
    # its rotary embedding disagree on a top-level original_max_position_embeddings.
    # transformers 4 reads "rope_scaling" and the top-level rope_theta only. A setting given
    # twice, differently, means a different model to each reader: refused.
    legacy = raw.get("rope_scaling") or None
    if legacy is not None and not isinstance(legacy, Mapping):
        raise ValueError(f"{where}: rope_scaling must be an object, got {legacy!r:.80}")
    params = legacy if legacy is not None else (
        raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), Mapping) else {})
    named = "rope_scaling" if legacy is not None else "rope_parameters"
    for key in ("rope_theta", "original_max_position_embeddings"):
        if key in raw and key in params and raw[key] != params[key]:
            raise ValueError(f"{where}: {key} {raw[key]!r} and {named}' {key} {params[key]!r} "
                             "differ (which one a reader takes depends on its version)")
    if legacy is not None and params.get("rope_theta", raw.get("rope_theta", 10000.0)) \
            != raw.get("rope_theta", 10000.0):
        raise ValueError(f"{where}: rope_scaling's rope_theta {params['rope_theta']!r} is not "
                         "the top-level one (transformers 4 reads only that)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = legacy
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        scaling.setdefault("rope_type", scaling.pop("type", None))
        # Older configs spell "no scaling" as an explicit type "default", which HF reads so.
        if scaling["rope_type"] == "default":
            scaling = None
        elif scaling["rope_type"] == "llama3":
            for key, kind in (("factor", float), ("low_freq_factor", float),
                              ("high_freq_factor", float),
                              ("original_max_position_embeddings", int)):
                if key in scaling:  # a missing one is refused with the model's name
                    scaling[key] = _number(scaling, key, None, kind, f"{where}: rope_scaling")

    heads = raw["num_attention_heads"]
    return {
        "model_type": "llama",
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": heads,
        # HF reads null here as "not given" (the head count, hidden_size / heads).
        "num_key_value_heads": _number(raw, "num_key_value_heads", heads, int, where,
                                       null_is_default=True),
        "head_dim": _number(raw, "head_dim", raw["hidden_size"] // heads, int, where,
                            null_is_default=True),
        "rope_theta": _number({"rope_theta": theta}, "rope_theta", None, float, where),
        "rms_norm_eps": _number(raw, "rms_norm_eps", 1e-6, float, where),  # HF's default
        "max_position_embeddings": _number(raw, "max_position_embeddings", 2048, int, where),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "rope_scaling": scaling,
    }


def _number(raw: Mapping[str, Any], key: str, default: int | float | None, kind: type,
            where: str, null_is_default: bool = False) -> Any:
    """`raw[key]` as `kind`, `default` where it is absent (or null, with `null_is_default`);
    a ValueError naming the field where it is null otherwise or not a number."""
    if key not in raw and default is not None:
        return kind(default)
    value = raw.get(key)
    if value is None:
        if not null_is_default or default is None:
            raise ValueError(f"{where}: {key} is null")
        return kind(default)
    # bool is an int to Python, not a number of heads to anyone; strings are not parsed.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not float(value).is_integer()):
        raise ValueError(f"{where}: {key} must be a{'n integer' if kind is int else ' number'}, "
                         f"got {value!r:.80}")
    return kind(value)


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)

PRESETS: dict[str, LlamaConfig] = {
    c.name: c
    for c in (
        LlamaConfig(name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, params_billions=0.135),
        LlamaConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                    rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072, params_billions=8.03),
        LlamaConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                    num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                    rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072, params_billions=70.6),
        LlamaConfig(name="llama-3-405b", vocab_size=128256, hidden_size=16384,
                    intermediate_size=53248, num_layers=126, num_heads=128, num_kv_heads=8,
                    head_dim=128, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                    max_position_embeddings=131072, params_billions=405.9),
        # Mistral-7B v0.3: full attention (no sliding window), 32768-token vocabulary.
        LlamaConfig(name="mistral-7b", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                    max_position_embeddings=32768, params_billions=7.25),
        # Tiny configs for tests: fast to build, exercising GQA, tying and RoPE scaling.
        LlamaConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    max_position_embeddings=256, tie_word_embeddings=True),
        LlamaConfig(name="tiny-mha", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                    max_position_embeddings=256),
        LlamaConfig(name="tiny-llama3", vocab_size=512, hidden_size=96, intermediate_size=192,
                    num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
                    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=64),
                    max_position_embeddings=512),
    )
}


def get_config(name: str) -> LlamaConfig:
    """Returns the preset called `name`; a `ValueError` lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
