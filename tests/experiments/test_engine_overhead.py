"""experiments/engine_overhead.py end to end at batch 2 on SmolLM2: every row holds the three
loops' step times and the engine's breakdown, whose means cannot exceed the mean step they
split."""

from __future__ import annotations

import pytest

from experiments import engine_overhead


def test_rows_hold_steps_and_a_breakdown_within_the_step(tmp_path) -> None:
    rows = engine_overhead.run(batch_sizes=[2], dtypes=["float32"], tokens=4, prompt_len=16,
                               repeats=1, peers=["none"], out=str(tmp_path / "o.jsonl"))
    (row,) = rows
    # The first of the batch is ahead by the steps that prefilled the second.
    assert row["steps_timed"] == 2 and row["mean_context"] > 16 + 2
    for key in ("plain_step_ms", "plain_paged_step_ms", "engine_step_ms",
                "engine_sync_step_ms", "floor_step_ms"):
        assert row[key] > 0, key
    phases = sum(row[f"{p}_ms"] for p in engine_overhead.PHASES)
    assert 0 < phases <= row["engine_step_mean_ms"] * 1.001
    assert row["other_ms"] == pytest.approx(row["engine_step_mean_ms"] - phases)
    assert row["engine_over_plain"] == pytest.approx(row["engine_step_ms"] / row["plain_step_ms"])
    assert "hf_step_ms" not in row  # no peer asked for


def test_too_few_tokens_is_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="--tokens must be >= 4"):
        engine_overhead.run(batch_sizes=[1], dtypes=["float32"], tokens=2, prompt_len=16,
                            repeats=1, peers=["none"], out=str(tmp_path / "o.jsonl"))
