"""experiments.sampler_cost on a small vocabulary: a row per batch size with every draw timed."""

from __future__ import annotations

import json

from experiments import sampler_cost


def test_rows_time_every_draw(tmp_path) -> None:
    out = tmp_path / "sampler_cost.jsonl"
    rows = sampler_cost.run(batch_sizes=[1, 3], vocab_size=64, temperature=0.7, calls=2,
                            repeats=2, out=str(out))
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        for name in ("inverse_cdf_ms", "gumbel_max_ms", "greedy_argmax_ms"):
            assert row[name] > 0
        assert row["gumbel_over_inverse_cdf"] == row["gumbel_max_ms"] / row["inverse_cdf_ms"]
    assert [json.loads(line)["batch"] for line in out.read_text().splitlines()] == [1, 3]
