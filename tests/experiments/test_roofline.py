"""The roofline experiment's counting and crossover helpers, against hand-worked numbers on the
tiny config (no model is loaded, nothing is timed)."""

from __future__ import annotations

import pytest

from experiments.roofline import (attainable_flops, cache_len, decode_intensity_limit,
                                  exact_ridge_batch, first_above, matmul_weights, ridge_intensity,
                                  step_bytes, step_flops, step_time_knee)
from infer.model.config import get_config

# tiny: V=512, E=64, F=128, L=2, H=4, K=2, D=16, tied embeddings.
# Per layer: Q 64*64 + K 64*32 + V 64*32 + O 64*64 = 12288; MLP 3*64*128 = 24576.
TINY_MATMUL = 2 * (12288 + 24576)  # 73728
TINY_HEAD = 512 * 64  # 32768, the tied embedding as the vocabulary projection
TINY_ATTN = 4 * 2 * 4 * 16  # 4 L H D = 512 FLOPs per (query, key) pair over all layers
TINY_KV = 2 * 2 * 2 * 16 * 4  # K and V * L * K * D * 4 bytes = 512 bytes per token in float32


def test_matmul_weights_plus_embedding_and_norms_is_every_parameter():
    config = get_config("tiny")
    assert matmul_weights(config) == TINY_MATMUL
    norms = 2 * 2 * 64 + 64  # two RMSNorms per layer and the final one
    assert matmul_weights(config) + TINY_HEAD + norms == config.num_params == 106816


def test_decode_flops():
    config = get_config("tiny")
    # One new token after 10 cached: 11 keys attended.
    one = 2 * TINY_MATMUL + 2 * TINY_HEAD + TINY_ATTN * 11
    assert one == 147456 + 65536 + 5632 == 218624
    assert step_flops(config, 1, 1, 10) == one
    assert step_flops(config, 8, 1, 10) == 8 * one


def test_prefill_flops_count_causal_attention_and_one_logit_row():
    config = get_config("tiny")
    # 3 new tokens, empty cache: tokens attend 1, 2, 3 keys; logits at the last token only.
    per_row = 3 * 2 * TINY_MATMUL + 2 * TINY_HEAD + TINY_ATTN * (1 + 2 + 3)
    assert per_row == 442368 + 65536 + 3072 == 510976
    assert step_flops(config, 2, 3, 0) == 2 * per_row == 1021952
    # After 5 cached tokens the same 3 attend 6, 7, 8 keys.
    assert step_flops(config, 1, 3, 5) == per_row + TINY_ATTN * (5 * 3)


def test_step_bytes():
    from infer.cache.budget import kv_bytes_per_token
    config = get_config("tiny")
    assert kv_bytes_per_token(config, "float32") == TINY_KV
    # Decode, 4 rows after 10 cached: read 11 tokens' KV per row, write 1.
    assert step_bytes(4, 1, 10, weight_bytes=1000, kv_bytes_per_token=TINY_KV) == \
        1000 + 512 * 4 * 11 + 512 * 4 == 25576
    # Prefill of 16 tokens, one row: read 16, write 16.
    assert step_bytes(1, 16, 0, weight_bytes=1000, kv_bytes_per_token=TINY_KV) == 1000 + 512 * 32


def test_cache_len():
    assert [cache_len(n) for n in (1, 128, 129, 200, 256, 257, 513)] == \
        [128, 128, 256, 256, 256, 512, 1024]
    assert cache_len(5, minimum=1) == 8


def test_ridge_and_attainable():
    assert ridge_intensity(100e9, 20e9) == 5.0
    assert attainable_flops(2.0, 100e9, 20e9) == 40e9
    assert attainable_flops(5.0, 100e9, 20e9) == 100e9
    assert attainable_flops(50.0, 100e9, 20e9) == 100e9


def test_first_above():
    assert first_above([1, 2, 4, 8], [0.5, 1.0, 5.0, 9.0], 4.0) == 4
    assert first_above([1, 2, 4, 8], [0.5, 1.0, 4.0, 4.0], 4.0) is None  # equal is not above
    assert first_above([1, 2, 4], [None, 7.0, 9.0], 4.0) == 2


def test_step_time_knee():
    batches = [1, 2, 4, 8, 16, 32]
    times = [10.0, 10.2, 10.9, 14.9, 15.1, 30.0]
    assert step_time_knee(batches, times, 1.5) == 16
    assert step_time_knee(batches, times, 1.4) == 8
    assert step_time_knee(batches, times, 4.0) is None
    # Order-independent; the base is the smallest batch measured (a failed batch 1 is skipped).
    assert step_time_knee(batches[::-1], times[::-1], 1.5) == 16
    assert step_time_knee([1, 2, 4, 8], [None, 10.0, 14.0, 16.0], 1.5) == 8
    assert step_time_knee([], [], 1.5) is None


def test_exact_ridge_batch_is_where_counted_intensity_first_exceeds_the_ridge():
    config = get_config("tiny")
    w = 4 * config.num_params
    per_row = step_flops(config, 1, 1, 10)  # 218624
    kv_row = step_bytes(1, 1, 10, weight_bytes=0, kv_bytes_per_token=TINY_KV)  # 512 * 12 = 6144
    assert decode_intensity_limit(config, 10, TINY_KV) == pytest.approx(per_row / kv_row)
    intensity = lambda b: step_flops(config, b, 1, 10) / step_bytes(
        b, 1, 10, weight_bytes=w, kv_bytes_per_token=TINY_KV)
    for ridge in (0.3, 1.0, 5.0, 20.0, 35.0):
        b = exact_ridge_batch(config, 10, weight_bytes=w, kv_bytes_per_token=TINY_KV, ridge=ridge)
        assert b is not None and intensity(b) > ridge
        assert b == 1 or intensity(b - 1) <= ridge
    # The KV-only limit (218624 / 6144 = 35.6 FLOP/B) caps decode: past it, never compute-bound.
    assert exact_ridge_batch(config, 10, weight_bytes=w, kv_bytes_per_token=TINY_KV,
                             ridge=36.0) is None


def test_a_resumed_sweep_judges_every_row_against_one_set_of_ceilings(tmp_path, monkeypatch,
                                                                      capsys):
    """Two runs whose ceilings differ (pinned here at 100 and then 50 GB/s, as bandwidth does
    vary between runs): the resumed run's table, rows and summary use the first row's ceilings
    throughout. Before, the B=1 row kept its own run's bound and % of roof beside a summary and
    plot drawn with another roof."""
    from experiments import common, roofline

    def ceilings_at(bandwidth: float):
        return lambda **kw: {"copy_bandwidth_Bps": bandwidth, "read_bandwidth_Bps": bandwidth,
                             "copy_bandwidth_samples_Bps": [bandwidth],
                             "read_bandwidth_samples_Bps": [bandwidth], "matmul_flops": 1e11,
                             "matmul_dtype": "float32"}

    kw = dict(prefill_lengths=[], prefill_batch=1, context=128, dtype="float32",
              kv_dtype="float32", repeats=1, steps_per_sample=1, knee_factor=1.5,
              out=str(tmp_path / "roofline.jsonl"))
    monkeypatch.setattr(common, "measure_ceilings", ceilings_at(50e9))
    roofline.run(batch_sizes=[2], **kw)
    monkeypatch.setattr(common, "measure_ceilings", ceilings_at(100e9))
    *rows, summary = roofline.run(batch_sizes=[2, 1], resume=True, **kw)
    assert "judged against the first row's" in capsys.readouterr().out
    assert [r["copy_bandwidth_Bps"] for r in rows] == [50e9, 100e9]  # as measured
    assert summary["copy_bandwidth_Bps"] == 50e9
    for r in rows:
        want = roofline.judged(r, 1e11, 50e9)
        assert {k: r[k] for k in want} == want
        assert r["roofline_step_ms"] == pytest.approx(1e3 * max(r["flops"] / 1e11,
                                                                r["bytes"] / 50e9))
