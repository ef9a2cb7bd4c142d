"""The scaling experiment on a narrow sweep: the per-device arithmetic against hand-worked
figures, layouts it cannot make reported rather than raised, and the measured collectives and
bytes of two small placed models equal to the arithmetic (on tests/conftest.py's eight virtual
CPU devices)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from experiments import scaling
from infer.cache.budget import kv_bytes_per_token, weight_bytes
from infer.model.config import get_config

SWEEP = dict(models=["llama-3-70b", "llama-3-8b", "smollm2-135m"], tensor_parallel=[1, 3, 4],
             data_parallel=[1, 2], kv_formats=["bfloat16", "int8", "int4"],
             weight_dtype="bfloat16", gpu_memory_gb=80.0, overhead_fraction=0.1, context=4096,
             batch=64, measure_rows=4, virtual_devices=8)
# A split layout with int8 KV, a padded one over two replicas with int4 KV, a refused one.
MEASURE = ["tiny:2:1:int8", "tiny-3kv:4:2:int4", "tiny:3:1:bfloat16"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling") / "scaling.jsonl"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rows = scaling.run(**SWEEP, measure=MEASURE, out=str(out))
    return rows, out, text.getvalue()


def _row(rows, model, tp, dp=1, kv="bfloat16", kind="analytic"):
    found = [r for r in rows if r["kind"] == kind and r["model"] == model
             and r["tensor_parallel"] == tp and r["data_parallel"] == dp and r["kv_format"] == kv]
    assert len(found) == 1, (model, tp, dp, kv, kind)
    return found[0]


def test_weights_per_device_are_a_tp_th_of_the_sharded_parts(result):
    rows, _, _ = result
    config = get_config("llama-3-70b")
    norms = (2 * 80 + 1) * 8192 * 2  # the RMSNorm scales, whole on every device
    one = _row(rows, "llama-3-70b", 1)["weight_bytes_per_device"]
    four = _row(rows, "llama-3-70b", 4)["weight_bytes_per_device"]
    assert one == weight_bytes(config, "bfloat16")
    assert four == (one - norms) // 4 + norms
    assert four * 4 / one == pytest.approx(1, abs=1e-4)


def test_kv_per_device_and_users(result):
    rows, _, _ = result
    by_format = {f: _row(rows, "llama-3-70b", 4, kv=f) for f in SWEEP["kv_formats"]}
    config = get_config("llama-3-70b")
    assert by_format["bfloat16"]["kv_bytes_per_token_per_device"] == 327_680 // 4
    for f, r in by_format.items():
        assert r["kv_bytes_per_token_per_device"] * 4 == kv_bytes_per_token(config, f)
    users = [by_format[f]["max_users"] for f in ("bfloat16", "int8", "int4")]
    assert 0 < users[0] < users[1] < users[2]
    assert _row(rows, "llama-3-70b", 4, dp=2)["max_users"] == 2 * users[0]
    no_room = _row(rows, "llama-3-70b", 1)
    assert no_room["max_users"] == 0 and no_room["status"].startswith("weights do not fit")


def test_a_kivi_window_counts_on_each_device() -> None:
    """int4_kivi holds a bfloat16 window per sequence beside its pages; a split layout's device
    holds its heads' share of it, which its users count."""
    row = scaling.analytic_row("llama-3-70b", 4, 1, "int4_kivi", weight_dtype="bfloat16",
                               gpu_memory_gb=80.0, overhead_fraction=0.1, context=4096,
                               batch=64)
    assert row["layout"] == "split" and row["max_users_per_replica"] > 0
    per_token = row["kv_bytes_per_token_per_device"]
    # two bfloat16 pages of K and V per head, /TP, and the ring's tags (80 layers x 16 bytes),
    # which one device holds whole
    window = 80 * 8 * 2 * 2 * 32 * 128 * 2 // 4 + 80 * 16
    available = row["kv_gb_per_device"] * 1e9
    assert row["max_users_per_replica"] == int(available // (4096 * per_token + window))
    assert row["max_users_per_replica"] < int(available // (4096 * per_token))


def test_padding_costs_kv_memory(result):
    rows, _, _ = result
    smol = get_config("smollm2-135m")
    padded = _row(rows, "smollm2-135m", 4)
    assert (padded["layout"], padded["heads"]) == ("pad", "12/4")
    assert padded["kv_bytes_per_token_per_device"] * 4 == kv_bytes_per_token(smol) * 4 // 3
    split = _row(rows, "smollm2-135m", 3)
    assert padded["max_users_per_replica"] < split["max_users_per_replica"] * 4 // 3
    assert _row(rows, "smollm2-135m", 3)["layout"] == "split"


def test_an_impossible_layout_is_reported(result):
    rows, _, _ = result
    row = _row(rows, "llama-3-8b", 3, kv="int4")
    assert row["status"].startswith("cannot lay out") and "intermediate_size 14336" in row["status"]
    assert row.get("weight_bytes_per_device") is None and row["layout"] is None
    refused = _row(rows, "tiny", 3, kind="measured")
    assert refused["status"].startswith("refused as predicted")


def test_collectives_per_step(result):
    rows, _, _ = result
    row = _row(rows, "llama-3-70b", 4)
    assert (row["all_reduces"], row["all_gathers"]) == (161, 1)
    assert row["comm_bytes_at_batch"] == 161 * 64 * 8192 * 4 + 64 * 128256 * 4
    assert row["wire_bytes_at_batch"] == (2 * 3 * 161 * 64 * 8192 * 4 + 3 * 64 * 128256 * 4) // 4
    assert _row(rows, "llama-3-70b", 1)["comm_bytes_at_batch"] == 0


def test_measured_equals_analytic(result):
    rows, _, _ = result
    for model, tp, dp, kv in (("tiny", 2, 1, "int8"), ("tiny-3kv", 4, 2, "int4")):
        row = _row(rows, model, tp, dp, kv, kind="measured")
        assert row["status"] == "ok", row["status"]
        assert row["measured"] == row["analytic"]
        config = scaling.model_config(model)
        assert row["measured"]["all_reduces"] == 2 * config.num_layers + 1
        assert row["measured"]["all_gathers"] == 1
        assert row["measured"]["all_gather_bytes"] == 4 * config.vocab_size * 4
    assert _row(rows, "tiny-3kv", 4, 2, "int4", kind="measured")["layout"] == "pad"


def test_rows_on_disk_and_the_lesson_printed(result):
    rows, out, text = result
    stored = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(stored) == len(rows) == 3 * 3 * 2 * 3 + len(MEASURE)
    assert "llama-3-70b on 4x A100-80GB, TP=4" in text
    assert "KV 81,920 B/token/GPU" in text and out.with_suffix(".png").exists()


def test_a_disagreement_fails_loudly(tmp_path, monkeypatch):
    assert scaling.disagreements({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == [
        "b: measured 2 != analytic 3"]
    monkeypatch.setattr(scaling, "measure_point",
                        lambda **_: {"kind": "measured", "status": "MISMATCH: b"})
    with pytest.raises(SystemExit, match="1 measured point"):
        scaling.run(**{**SWEEP, "models": []}, measure=["tiny:2:1:int8"],
                    out=str(tmp_path / "s.jsonl"))


def test_int4_kivi_pools_are_measured_and_counted_at_the_runners_pages():
    """An int4_kivi pool beside a point's own (and the arithmetic it is checked against): its
    key codes are per page, so a token's bytes are counted at the measured runner's pages, not
    budget.py's 32 (which tiny's head dim of 16 cannot even lay out), and its pool is made with
    the runner's windows, one per sequence."""
    from infer.cache import kivi

    row = scaling.measure_point("tiny", 2, 1, "bfloat16", kv_formats=["int4_kivi"],
                                weight_dtype="bfloat16", rows=2)
    assert row["status"] == "ok", row["status"]
    config = scaling.model_config("tiny")
    per_head = sum(kivi.bytes_per_token(config.head_dim, scaling.MEASURED_PAGE_SIZE))  # K + V
    expected = config.num_layers * config.num_kv_heads * per_head // 2  # split over 2 devices
    assert row["analytic"]["kv_bytes_per_token_per_device_int4_kivi"] == expected
    assert row["measured"]["kv_bytes_per_token_per_device_int4_kivi"] == expected
