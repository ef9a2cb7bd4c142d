"""experiments/device_check.py end to end with --quick settings: on CPU every kernel interprets
(rows say compiled: false), so this checks the machinery a device run relies on: a row per cell
in both JSONL files, kernels within tolerance of their references, equal tokens from both
attention backends, a failing cell recorded while the run goes on, and the time budget."""

from __future__ import annotations

import itertools

import jax
import pytest

import kernels_pallas.paged_attention as pa
from experiments import device_check
from experiments.common import read_jsonl

QUICK = device_check.QUICK


def quick_steps() -> list[tuple[str, int, int]]:
    steps = device_check.steps(QUICK["batch_sizes"], QUICK["prefill_chunk"],
                               QUICK["verify_tokens"], QUICK["verify_batch"],
                               QUICK["mixed_batch"])
    return [(s.name, s.batch, s.tokens) for s in steps]


def test_quick_steps_cover_every_entry_point() -> None:
    names = [s for s, _, _ in quick_steps()]
    assert names[:3] == ["decode", "prefill", "tree verify"]
    assert len(names) == 3 + hasattr(pa, "ragged_paged_attention")


def test_quick_run_checks_every_cell_and_serves_equal_tokens(tmp_path) -> None:
    rows = device_check.run(quick=True, out_dir=str(tmp_path))
    kernels = [r for r in rows if r["part"] == "kernel"]
    serve = [r for r in rows if r["part"] == "serve"]
    want = {(g, f, s, b, t) for g, f, (s, b, t) in itertools.product(
        QUICK["geometries"], QUICK["kv_formats"], quick_steps())}
    assert {(r["geometry"], r["kv_format"], r["step"], r["batch"], r["tokens"])
            for r in kernels} == want
    assert len(kernels) == len(want)
    on_cpu = jax.default_backend() == "cpu"
    for r in kernels:
        cell = (r["geometry"], r["kv_format"], r["step"], r["batch"])
        assert r["outcome"] == "ok", (cell, r.get("error"))
        assert r["compiled"] is (not on_cpu), cell
        assert r["finite"] and r["max_abs_err"] <= r["atol"] + r["rtol"] * r["max_abs_ref"], cell
        assert r["kernel_s"] > 0 and r["reference_s"] > 0 and r["pct_of_copy_bw"] > 0, cell
        assert r["copy_bandwidth_Bps"] > 0 and r["q_dtype"] == (
            "bfloat16" if r["kv_format"] == "bfloat16" else "float32")
    # Bytes by hand: SmolLM2 int8 decode, rows of 40, 33 and 26 tokens hold 3 + 3 + 2 pages of
    # 16 tokens x 3 kv heads, each token 64 int8 values and one bfloat16 scale, K and V.
    (row,) = [r for r in kernels if r["geometry"] == "SmolLM2-135M"
              and r["kv_format"] == "int8" and r["step"] == "decode"]
    assert row["lengths"] == [40, 33, 26]
    assert row["kv_bytes"] == 2 * 8 * 3 * 16 * (64 + 2)
    assert row["flops"] == 4 * 9 * 64 * (40 + 33 + 26)
    assert row["bytes"] == row["kv_bytes"] + 2 * (3 * 9 * 64 * 4) + 4 * (3 + 3 * 3)

    assert [r["kv_format"] for r in serve] == QUICK["serve_kv_formats"]
    for r in serve:
        assert r["outcome"] == "ok" and r["tokens_equal"], r.get("error")
        assert r["tokens"] == r["reference_tokens"]
        assert [len(t) for t in r["tokens"]] == [QUICK["serve_tokens"]] * QUICK["serve_requests"]
        assert r["pallas_tok_s"] > 0 and r["reference_tok_s"] > 0
        assert r["compiled"] is (not on_cpu) and r["weights"].startswith("random")

    stored = read_jsonl(str(tmp_path / "device_kernels.jsonl"))
    assert [r["key"] for r in stored] == [r["key"] for r in kernels]
    assert len(read_jsonl(str(tmp_path / "device_serve.jsonl"))) == len(serve)


def test_a_failing_cell_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom: a lowering the device rejects")

    monkeypatch.setattr(pa, "paged_prefill_attention", broken)
    with pytest.raises(SystemExit) as exit_info:
        device_check.run(quick=True, out_dir=str(tmp_path), geometries=["Llama-3-8B"],
                         kv_formats=["int4"], verify_tokens=0, mixed_batch=0,
                         serve_kv_formats=[])
    assert exit_info.value.code == 1
    rows = read_jsonl(str(tmp_path / "device_kernels.jsonl"))
    assert [(r["step"], r["outcome"]) for r in rows] == [("decode", "ok"), ("prefill", "error")]
    assert rows[1]["error"] == "RuntimeError: boom: a lowering the device rejects"
    assert "broken" in rows[1]["traceback"]


def test_cells_past_the_budget_are_skipped(tmp_path) -> None:
    with pytest.raises(SystemExit):
        device_check.run(quick=True, out_dir=str(tmp_path), kv_formats=["int8"], budget_s=0.0)
    rows = (read_jsonl(str(tmp_path / "device_kernels.jsonl"))
            + read_jsonl(str(tmp_path / "device_serve.jsonl")))
    assert len(rows) == len(quick_steps()) + len(QUICK["serve_kv_formats"])
    assert {r["outcome"] for r in rows} == {"skipped"}
    assert "--budget_s" in rows[0]["error"]


def test_unknown_names_are_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown geometries"):
        device_check.run(quick=True, out_dir=str(tmp_path), geometries=["Llama-9"])
    with pytest.raises(ValueError, match="unsupported kv_format"):
        device_check.run(quick=True, out_dir=str(tmp_path), kv_formats=["int3"])
    assert not list(tmp_path.iterdir())


def test_every_parameter_of_run_has_a_flag_and_unset_flags_take_the_preset() -> None:
    import inspect

    from experiments.common import flag_kwargs

    flags = device_check.FLAGS
    try:
        flags(["device_check", "--quick", "--batch_sizes=2,4"])
        kwargs = flag_kwargs(device_check.run, flags)
    finally:
        flags.unparse_flags()
    assert set(kwargs) == set(inspect.signature(device_check.run).parameters)
    assert kwargs["quick"] is True and kwargs["batch_sizes"] == ["2", "4"]
    assert kwargs["context"] is None and kwargs["kv_formats"] is None  # run fills from QUICK
    assert set(device_check.FULL) == set(QUICK) == set(kwargs) - {"quick", "out_dir", "backend"}
