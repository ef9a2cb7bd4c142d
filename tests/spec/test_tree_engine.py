"""EAGLE trees in the serving engine (`SpeculativeConfig(tree=...)`), at batch > 1 over the paged
cache: greedy outputs are plain decoding's (with preemption, prefix caching, a confidence stop),
each row's drafted tree is the one the batch-1 speculator drafts for it alone, and after every
step the pages hold exactly the KV a plain pass over the accepted tokens writes (the accepted
path compacted in place). Sampled trees keep the target's law: tests/spec/
test_speculative_sampling_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from infer.engine.device_steps import DeviceSteps
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.eagle_head import save_eagle
from infer.spec.tree import TreeSpeculator
from infer.spec.tree_draft import TreeShape
from tests.engines import serve
from tests.spec.oracle import oracle_models
from tests.spec.plain_kv import run_checking_pages

CONFIG = get_config("tiny")
# Full, chain, and dynamic trees, one of them with fewer verified nodes than head rows.
TREES = ["2x2", "1x3", "3x3/6", "4x3w2/5"]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    target, head = oracle_models(CONFIG)
    path = str(tmp_path_factory.mktemp("oracle") / "eagle.safetensors")
    save_eagle(head, path)
    return target, head, path


def prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, rng.integers(3, 30)).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def greedy_requests(seed: int) -> list[list[int]]:
    requests = prompts(seed)
    return requests + [requests[0][:8] + [7, 7]]  # shares its first two pages with request 0


@pytest.fixture(scope="module")
def plain_greedy(oracle) -> dict[int, list[list[int]]]:
    """Plain greedy decoding of each seed's requests, once per module (preemption and prefix
    caching leave plain outputs alone: tests/engine)."""
    return {seed: serve(oracle[0], None, greedy_requests(seed), None, GREEDY)[0]
            for seed in (0, 1)}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("seed", [0, 1])
def test_trees_keep_greedy_outputs(oracle, plain_greedy, tree, seed) -> None:
    """Greedy outputs equal plain decoding's, with pages to spare, with so few pages that
    requests are preempted, and with prefix caching (prompts sharing a prefix)."""
    target, _, path = oracle
    spec = SpeculativeConfig("eagle", eagle_path=path, tree=tree)
    for overrides in ({}, {"num_pages": 16}, {"enable_prefix_caching": True}):
        out, stats = serve(target, None, greedy_requests(seed), spec, GREEDY, **overrides)
        assert out == plain_greedy[seed], (tree, overrides)
        # The oracle head agrees with the target: deep paths get accepted.
        assert stats["tokens_per_verify"] > 1.5, (tree, overrides, stats)
        assert (stats["preemptions"] > 0) == ("num_pages" in overrides), (tree, stats)


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_trees_over_quantized_pages(oracle, kv_format) -> None:
    """Compaction moves the stored codes with their scales: over int8 and int4 pages, greedy
    output is plain decoding's over the same pages."""
    target, _, path = oracle
    requests = greedy_requests(0)
    plain, _ = serve(target, None, requests, None, GREEDY, kv_cache_dtype=kv_format)
    out, stats = serve(target, None, requests,
                       SpeculativeConfig("eagle", eagle_path=path, tree="3x3/6"), GREEDY,
                       kv_cache_dtype=kv_format)
    assert out == plain
    assert stats["tokens_per_verify"] > 1.5, stats


def test_trees_through_the_pallas_kernels(oracle) -> None:
    """The Pallas backend (interpreted on CPU) reads the trees' masks in the target's verify and
    the head's draft rows: greedy output is the reference backend's plain decoding."""
    target, _, path = oracle
    requests = prompts(0, 3)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    plain, _ = serve(target, None, requests, None, greedy)
    out, stats = serve(target, None, requests,
                       SpeculativeConfig("eagle", eagle_path=path, tree="3x3/6"), greedy,
                       attention_backend="pallas")
    assert out == plain
    assert stats["tokens_per_verify"] > 1.5, stats


def test_a_confidence_stop_trims_trees_and_keeps_outputs(oracle) -> None:
    """With draft_confidence a row verifies its tree only up to its last candidate the head is
    sure enough of: fewer candidates than without the stop, and the same greedy output."""
    target, _, path = oracle
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    requests = prompts(2)
    full_spec = SpeculativeConfig("eagle", eagle_path=path, tree="3x3/6")
    plain, _ = serve(target, None, requests, None, greedy)
    _, full = serve(target, None, requests, full_spec, greedy)
    # The oracle's draft probabilities are flat (its embeddings are damped): a first child's
    # is about 1% over the 512-token vocabulary, so a stop at 0.5% cuts the trees' deeper nodes.
    out, stopped = serve(target, None, requests,
                         SpeculativeConfig("eagle", eagle_path=path, tree="3x3/6",
                                           draft_confidence=0.005), greedy)
    assert out == plain
    assert 0 < stopped["proposed"] < full["proposed"] * 0.9, (stopped, full)


def test_each_rows_tree_is_the_batch_one_speculators(oracle) -> None:
    """The engine drafts a batch of trees over the paged cache; each row's first tree equals,
    token for token and parent for parent, the one the batch-1 speculator drafts for that
    prompt alone over a contiguous cache."""
    target, head, path = oracle
    shape = TreeShape.parse("3x3/6")
    engine = Engine(target, None, EngineConfig(
        max_num_seqs=4, max_prefill_tokens=16, max_model_len=96, page_size=4,
        speculative=SpeculativeConfig("eagle", eagle_path=path, tree=str(shape))))
    proposer = engine.runner.proposer
    propose_tree = proposer.propose_tree
    first_trees: dict[str, tuple[list[int], list[int]]] = {}
    batch_sizes = []

    def recording(seqs, limits, rows):
        nodes, parents, counts = propose_tree(seqs, limits, rows)
        nodes, parents = np.asarray(nodes), np.asarray(parents)
        batch_sizes.append(int((counts > 0).sum()))
        for i, seq in enumerate(seqs):
            if counts[i] and seq.request.request_id not in first_trees:
                assert len(seq.request.output_ids) == 1
                first_trees[seq.request.request_id] = (nodes[i].tolist(), parents[i].tolist())
        return nodes, parents, counts

    proposer.propose_tree = recording
    requests = prompts(3, 4)
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=24))
           for p in requests]
    engine.run_until_done()
    assert max(batch_sizes) > 1  # trees were drafted for several rows at once
    speculator = TreeSpeculator(DeviceSteps(target), head, shape.branches, shape.depth, 128,
                                shape.budget, shape.width)
    for request_id, prompt in zip(ids, requests):
        state = speculator.prefill(prompt)
        tokens, parents, _ = speculator.draft(state)
        want = (np.asarray(tokens)[1:].tolist(), np.asarray(parents).tolist())
        assert first_trees[request_id] == want, request_id


def test_compaction_leaves_the_cache_as_plain_decoding_would(oracle) -> None:
    """After every step each running request holds exactly the pages its accepted tokens need,
    and the KV in them equals a plain forward over those tokens: the accepted path's nodes
    moved from their tree slots to consecutive ones, the rest dropped."""
    target, _, path = oracle
    engine = Engine(target, None, EngineConfig(
        max_num_seqs=3, max_prefill_tokens=16, max_model_len=64, page_size=4,
        speculative=SpeculativeConfig("eagle", eagle_path=path, tree="3x3/6")))
    for i, p in enumerate(prompts(4, 3)):
        engine.add_request(prompt_token_ids=p, params=SamplingParams(
            max_tokens=30, temperature=0.0 if i else 1.0, seed=i, ignore_eos=True))
    checked = run_checking_pages(engine, target)
    stats = engine.speculative_stats()
    assert checked > 10 and stats["tokens_per_verify"] > 1.5, stats


def test_tree_configs_are_checked(oracle) -> None:
    target, _, path = oracle
    with pytest.raises(ValueError, match="EAGLE head"):
        SpeculativeConfig("ngram", tree="2x2")
    with pytest.raises(ValueError, match="tree shape"):
        SpeculativeConfig("eagle", eagle_path=path, tree="2by2")
    with pytest.raises(ValueError, match="budget"):
        SpeculativeConfig("eagle", eagle_path=path, tree="2x2/7")
    with pytest.raises(ValueError, match="int4_kivi"):
        Engine(target, None, EngineConfig(
            max_num_seqs=2, max_model_len=64, page_size=16, kv_cache_dtype="int4_kivi",
            speculative=SpeculativeConfig("eagle", eagle_path=path, tree="2x2")))
