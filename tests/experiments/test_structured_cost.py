"""experiments/structured_cost.py end to end on SmolLM2's first 2 layers: each constraint's row
decodes as many full-batch steps as the unconstrained one (the constraints cannot complete
early), and its breakdown stays within the step it splits; with tensor_parallel_size=3 the
engine runs split over 3 devices and the row's point says so, one-device rows keep their keys."""

from __future__ import annotations

import pytest

from experiments import common, structured_cost

pytest.importorskip("llguidance")


def test_every_constraint_decodes_the_same_steps(tmp_path) -> None:
    rows = structured_cost.run(batch_sizes=[2], constraints=["none", "json", "regex"],
                               tokens=5, prompt_len=16, repeats=1, layers=2,
                               out=str(tmp_path / "s.jsonl"))
    by_kind = {(r["constraint"], r["async"]): r for r in rows}
    assert set(by_kind) == {("none", True), ("json", True), ("regex", True), ("none", False)}
    steps = {r["steps_timed"] for r in rows}
    assert len(steps) == 1 and steps.pop() > 0
    none, sync = by_kind["none", True], by_kind["none", False]
    for kind in ("json", "regex"):
        row = by_kind[kind, True]
        assert row["finished_by_length"] and row["fill_ms"] > 0
        assert row["planned_ahead"] == 0  # a constrained step waits for its token
        assert row["over_unconstrained"] == pytest.approx(row["step_ms"] / none["step_ms"])
        assert row["over_unconstrained_sync"] == pytest.approx(row["step_ms"] / sync["step_ms"])
    assert none["planned_ahead"] > 0 and sync["planned_ahead"] == 0
    assert "fill_ms" not in none and "async_scheduling" not in none
    # One device: the point as before the parallel flags, so --resume finds old rows.
    assert all(r["engine_devices"] == 1 and "tensor_parallel_size" not in r for r in rows)


def test_a_split_engine_runs_on_its_mesh_and_keys_its_rows_apart(tmp_path) -> None:
    # SmolLM2's 3 KV heads split natively over 3 of tests/conftest.py's virtual devices.
    rows = structured_cost.run(batch_sizes=[2], constraints=["none", "regex"], tokens=5,
                               prompt_len=16, repeats=1, layers=2, tensor_parallel_size=3,
                               out=str(tmp_path / "s.jsonl"))
    assert sorted((r["constraint"], r["async"]) for r in rows) == [
        ("none", False), ("none", True), ("regex", True)]
    for row in rows:
        assert row["tensor_parallel_size"] == 3 and row["pad_heads"] is False
        assert row["engine_devices"] == 3  # the KV cache is split, not only the flag set
        assert row["steps_timed"] > 0 and row["step_ms"] > 0
    single = {"experiment": "structured_cost", "model": rows[0]["model"], "layers": 2,
              "batch": 2, "constraint": "none", "tokens": 5, "prompt_len": 16, "repeats": 1}
    assert rows[0]["key"] != common.row_key(single)
    assert rows[0]["key"] == common.row_key({**single, "tensor_parallel_size": 3,
                                             "pad_heads": False})


def test_an_unknown_constraint_is_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown constraint"):
        structured_cost.run(batch_sizes=[1], constraints=["yaml"], tokens=5, prompt_len=16,
                            repeats=1, layers=2, out=str(tmp_path / "s.jsonl"))


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_no_constraint_completes_within_its_tokens_of_the_longest_token(kind: str) -> None:
    """The constraints must not complete within `tokens` tokens whatever the model picks: a
    body (regex) of the vocabulary's longest token repeated, closed as soon as the grammar
    allows, is still refused an end. SmolLM2 has a 64-space token: "16 characters a token"
    let the JSON object close after 21 tokens of 48."""
    import random

    from infer.io.loader import load_on_host
    from infer.structured import GrammarCompiler

    config, _, tok = load_on_host("smollm2-135m", "float32")
    longest = structured_cost.longest_token_chars(tok, config.vocab_size)
    assert longest >= 64
    compiler = GrammarCompiler(tok, config.vocab_size)
    spaces = tok.encode(" " * 64, add_bos=False)
    assert len(spaces) == 1
    for tokens in random.Random(kind).sample(range(4, 200), 4):
        c = compiler.constraint(structured_cost.constraint_for(kind, tokens, longest))
        head = tok.encode('{"title": "", "body": "', add_bos=False) if kind == "json" else []
        for t in head + spaces * tokens:
            assert c.consume(t)
        if kind == "json":
            assert not all(c.consume(t) for t in tok.encode('"}', add_bos=False))
        else:
            assert not c._matcher.is_accepting()
