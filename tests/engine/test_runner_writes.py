"""Writes outside the cache fail loudly: the runner, the model proposers and eager cache writes
check on the host that every write lies in slots the row owns, and raise ValueError naming the
row and the slots. (Tree speculation's check: tests/spec/test_tree.py; the paged
cache's own: tests/cache/test_paged.py.)"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.cache.page_allocator import SequencePages
from infer.engine.plan import PrefillChunk, SeqState, StepPlan
from infer.engine.request import Request
from infer.engine.runner import Runner, RunnerConfig
from infer.model.config import get_config
from infer.sampling_params import SamplingParams
from infer.spec.draft_model import self_draft
from infer.spec.model_proposers import DraftModelProposer

TINY = get_config("tiny")
CONFIG = RunnerConfig(num_pages=8, page_size=4, max_num_seqs=2, max_prefill_tokens=16,
                      max_model_len=32, num_speculative_tokens=3)


def seq(prompt: list[int], pages: list[int], num_computed: int, request_id: str = "r0"
        ) -> SeqState:
    request = Request(request_id, prompt, SamplingParams(), None)
    return SeqState(request=request, pages=SequencePages(4, list(pages), num_computed),
                    admitted_at=0)


def test_contiguous_write_past_max_len_raises_eagerly() -> None:
    """Slots 6..8 of an 8-slot cache: under jit slot 8 is dropped, silently; eagerly it raises."""
    cache = KVCache.create(1, 1, 8, TINY.num_kv_heads, TINY.head_dim)
    meta = AttentionMetadata.for_prefill(jnp.asarray([3]), 3, cached=jnp.asarray([6]))
    k = jnp.ones((1, 3, TINY.num_kv_heads, TINY.head_dim))
    with pytest.raises(ValueError, match=r"row 0 writes slots \[6, 9\) but has room for 8"):
        cache.write(0, k, k, meta)
    cache.write(0, k[:, :2], k[:, :2], AttentionMetadata.for_prefill(  # slots 6, 7 fit
        jnp.asarray([2]), 2, cached=jnp.asarray([6])))


def test_runner_rejects_a_step_writing_past_the_rows_pages(tiny_model) -> None:
    """A prefill chunk of 10 tokens into two pages (8 slots), and a decode step whose token
    has no page: the table's padding is page 0, another sequence's, where the jitted write
    used to land."""
    runner = Runner(tiny_model, dataclasses.replace(CONFIG, num_speculative_tokens=0))
    prompt = list(range(1, 11))
    chunk = PrefillChunk(seq=seq(prompt, [3, 5], 0), start=0, token_ids=tuple(prompt))
    with pytest.raises(ValueError, match=r"row 0 \(request 'r0'\) writes slots \[0, 10\) but "
                                         r"has room for 8"):
        runner.execute(StepPlan(kind="prefill", prefill=[chunk]))
    fits = seq(prompt[:9], [3, 5, 6], 8, "fits")
    full = seq(prompt[:9], [1, 2], 8, "full")  # slot 8 needs a third page
    with pytest.raises(ValueError, match=r"row 1 \(request 'full'\) writes slots \[8, 9\)"):
        runner.execute(StepPlan(kind="decode", decode=[fits, full], draft_limits=[0, 0]))


def test_draft_chain_rejects_drafts_past_the_reserved_pages(tiny_model) -> None:
    """The chain feeds drafts back at the slots after the last token: three drafts from a
    sequence of 3 tokens write slots 1..4, but the row holds one page (slots 0..3)."""
    proposer = DraftModelProposer(self_draft(tiny_model, 1), CONFIG)
    s = seq([1, 2, 3], [6], 2)
    s.request.num_cached_tokens = 1  # the draft's cache already holds position 0
    with pytest.raises(ValueError, match=r"row 0 \(request 'r0'\) writes slots \[1, 5\) but "
                                         r"has room for 4"):
        proposer.propose([s], [3], 1, 3)
