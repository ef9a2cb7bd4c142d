"""No silent compilation inside a user's call: the first run of each program in a process is
announced in one `infer` log line naming the program, nothing is announced twice, and after
`warmup()` nothing is announced at all."""

from __future__ import annotations

import logging

from infer.sampling_params import SamplingParams
from tests.engines import tiny_engine


def _run(engine, prompts: list[list[int]]) -> None:
    for ids in prompts:
        engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=6, seed=1))
    engine.run_until_done()


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "infer" and r.getMessage().startswith("compiling the ")]


def test_each_first_use_is_announced_once(tiny_model, caplog, fresh_programs) -> None:
    engine = tiny_engine(tiny_model)
    with caplog.at_level(logging.INFO, logger="infer"):
        _run(engine, [[5, 6, 7], [8, 9, 10, 11], [12, 13]])
        first = _notices(caplog)
        # The engine ran a prefill chunk and decode batches: each program is named once.
        assert any(n.startswith("compiling the prefill program") for n in first), first
        assert any(n.startswith("compiling the decode program") for n in first), first
        assert len(first) == len(set(first)) == len(engine.runner.ready)
        caplog.clear()
        _run(engine, [[5, 6, 7], [8, 9, 10, 11], [12, 13]])  # the same shapes again
        assert _notices(caplog) == []


def test_nothing_is_announced_after_warmup(tiny_model, caplog) -> None:
    engine = tiny_engine(tiny_model)
    engine.warmup()
    assert engine.runner.ready == set(engine.runner.shapes())
    with caplog.at_level(logging.INFO, logger="infer"):
        _run(engine, [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
    assert _notices(caplog) == []
