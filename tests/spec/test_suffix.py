"""Suffix decoding (`infer.spec.suffix`): the tries count exactly the substrings a brute force
counts, built token by token or at once, after evictions too; proposals equal a brute-force
reference over random sequences of small alphabets; the corpus keeps to its budget; `forget`
adds finished requests only; bad parameters are refused; and in the engine, greedy outputs stay
those of plain decoding while the corpus of earlier requests' outputs is drafted from."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from infer.engine.plan import PrefillChunk
from infer.engine.request import Request
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig, make_proposer
from infer.spec.ngram import NgramProposer
from infer.spec.suffix import (SuffixCorpus, SuffixIndex, SuffixProposer, SuffixTrie,
                               check_suffix_params, propose_suffix)

# -- the brute-force reference ---------------------------------------------------------------


def substrings(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def occurrences(seqs: list[list[int]], string: list[int], followed: bool) -> int:
    n = len(string)
    return sum(1 for s in seqs for p in range(len(s) - n + 1 - followed) if s[p:p + n] == string)


def ref_matches(seqs: list[list[int]], tokens: list[int], max_match: int, depth: int
                ) -> list[int]:
    """The suffix lengths of `tokens` that occur in `seqs` followed by a token."""
    return [m for m in range(1, min(max_match, depth - 1, len(tokens)) + 1)
            if occurrences(seqs, tokens[-m:], followed=True)]


def ref_draft(seqs: list[list[int]], path: list[int], match: int, limit: int,
              spec_factor: float, min_prob: float, depth: int) -> tuple[list[int], float]:
    steps = min(limit, math.ceil(spec_factor * match), depth - match)
    path, out, prob, score = list(path), [], 1.0, 0.0
    while len(out) < steps:
        total = occurrences(seqs, path, followed=True)
        if not total:
            break
        counts = {}
        for s in seqs:
            for p in range(len(s) - len(path)):
                if s[p:p + len(path)] == path:
                    counts[s[p + len(path)]] = counts.get(s[p + len(path)], 0) + 1
        token = max(counts, key=lambda t: (counts[t], -t))
        prob *= counts[token] / total
        if prob < min_prob:
            break
        out.append(token)
        path.append(token)
        score += prob
    return out, score


def ref_propose(tokens: list[int], corpus: list[list[int]], limit: int, max_match: int,
                spec_factor: float, min_prob: float, depth: int) -> list[int]:
    """Every source and every matching length, the best (score, match, own) kept."""
    best, draft = (0.0, 0, 0), []
    for seqs, own in (([tokens], 1), (corpus, 0)):
        for match in ref_matches(seqs, tokens, max_match, depth):
            out, score = ref_draft(seqs, tokens[-match:], match, limit, spec_factor, min_prob,
                                   depth)
            if out and (score, match, own) > best:
                best, draft = (score, match, own), out
    return draft


def random_seq(rng: np.random.Generator, alphabet: int, lo: int, hi: int) -> list[int]:
    return rng.integers(0, alphabet, int(rng.integers(lo, hi + 1))).tolist()


# -- the tries -------------------------------------------------------------------------------


def test_trie_counts_every_substring_through_adds_and_removes() -> None:
    for seed in range(40):
        rng = np.random.default_rng(seed)
        depth = int(rng.integers(2, 7))
        seqs = [random_seq(rng, int(rng.integers(1, 5)), 0, 25) for _ in range(5)]
        trie = SuffixTrie(depth)
        for s in seqs:
            trie.add(s)
        assert trie.strings() == substrings(seqs, depth), seed
        assert trie.num_nodes == len(substrings(seqs, depth))
        gone = sorted(rng.choice(len(seqs), 3, replace=False).tolist())
        for i in gone:
            trie.remove(seqs[i])
        kept = [s for i, s in enumerate(seqs) if i not in gone]
        assert trie.strings() == substrings(kept, depth), seed
        assert trie.num_nodes == len(substrings(kept, depth))
        for s in seqs:  # freed nodes are reused, and the counts stay exact
            trie.add(s)
        assert trie.strings() == substrings(kept + seqs, depth), seed


def test_index_built_token_by_token_is_the_trie_of_its_tokens() -> None:
    for seed in range(20):
        rng = np.random.default_rng(seed)
        depth = int(rng.integers(2, 8))
        tokens = random_seq(rng, int(rng.integers(1, 4)), 1, 40)
        index = SuffixIndex(depth)
        for i, t in enumerate(tokens):
            index.append(t)
            if i % 7 == 0 or i == len(tokens) - 1:
                assert index.trie.strings() == substrings([tokens[:i + 1]], depth), seed
        whole = SuffixIndex(depth, tokens)
        assert whole.tokens == tokens
        for max_match in (1, 3, 8):
            want = ref_matches([tokens], tokens, max_match, depth)
            assert [m for m, _ in index.matches(max_match)] == want[::-1], seed
            assert index.longest_match(max_match)[0] == max(want, default=0)
            assert whole.longest_match(max_match) == index.longest_match(max_match)
            trie = SuffixTrie(depth)  # the corpus' search, over the same tokens
            trie.add(tokens)
            assert [m for m, _ in trie.matches(tokens, max_match)] == want[::-1], seed


def test_proposals_equal_the_brute_force_reference() -> None:
    """Random small-alphabet requests and corpora (with evictions, so removals and best-child
    rescans happen), random parameters; the proposal at every prefix of the request."""
    checked = drafted = from_corpus = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        alphabet = int(rng.integers(2, 6))
        max_match = int(rng.integers(1, 7))
        max_draft = int(rng.integers(1, 9))
        depth = max_match + max_draft
        spec_factor = float(rng.choice([0.5, 1.0, 1.5, 4.0]))
        min_prob = float(rng.choice([0.0, 0.3, 0.5, 0.7, 1.0]))
        corpus = SuffixCorpus(int(rng.integers(10, 60)), depth)
        for _ in range(int(rng.integers(0, 6))):
            corpus.add(random_seq(rng, alphabet, 0, 20))
        kept = [list(s) for s in corpus.sequences]
        tokens = random_seq(rng, alphabet, 1, 30)
        index = SuffixIndex(depth)
        for i, t in enumerate(tokens):
            index.append(t)
            limit = int(rng.integers(0, max_draft + 1))
            got = propose_suffix(index, corpus, limit, max_match, spec_factor, min_prob)
            want = ref_propose(tokens[:i + 1], kept, limit, max_match, spec_factor, min_prob,
                               depth)
            assert got == want, (seed, i)
            checked += 1
            drafted += bool(got)
            own = ref_propose(tokens[:i + 1], [], limit, max_match, spec_factor, min_prob, depth)
            from_corpus += bool(got) and got != own
    assert drafted > checked / 3 and from_corpus > 50  # the reference was not vacuous


def test_draft_length_follows_the_match_and_the_probability() -> None:
    index = SuffixIndex(24 + 16, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    # Matched "1 2" (2 tokens): spec_factor 1.5 allows ceil(3) = 3 tokens, the limit 8.
    assert propose_suffix(index, None, 8, 24, 1.5, 0.5) == [3, 4, 5]
    assert propose_suffix(index, None, 2, 24, 4.0, 0.5) == [3, 4]
    # After "7" the sequence went on "8" twice and "0" once (path probability 2/3), after
    # "7 8" on "7" twice (2/3 still), after "7 8 7" on "8" once and "0" once (1/3: stop).
    index = SuffixIndex(8, [7, 8, 7, 8, 7, 0, 7])
    assert propose_suffix(index, None, 4, 1, 4.0, 0.6) == [8, 7]
    assert propose_suffix(index, None, 4, 1, 4.0, 0.3) == [8, 7, 0, 7]  # tie: the smaller
    assert propose_suffix(index, None, 4, 1, 4.0, 0.7) == []


# -- the corpus and the proposer -------------------------------------------------------------


def test_corpus_keeps_to_its_budget_oldest_out_first() -> None:
    corpus = SuffixCorpus(10, depth=4)
    for s in ([1, 2, 3, 4], [5, 6, 7], [8, 9, 1]):
        corpus.add(s)
    assert corpus.num_tokens == 10 and list(corpus.sequences) == [[1, 2, 3, 4], [5, 6, 7],
                                                                  [8, 9, 1]]
    corpus.add([2, 2])  # 12 > 10: the oldest goes
    assert list(corpus.sequences) == [[5, 6, 7], [8, 9, 1], [2, 2]]
    assert corpus.num_tokens == 8
    assert corpus.trie.strings() == substrings([[5, 6, 7], [8, 9, 1], [2, 2]], 4)
    corpus.add(list(range(20, 35)))  # longer than the budget: its last 10 tokens, alone
    assert list(corpus.sequences) == [list(range(25, 35))] and corpus.num_tokens == 10
    assert corpus.trie.strings() == substrings([list(range(25, 35))], 4)
    corpus.add([])
    assert corpus.num_tokens == 10
    corpus.clear()
    assert corpus.num_tokens == 0 and corpus.trie.num_nodes == 0 and not corpus.sequences


def make_seq(request_id: str, prompt: list[int], output: list[int] = ()) -> types.SimpleNamespace:
    request = Request(request_id, prompt, SamplingParams(max_tokens=64), None)
    request.output_ids.extend(output)
    return types.SimpleNamespace(request=request)


def test_forget_adds_finished_requests_to_the_corpus() -> None:
    proposer = SuffixProposer(max_match=4, max_draft=4, corpus_tokens=64)
    done = make_seq("a", [1, 2, 3], [10, 11, 12, 13, 14])
    drafts, counts, probs = proposer.propose([done], [4], 2, 4)
    assert probs is None and counts.tolist() == [0, 0]  # nothing repeats yet
    done.request.output_ids.append(15)
    proposer.commit([done], [[15]], None)
    done.request.abort()  # finished (aborted): its tokens at that moment enter the corpus
    proposer.forget("a")
    assert list(proposer.corpus.sequences) == [[10, 11, 12, 13, 14, 15]]
    proposer.forget("a")  # once only
    proposer.forget("never-seen")
    assert proposer.corpus.num_tokens == 6

    # Another request that reaches "11 12" drafts what followed it there.
    other = make_seq("b", [7, 11, 12])
    drafts, counts, _ = proposer.propose([other], [3], 1, 4)
    assert counts.tolist() == [3] and drafts[0, :3].tolist() == [13, 14, 15]

    # A request forgotten while running (preempted) is dropped, not added; it runs again.
    preempted = make_seq("c", [20, 21], [22])
    proposer.propose([preempted], [2], 1, 4)
    proposer.forget("c")
    assert proposer.corpus.num_tokens == 6 and "c" not in proposer._indexes
    # Its recompute's prefill emits its last token: no step after the preemption proposed
    # for it or committed it, and it still enters the corpus when it finishes.
    preempted.request.output_ids.append(23)
    preempted.request.abort()
    proposer.forget("c")
    assert list(proposer.corpus.sequences)[-1] == [22, 23] and "c" not in proposer._requests

    # A request seen only in a prefill (max_tokens=1) enters it too.
    prefilled = make_seq("p", [1, 2], [24])
    proposer.observe_prefill([PrefillChunk(prefilled, 0, (1, 2))], None)
    prefilled.request.abort()
    proposer.forget("p")
    assert list(proposer.corpus.sequences)[-1] == [24] and "p" not in proposer._requests

    # A request seen only in commits (plain steps) still enters the corpus when it finishes.
    plain = make_seq("d", [1], [30, 31])
    proposer.commit([plain], [[31]], None)
    plain.request.abort()
    proposer.forget("d")
    assert list(proposer.corpus.sequences)[-1] == [30, 31]
    assert proposer.corpus.num_tokens == 6 + 2 + 1 + 2

    with_prompts = SuffixProposer(max_match=4, max_draft=4, corpus_tokens=64,
                                  corpus_prompts=True)
    seq = make_seq("e", [1, 2], [3])
    with_prompts.commit([seq], [[3]], None)
    seq.request.abort()
    with_prompts.forget("e")
    assert list(with_prompts.corpus.sequences) == [[1, 2, 3]]

    no_corpus = SuffixProposer(corpus_tokens=0)
    seq = make_seq("f", [1, 2], [3])
    no_corpus.commit([seq], [[3]], None)
    seq.request.abort()
    no_corpus.forget("f")
    assert no_corpus.corpus is None
    proposer.clear()
    assert proposer.corpus.num_tokens == 0


@pytest.mark.parametrize("make", [lambda: SuffixProposer(max_match=4, max_draft=4),
                                  lambda: NgramProposer(max_n=3)], ids=["suffix", "ngram"])
def test_prefill_chunks_build_the_index_as_they_come(make) -> None:
    """Each prefill chunk extends a host proposer's index by its tokens (a recompute's chunks
    hold outputs too), so the first proposal adds only the tokens since: built there, a long
    prompt's index stalled that step for every row. Its proposals are those of an index
    built at once; a row that never drafts (logprobs) builds none."""
    rng = np.random.default_rng(18)
    for case in range(30):
        proposer, fresh = make(), make()
        prompt = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
        output = rng.integers(0, 4, int(rng.integers(0, 6))).tolist()
        seq = make_seq(str(case), prompt, output)
        tokens, start = prompt + output, 0
        while start < len(tokens):
            n = int(rng.integers(1, 9))
            proposer.observe_prefill([PrefillChunk(seq, start, tuple(tokens[start:start + n]))],
                                     None)
            start = min(start + n, len(tokens))
            assert proposer._indexes[str(case)].tokens == tokens[:start]
        limit = int(rng.integers(1, 5))
        got, want = proposer.propose([seq], [limit], 1, 4), fresh.propose([seq], [limit], 1, 4)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    plain = make_seq("logprobs", [1, 2, 3])
    plain.request.params = SamplingParams(max_tokens=4, logprobs=1)
    proposer.observe_prefill([PrefillChunk(plain, 0, (1, 2, 3))], None)
    assert "logprobs" not in proposer._indexes


def test_proposer_keeps_each_row_within_its_limit() -> None:
    proposer = SuffixProposer(max_match=4, max_draft=8)
    seqs = [make_seq("a", [5, 6, 7, 8] * 4), make_seq("b", [1, 2, 1, 2, 1]),
            make_seq("c", [3, 1, 4])]
    drafts, counts, _ = proposer.propose(seqs, [8, 2, 8], 4, 8)
    assert drafts.shape == (4, 8) and counts.tolist() == [8, 2, 0, 0]
    assert drafts[0].tolist() == [5, 6, 7, 8] * 2 and drafts[1, :2].tolist() == [2, 1]
    # The index caught up with tokens that arrived since.
    seqs[2].request.output_ids.extend([1, 4])
    drafts, counts, _ = proposer.propose(seqs[2:], [3], 1, 8)
    assert counts.tolist() == [2] and drafts[0, :2].tolist() == [1, 4]  # then no continuation


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_match=0), "max_match"), (dict(max_match=2.5), "max_match"),
    (dict(spec_factor=0), "spec_factor"), (dict(spec_factor=float("inf")), "spec_factor"),
    (dict(min_prob=-0.1), "min_prob"), (dict(min_prob=1.5), "min_prob"),
    (dict(max_draft=0), "max_draft"), (dict(corpus_tokens=-1), "corpus_tokens"),
    (dict(corpus_tokens=True), "corpus_tokens")])
def test_bad_parameters_are_refused(kwargs, message) -> None:
    args = dict(max_match=24, spec_factor=4.0, min_prob=0.5, max_draft=4, corpus_tokens=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_suffix_params(**args)
    with pytest.raises(ValueError, match=message):
        SuffixProposer(**args)
    config = {"max_draft": "num_tokens"}
    fields = {f"suffix_{k}" if k != "max_draft" else config[k]: v for k, v in kwargs.items()}
    if "num_tokens" not in fields:  # num_tokens has its own check, with its own message
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig("suffix", **fields)


@pytest.mark.parametrize("method", ["ngram", "suffix", "self_draft"])
@pytest.mark.parametrize("num_tokens", [0, 17, 2.5, True, "4", None])
def test_num_tokens_is_an_int_in_range_for_every_method(method, num_tokens) -> None:
    with pytest.raises(ValueError, match=r"num_tokens must be an int in \[1, 16\]"):
        SpeculativeConfig(method, num_tokens)


def test_config_builds_the_proposer() -> None:
    config = SpeculativeConfig("suffix", 6, suffix_max_match=10, suffix_spec_factor=2.0,
                               suffix_min_prob=0.3, suffix_corpus_tokens=500,
                               suffix_corpus_prompts=True)
    proposer = make_proposer(config, None, None)
    assert isinstance(proposer, SuffixProposer) and not proposer.samples_drafts
    assert (proposer.max_match, proposer.spec_factor, proposer.min_prob) == (10, 2.0, 0.3)
    assert proposer.depth == 16 and proposer.corpus.max_tokens == 500
    assert proposer.corpus_prompts and proposer.warmup() == 0
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig("suffixes")


# -- in the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def varied_tiny_model():
    """The tiny preset with small embeddings, so greedy text varies (the session's tiny model
    mostly repeats its last token, which any proposer drafts without a corpus)."""
    import jax.numpy as jnp
    from flax import nnx

    from infer.model.config import get_config
    from infer.model.llama import Llama
    model = Llama(get_config("tiny"), jnp.float32, nnx.Rngs(0))
    model.embed.set_value(model.embed.get_value() * 0.05)
    return model


def test_engine_drafts_from_earlier_outputs_and_keeps_greedy_tokens(varied_tiny_model) -> None:
    """Requests one at a time (one slot): the second prompt is the first again, so its greedy
    output is the first's, which the corpus then drafts; outputs equal plain decoding's with
    and without the corpus."""
    from tests.spec.test_speculative_engine import serve

    prompt = np.random.default_rng(3).integers(1, 500, 12).tolist()
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = serve(varied_tiny_model, None, [prompt, prompt], None, greedy, max_num_seqs=1)
    accepted = {}
    for budget, prompts_too in ((0, False), (1000, False), (1000, True)):
        spec = SpeculativeConfig("suffix", 4, suffix_corpus_tokens=budget,
                                 suffix_corpus_prompts=prompts_too)
        out, stats = serve(varied_tiny_model, None, [prompt, prompt], spec, greedy,
                           max_num_seqs=1)
        assert out == plain, (budget, prompts_too)
        accepted[budget, prompts_too] = stats["accepted"]
    # Without the corpus this random text offers little to draft. With outputs only, the
    # repeat's first step matches its one token (which the corpus saw followed by two others:
    # the draft is wrong), then 4 + 4 + 3 of its 15 decode tokens are drafts (each step's last
    # token is the target's own). With prompts, the first step matches the prompt too: 12.
    assert accepted[0, False] <= 2 and accepted[1000, False] >= 11, accepted
    assert accepted[1000, True] == 12, accepted
