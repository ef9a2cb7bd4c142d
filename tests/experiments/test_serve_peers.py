"""The serving experiment's HF peer against a stand-in model: an untimed first call, then
static batches in arrival order, each token timed by the logits processor."""

from __future__ import annotations

import time

import pytest

from experiments.serve import WorkItem, serve_hf

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


class _Model:
    """generate() as HF's, as far as serve_hf uses it: the processors run once per token."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int, int]] = []  # (time, rows, new tokens)

    def generate(self, ids, *, attention_mask, max_new_tokens, min_new_tokens, do_sample,
                 pad_token_id, logits_processor):
        assert min_new_tokens == max_new_tokens and not do_sample
        self.calls.append((time.perf_counter(), ids.shape[0], max_new_tokens))
        for _ in range(max_new_tokens):
            time.sleep(0.001)
            for processor in logits_processor:
                processor(ids, None)


def test_hf_peer_is_warmed_up_before_its_clock_starts() -> None:
    work = [WorkItem(0.0, (1, 2, 3), 4), WorkItem(0.0, (4, 5), 3), WorkItem(0.01, (6,), 5)]
    model = _Model()
    metrics, start, _ = serve_hf(model, work, batch_size=2, desc="stand-in")
    (warm_t, warm_rows, warm_new), *timed = model.calls
    assert warm_t < start and (warm_rows, warm_new) == (1, 2)  # untimed, short
    assert [(rows, new) for _, rows, new in timed] == [(2, 4), (1, 5)]
    assert [m.num_output_tokens for m in metrics] == [4, 3, 5]
    assert all(m.arrival_s >= start for m in metrics)
