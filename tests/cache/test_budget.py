"""KV-cache memory accounting against hand-worked numbers (no model, no device compute)."""

from __future__ import annotations

import pytest

from infer.cache.budget import gqa_saving, kv_bytes_per_token, memory_budget, weight_bytes
from infer.model.config import get_config

L70, K70, D70 = 80, 8, 128  # Llama-3-70B: layers, KV heads, head dim


def test_llama3_70b_bf16_bytes_per_token():
    # The lesson's figure: K and V, 80 layers, 8 KV heads, 128 dims, 2 bytes.
    assert kv_bytes_per_token(get_config("llama-3-70b"), "bfloat16") == 327_680
    assert kv_bytes_per_token(get_config("llama-3-70b"), "fp16") == 327_680


def test_llama3_70b_fp8_is_half_plus_one_scale_per_head():
    config = get_config("llama-3-70b")
    assert kv_bytes_per_token(config, "fp8", include_scales=False) == 327_680 // 2
    # One bfloat16 scale per head and token beside the 128 one-byte values.
    assert kv_bytes_per_token(config, "fp8") == 2 * L70 * K70 * (128 + 2)


def test_llama3_70b_int4_quarter_and_scales():
    config = get_config("llama-3-70b")
    assert kv_bytes_per_token(config, "int4", include_scales=False) == 327_680 // 4
    # 128 dims at 4 bits = 64 bytes, plus 128 / 32 = 4 groups, each a bfloat16 scale and low.
    assert kv_bytes_per_token(config, "int4") == 2 * 80 * 8 * (64 + 4 * 2 * 2) == 102_400


def test_gqa_saving():
    assert gqa_saving(get_config("llama-3-70b")) == 8  # 64 query heads / 8 KV heads
    assert gqa_saving(get_config("smollm2-135m")) == 3  # 9 / 3


def test_memory_budget_arithmetic_on_a_tiny_model():
    config = get_config("tiny")  # vocab 512, d 64, ffn 128, 2 layers, 4 heads, 2 KV heads, D 16
    # Parameters: embedding 512*64 (tied) + 2 layers * (attention 64*16*(2*4 + 2*2)
    # + MLP 3*64*128 + two norms 2*64) + final norm 64.
    params = 512 * 64 + 2 * (64 * 16 * 12 + 3 * 64 * 128 + 2 * 64) + 64
    assert params == 106_816
    assert weight_bytes(config, "float32") == 4 * params
    assert weight_bytes(config, "int4") == params // 2  # two to a byte, not one
    b = memory_budget(config, gpu_memory_gb=0.25, num_gpus=2, weight_dtype="float32",
                      kv_format="float16", overhead_fraction=0.1)
    total = 2 * 0.25e9  # 500,000,000 bytes
    available = total - 0.1 * total - 4 * params  # 449,572,736
    assert b.kv_bytes_available == available == 449_572_736
    assert b.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256  # K,V * layers * heads * D * 2 B
    assert b.max_cached_tokens == 449_572_736 // 256 == 1_756_143
    assert b.max_users(4096) == 428  # 1,756,143 / 4096 = 428.7
    assert b.max_users(1) == 1_756_143
    assert b.fits
    with pytest.raises(ValueError, match="context_len"):
        b.max_users(0)


def test_model_that_does_not_fit():
    # 405B parameters in bf16 (~812 GB) on 4 × 80 GB.
    b = memory_budget(get_config("llama-3-405b"), gpu_memory_gb=80, num_gpus=4,
                      weight_dtype="bfloat16", kv_format="float16")
    assert not b.fits
    assert b.kv_bytes_available < 0
    assert b.max_cached_tokens == 0
    assert b.max_users(4096) == 0


@pytest.mark.parametrize("fmt", ["int3", "fp7", "float64"])
def test_bad_format_raises_naming_it(fmt: str):
    config = get_config("llama-3-70b")
    with pytest.raises(ValueError, match=repr(fmt)):
        kv_bytes_per_token(config, fmt)
    with pytest.raises(ValueError, match=repr(fmt)):
        memory_budget(config, gpu_memory_gb=80, kv_format=fmt)


def test_int4_kivi_costs_its_codes_per_token_and_its_window_per_sequence():
    """Llama-3-8B (32 layers, 8 kv heads, D = 128) at pages of 32: a key is 64 data bytes and
    2 * 128 / 32 one-byte codes, a value 64 and 2 * 128 / 32: 144 bytes per head and token, 1/3.56
    of bfloat16; each sequence also holds two bfloat16 pages of K and V per head and layer (its
    window's ring)."""
    from infer.cache.budget import kv_bytes_per_sequence

    config = get_config("llama-3-8b")
    per_token = kv_bytes_per_token(config, "int4_kivi")
    assert per_token == 32 * 8 * 144 == 36_864
    assert kv_bytes_per_token(config, "bfloat16") / per_token == pytest.approx(3.556, abs=1e-3)
    window = kv_bytes_per_sequence(config, "int4_kivi")
    assert window == 32 * 8 * 2 * 2 * 32 * 128 * 2 and kv_bytes_per_sequence(config, "int4") == 0
    b = memory_budget(config, gpu_memory_gb=80, kv_format="int4_kivi")
    assert b.max_users(2048) == int(b.kv_bytes_available // (2048 * per_token + window))
    assert b.max_users(2048) < b.max_cached_tokens // 2048


def test_the_mha_comparison_holds_each_sequences_window_too():
    """memory_budget's "with full multi-head attention" users: the same budget with one KV head
    per query head, int4_kivi's per-sequence window widened alike (it was left out)."""
    from experiments.memory_budget import budget_row

    kw = dict(gpus=1, gpu_memory_gb=80.0, weight_dtype="bfloat16", overhead_fraction=0.1,
              contexts=[4096])
    plain = budget_row("llama-3-8b", "bfloat16", **kw)  # no window: tokens over 4096
    tokens = int(plain["kv_gb_available"] * 1e9 // plain["mha_kv_bytes_per_token"])
    assert plain["mha_kv_bytes_per_token"] == 4 * plain["kv_bytes_per_token"]  # 32 / 8 heads
    assert plain["max_users_mha_4096"] == tokens // 4096 > 0
    kivi = budget_row("llama-3-8b", "int4_kivi", **kw)
    without_window = int(kivi["kv_gb_available"] * 1e9 // kivi["mha_kv_bytes_per_token"]) // 4096
    assert 0 < kivi["max_users_mha_4096"] < without_window
