"""EAGLE agreement counts the answer positions an engine would draft, no more."""

from __future__ import annotations

import numpy as np

from experiments.eagle_agreement import agreement
from infer.model.config import get_config
from tests.spec.oracle import oracle_models


def test_answer_positions_are_the_answer_tokens_after_the_first() -> None:
    target, head = oracle_models(get_config("tiny"))
    rng = np.random.default_rng()
    prompt_len, answer_len = int(rng.integers(2, 12)), int(rng.integers(2, 12))
    ids = rng.integers(0, target.config.vocab_size, prompt_len + answer_len).tolist()
    hits, positions, all_hits, all_positions = agreement(target, head, ids[:prompt_len],
                                                         ids[prompt_len:])
    # Drafts of answer[1:], one each; the row drafting the token after the answer is no
    # answer position (an engine stopping at the answer's end never drafts it).
    assert positions == answer_len - 1 and all_positions == prompt_len + answer_len - 1
    assert 0 <= hits <= positions and hits <= all_hits <= all_positions
