"""KV-cache memory accounting against hand-worked numbers (no model, no device compute)."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from infer.cache.budget import (gqa_saving, kv_bytes_per_sequence, kv_bytes_per_token,
                                laid_out, memory_budget, norm_bytes, weight_bytes,
                                weight_bytes_per_device)
from infer.model.config import PRESETS, get_config
from kernels_pallas.kv_quant import PAGE_FORMATS, SUPPORTED_KV_FORMATS

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
    # Each GPU: 250,000,000 bytes, 10% reserved, half of the weights but the RMSNorm scales
    # (2 layers * 2 + 1 of 64 float32s), which both hold whole.
    norms = 5 * 64 * 4
    assert b.layout == "split" and b.devices == 2
    assert b.device_weight_bytes == (4 * params - norms) // 2 + norms == 214_272
    assert b.device_kv_bytes_available == 0.25e9 - 0.025e9 - 214_272 == 224_785_728
    assert b.kv_bytes_available == 2 * 224_785_728
    # K,V * layers * heads * D * 2 B, one KV head of the two on each GPU
    assert b.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 == 2 * b.device_kv_bytes_per_token == 256
    assert b.max_cached_tokens == 224_785_728 // 128 == 1_756_138
    assert b.max_users(4096) == 428  # 1,756,138 / 4096 = 428.7
    # Sequences hold whole pages of the engine's 16 tokens: 1 and 16 tokens cost a page, 17 two.
    assert b.page_size == 16
    assert b.max_users(1) == b.max_users(16) == 1_756_138 // 16 == 109_758
    assert b.max_users(17) == 1_756_138 // 32
    assert dataclasses.replace(b, page_size=1).max_users(1) == 1_756_138
    assert b.fits
    with pytest.raises(ValueError, match="context_len"):
        b.max_users(0)


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS + PAGE_FORMATS)
@pytest.mark.parametrize("page_size", [8, 16])
def test_the_budget_counts_what_the_paged_cache_allocates(kv_format: str, page_size: int):
    """Bytes per token and per sequence, scales, codes, int4_kivi's window and its ring's tags
    included, are what `PagedKVCache.create` allocates for one more page and one more window."""
    import jax

    from infer.cache.budget import kv_bytes_per_token_per_device
    from infer.cache.paged import PagedKVCache

    config = get_config("tiny")
    kivi = kv_format in PAGE_FORMATS

    def allocated(pages: int, windows: int) -> int:
        cache = PagedKVCache.create(config.num_layers, pages, page_size, config.num_kv_heads,
                                    config.head_dim, kv_format, num_windows=windows)
        return sum(leaf.nbytes for leaf in jax.tree.leaves(cache))

    windows = 1 if kivi else 0
    per_page = allocated(3, windows) - allocated(2, windows)
    assert per_page == page_size * kv_bytes_per_token(config, kv_format, page_size=page_size)
    assert per_page == page_size * kv_bytes_per_token_per_device(config, 1, kv_format,
                                                                 page_size=page_size)
    per_window = allocated(2, 2) - allocated(2, 1) if kivi else 0
    assert per_window == kv_bytes_per_sequence(config, kv_format, page_size)
    b = memory_budget(config, gpu_memory_gb=1, kv_format=kv_format, page_size=page_size)
    assert b.device_kv_bytes_per_sequence == per_window
    assert b.max_users(page_size + 1) == int(b.device_kv_bytes_available
                                             // (2 * per_page + per_window))


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
    window's ring) and the ring's tags."""
    from infer.cache.budget import kv_bytes_per_sequence

    config = get_config("llama-3-8b")
    per_token = kv_bytes_per_token(config, "int4_kivi")
    assert per_token == 32 * 8 * 144 == 36_864
    assert kv_bytes_per_token(config, "bfloat16") / per_token == pytest.approx(3.556, abs=1e-3)
    window = kv_bytes_per_sequence(config, "int4_kivi")
    # 32 layers * (8 heads * 2 pages * K,V * 32 tokens * 128 dims * 2 B + the ring's 2 entries'
    # (tag, page) int32 pairs)
    assert window == 32 * (8 * 2 * 2 * 32 * 128 * 2 + 2 * 2 * 4)
    assert kv_bytes_per_sequence(config, "int4") == 0
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


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "fp8", "int8", "int4"])
def test_norms_are_counted_in_the_weights_own_bits(weight_dtype: str) -> None:
    """The norms every device holds whole are taken out of weight_bytes, which counts each
    parameter at the dtype's bits (int4: half a byte, not numpy's itemsize of 1), so they are
    counted in the same bits: the devices of a replica then hold the replica's weights, the
    norms once more on each device but the first."""
    from infer.cache.budget import dtype_bits

    for model in ("llama-3-70b", "llama-3-8b", "smollm2-135m"):
        config = get_config(model)
        norms = (2 * config.num_layers + 1) * config.hidden_size * dtype_bits(weight_dtype) / 8
        assert norm_bytes(config, weight_dtype) == norms
        for tp in (1, 2, 4):
            _, wide = laid_out(config, tp)
            per_device = weight_bytes_per_device(config, tp, weight_dtype)
            assert per_device * tp - (tp - 1) * norms == weight_bytes(wide, weight_dtype)


def test_replicated_kv_heads_cost_each_gpu_a_whole_head():
    """Llama-3-70B over 16 GPUs: 8 KV heads do not split 16 ways, so each is held twice, one
    on each GPU beside its 4 query heads: a token costs each GPU 2 * 80 * 128 * 2 bytes, twice
    the pooled 327,680 / 16, and half the users a pooled count gives."""
    config = get_config("llama-3-70b")
    b = memory_budget(config, gpu_memory_gb=80, num_gpus=16)
    assert b.layout == "replicate"
    assert b.device_kv_bytes_per_token == 2 * 80 * 128 * 2 == 2 * 327_680 // 16
    pooled = b.kv_bytes_available // (4096 * 327_680)
    assert b.max_users(4096) == b.device_kv_bytes_available // (4096 * 40_960) < pooled // 1.9


@pytest.mark.parametrize("seed", range(4))
def test_budget_counts_the_heads_as_laid_out(seed: int):
    """Random presets, GPU counts and formats: a layout the engine would refuse is refused
    here; otherwise each GPU's KV per token is the laid-out model's over the GPUs (replicated or
    zero heads included), its weights a 1/T share but the norms, and its users the most whose
    share fits on it."""
    from infer.parallel.heads import head_layout

    rng = random.Random(seed)
    formats = ["bfloat16", "fp8", "int8", "int4", "int4_kivi"]
    for _ in range(40):
        config = PRESETS[rng.choice(sorted(PRESETS))]
        t, fmt = rng.choice([1, 2, 3, 4, 6, 8, 12, 16]), rng.choice(formats)
        if fmt == "int4_kivi" and config.head_dim % 32:  # its pages of 32 channels
            continue
        kw = dict(gpu_memory_gb=rng.choice([16, 24, 80, 141]), num_gpus=t, kv_format=fmt,
                  weight_dtype=rng.choice(["bfloat16", "int4"]))
        try:
            layout = head_layout(config, t, pad_heads=True)
        except ValueError as e:
            with pytest.raises(ValueError, match=re.escape(str(e)[:40])):
                memory_budget(config, **kw)
            continue
        b = memory_budget(config, **kw)
        wide = config.replace(num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)
        assert b.layout == layout.way
        assert b.device_kv_bytes_per_token * t == kv_bytes_per_token(wide, fmt)
        assert (b.device_kv_bytes_per_token * t * config.num_kv_heads
                == kv_bytes_per_token(config, fmt) * layout.num_kv_heads)
        # int4_kivi's ring tags stay whole on one device, as the norms below do
        tags = config.num_layers * 16 if fmt == "int4_kivi" else 0
        assert b.device_kv_bytes_per_sequence * t - (t - 1) * tags == kv_bytes_per_sequence(
            wide, fmt) == b.kv_bytes_per_sequence
        norms = norm_bytes(config, kw["weight_dtype"])
        assert b.device_weight_bytes * t - (t - 1) * norms == weight_bytes(wide, kw["weight_dtype"])
        context = rng.choice([500, 512, 4096, 32768])
        users = b.max_users(context)
        each = -(-context // b.page_size) * b.page_size * b.device_kv_bytes_per_token + b.device_kv_bytes_per_sequence
        assert users * each <= max(0, b.device_kv_bytes_available) < (users + 1) * each


def test_the_experiment_reports_a_model_that_does_not_split(tmp_path, capsys):
    """`experiments.memory_budget` over 3 GPUs: Llama-3-8B's FFN (14,336) does not split 3
    ways, so its row says why and counts no users; SmolLM2 (9 / 3 heads) splits."""
    from experiments.memory_budget import run

    rows = run(models=["llama-3-8b", "smollm2-135m"], kv_formats=["bfloat16"], gpus=3,
               gpu_memory_gb=24.0, weight_dtype="bfloat16", overhead_fraction=0.1,
               contexts=[4096], out=str(tmp_path / "budget.jsonl"))
    by_model = {r["model"]: r for r in rows}
    llama = by_model["llama-3-8b"]
    assert llama["layout"] is None and not llama["fits"] and llama["max_users_4096"] == 0
    assert "intermediate_size 14336" in llama["status"]
    smol = by_model["smollm2-135m"]
    expected = memory_budget(get_config("smollm2-135m"), gpu_memory_gb=24.0, num_gpus=3)
    assert smol["layout"] == "split" and smol["max_users_4096"] == expected.max_users(4096) > 0
    assert "cannot lay out" in capsys.readouterr().out
