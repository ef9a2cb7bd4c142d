"""experiments.attention_cpu on a small sweep: one row per point, the kernel and the gathered
attention agreeing on what they computed, timings and rates that follow from each other."""

from __future__ import annotations

import json

import jax
import pytest

from kernels_cpu import attention as cpu_attention


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_attention.available(),
                    reason="the CPU attention kernel needs XLA:CPU, AVX-512 and a compiler")
def test_a_small_sweep_writes_agreeing_rows(tmp_path) -> None:
    from experiments import attention_cpu

    out = tmp_path / "attention.jsonl"
    rows = attention_cpu.run(batch_sizes=["2"], contexts=["20", "40"], queries=["1", "3"],
                             dtypes=["float32", "bfloat16"], layers=2, page_size=16, calls=1,
                             repeats=1, out=str(out))
    assert [(r["dtype"], r["context"], r["queries"]) for r in rows] == [
        (d, c, t) for d in ("float32", "bfloat16") for c in (20, 40) for t in (1, 3)]
    stored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["dtype"], r["context"], r["queries"], r["kernel_ms_per_layer"]) for r in stored] == [
        (r["dtype"], r["context"], r["queries"], r["kernel_ms_per_layer"]) for r in rows]
    for r in rows:
        assert r["window"] == 128
        assert r["max_abs_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2), r
        kv_bytes = r["batch"] * r["context"] * 2 * 3 * 64 * (
            4 if r["dtype"] == "float32" else 2)
        for name in ("kernel", "xla"):
            assert r[f"{name}_ms_per_layer"] > 0
            assert r[f"{name}_gb_s"] == pytest.approx(kv_bytes / r[f"{name}_ms_per_layer"] / 1e6)
        assert r["kernel_speedup"] == pytest.approx(r["xla_ms_per_layer"]
                                                    / r["kernel_ms_per_layer"])
