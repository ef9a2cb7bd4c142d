"""experiments/structured_cost.py end to end on SmolLM2's first 2 layers: each constraint's row
decodes as many full-batch steps as the unconstrained one (the constraints cannot complete
early), and its breakdown stays within the step it splits."""

from __future__ import annotations

import pytest

from experiments import structured_cost

pytest.importorskip("llguidance")


def test_every_constraint_decodes_the_same_steps(tmp_path) -> None:
    rows = structured_cost.run(batch_sizes=[2], constraints=["none", "json", "regex"],
                               tokens=5, prompt_len=16, repeats=1, layers=2,
                               out=str(tmp_path / "s.jsonl"))
    by_kind = {r["constraint"]: r for r in rows}
    assert set(by_kind) == {"none", "json", "regex"}
    steps = {r["steps_timed"] for r in rows}
    assert len(steps) == 1 and steps.pop() > 0
    for kind in ("json", "regex"):
        row = by_kind[kind]
        assert row["finished_by_length"] and row["fill_ms"] > 0
        assert row["planned_ahead"] == 0  # a constrained step waits for its token
        assert row["over_unconstrained"] == pytest.approx(row["step_ms"]
                                                          / by_kind["none"]["step_ms"])
    assert by_kind["none"]["planned_ahead"] > 0
    assert "fill_ms" not in by_kind["none"]


def test_an_unknown_constraint_is_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown constraint"):
        structured_cost.run(batch_sizes=[1], constraints=["yaml"], tokens=5, prompt_len=16,
                            repeats=1, layers=2, out=str(tmp_path / "s.jsonl"))
