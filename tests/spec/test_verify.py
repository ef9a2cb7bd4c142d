"""Speculative decoding: hand-worked greedy cases, chi-square exactness of the sampled rules on a
toy Markov "model" (and wrong rules that the same check rejects), n-gram proposals."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from infer.spec.ngram import NgramIndex, propose_ngram
from infer.spec.verify import (path_tokens, tree_depth, verify_greedy, verify_sampled,
                               verify_tree_greedy, verify_tree_sampled)

ALPHA = 1e-3  # false-alarm rate of every chi-square test here
V, K, ROWS, ROOT = 6, 3, 40_000, 0
BINARY_TREE = np.array([-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])  # 2 children, 3 levels
CHAIN = np.arange(-1, K)  # [-1, 0, 1, ..., K-1]


def _key(seed: int) -> jax.Array:
    """RBG keys: the rules are the same for any key, and threefry's CPU compile takes seconds."""
    return jax.random.key(seed, impl="rbg")


def _one_hot(tokens, v: int = 10) -> jax.Array:
    return jax.nn.one_hot(jnp.asarray(tokens), v)


# ---------------------------------------------------------------- greedy, hand-worked

def test_verify_greedy_hand_worked() -> None:
    argmax = [[5, 6, 7, 8]] * 5  # the target predicts 5, then 6, 7 and the bonus 8
    drafts = jnp.array([[5, 6, 7], [4, 6, 7], [5, 9, 7], [5, 6, 7], [5, 6, 7]])
    num_draft = jnp.array([3, 3, 3, 1, 0])
    n, tokens = jax.jit(verify_greedy)(_one_hot(argmax), drafts, num_draft)
    assert n.tolist() == [3, 0, 1, 1, 0]
    assert tokens.tolist() == [[5, 6, 7, 8],       # all accepted + bonus
                               [5, -1, -1, -1],    # first rejected: the target's token
                               [5, 6, -1, -1],     # middle rejected
                               [5, 6, -1, -1],     # one draft only: its bonus comes from row 1
                               [5, -1, -1, -1]]    # no draft: plain decoding


# node: 0 root, 1 (3) and 2 (4) under it, 3 (7) and 4 (8) under 1, 5 (1) under 2, 6 (2) under 4
HAND_PARENTS = np.array([-1, 0, 0, 1, 1, 2, 4])
HAND_TOKENS = jnp.array([[0, 3, 4, 7, 8, 1, 2]] * 3)


def test_verify_tree_greedy_hand_worked() -> None:
    argmax = [[3, 8, 5, 0, 2, 0, 9],   # root -> 3 (node 1) -> 8 (node 4) -> 2 (node 6), bonus 9
              [4, 8, 5, 0, 2, 0, 9],   # root -> 4 (node 2), which predicts 5, not its child's 1
              [0, 8, 5, 0, 2, 0, 9]]   # no child of the root is 0
    path, n, nxt = verify_tree_greedy(_one_hot(argmax), HAND_TOKENS, HAND_PARENTS)
    assert path.tolist() == [[0, 1, 4, 6], [0, 2, -1, -1], [0, -1, -1, -1]]
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [9, 5, 0]
    assert path_tokens(HAND_TOKENS, path, n, nxt).tolist() == [
        [3, 8, 2, 9], [4, 5, -1, -1], [0, -1, -1, -1]]
    # A path cut at max_depth stays exact: its last node acts as a leaf.
    path, n, nxt = verify_tree_greedy(_one_hot(argmax), HAND_TOKENS, HAND_PARENTS, max_depth=1)
    assert path.tolist() == [[0, 1], [0, 2], [0, -1]] and nxt.tolist() == [8, 5, 0]
    # Traced parents (one tree per row) need a static max_depth.
    verify = jax.jit(verify_tree_greedy, static_argnames="max_depth")
    traced = verify(_one_hot(argmax), HAND_TOKENS, jnp.tile(HAND_PARENTS, (3, 1)), max_depth=3)
    assert traced[0].tolist() == [[0, 1, 4, 6], [0, 2, -1, -1], [0, -1, -1, -1]]
    with pytest.raises(ValueError):
        tree_depth([-1, 2, 0])  # not in topological order


def test_greedy_equivalences() -> None:
    """A chain is a tree with parents [-1, 0, ..., k-1]: the tree rule gives the chain's result;
    and the sampled rule with one-hot target probabilities is the greedy rule."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(300, K + 1, 5)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    drafts = np.where(rng.random((300, K)) < 0.3, rng.integers(0, 5, (300, K)), argmax[:, :K])
    n, tokens = jax.jit(verify_greedy)(logits, jnp.asarray(drafts), jnp.full(300, K))
    tree_tokens = jnp.asarray(np.concatenate([rng.integers(0, 5, (300, 1)), drafts], 1))
    path, tn, nxt = jax.jit(functools.partial(verify_tree_greedy, parents=CHAIN))(
        logits, tree_tokens)
    assert (tn == n).all() and len(set(n.tolist())) == K + 1  # every count occurs
    assert (path_tokens(tree_tokens, path, tn, nxt) == tokens).all()
    assert (path == jnp.where(jnp.arange(K + 1) <= n[:, None], jnp.arange(K + 1), -1)).all()
    sn, stokens = jax.jit(verify_sampled)(jax.nn.one_hot(argmax, 5), jax.nn.one_hot(drafts, 5),
                                          jnp.asarray(drafts), jnp.full(300, K), _key(0))
    assert (sn == n).all() and (stokens == tokens).all()


# ---------------------------------------------------------------- sampled, edge cases

def test_verify_sampled_edge_cases() -> None:
    p = jnp.array([0.5, 0.5, 0.0, 0.0])
    q_same, q_zero_at_1 = p, jnp.array([1.0, 0.0, 0.0, 0.0])
    target = jnp.stack([p, p, p])[None].repeat(3, 0)  # [3, k+1=3, 4]
    draft = jnp.stack([jnp.stack([q_same] * 2), jnp.stack([q_zero_at_1] * 2),
                       jnp.stack([jnp.array([0.0, 0.0, 1.0, 0.0])] * 2)])
    drafts = jnp.array([[0, 1], [1, 1], [2, 2]])
    verify = jax.jit(verify_sampled)
    n, tokens = verify(target, draft, drafts, jnp.array([2, 2, 2]), _key(0))
    # p == q: always accepted, no NaN; q(x) = 0 < p(x): accepted; p(x) = 0: never accepted.
    assert n.tolist() == [2, 2, 0]
    assert tokens[:2, :2].tolist() == [[0, 1], [1, 1]] and tokens[2, 0] in (0, 1)
    assert (tokens < 2).all() and tokens[2, 1:].tolist() == [-1, -1] and (tokens[:2] >= 0).all()


def test_per_row_keys_ignore_the_batch() -> None:
    """With keys [B], a row's draws depend on its own key only, not on its neighbours'
    (threefry keys, the engine's; RBG's draws under vmap need not have this property)."""
    rng = np.random.default_rng(2)
    target = jnp.asarray(rng.dirichlet(np.ones(50), size=(3, 3)), jnp.float32)
    draft = jnp.asarray(rng.dirichlet(np.ones(50), size=(3, 2)), jnp.float32)
    drafts, num_draft = jnp.asarray(rng.integers(0, 50, (3, 2))), jnp.array([2, 2, 2])
    verify = jax.jit(verify_sampled)
    outs = [verify(target, draft, drafts, num_draft,
                   jax.random.split(jax.random.key(seed), 3).at[2].set(jax.random.key(seed % 2)))
            for seed in range(4)]
    same_key = [(n[2].item(), tokens[2].tolist()) for n, tokens in outs]
    assert same_key[0] == same_key[2] and same_key[1] == same_key[3] and same_key[0] != same_key[1]


# ---------------------------------------------------------------- sampled, exactness

def _toy() -> tuple[jax.Array, jax.Array]:
    """Target P and draft Q: next-token distributions [V, V] given the previous token. The draft
    never proposes token 1 (only the residual can emit it), the target never emits 5 after 2,
    and after 3 the two agree (p == q: the residual is zero)."""
    rng = np.random.default_rng(0)
    P = 0.8 * rng.dirichlet(np.ones(V), size=V) + 0.2 / V
    Q = 0.8 * rng.dirichlet(np.ones(V), size=V) + 0.2 / V
    P[2, 5] = 0.0
    Q[:, 1] = 0.0
    Q[3] = P[3] = Q[3] / Q[3].sum()
    return jnp.asarray(P / P.sum(1, keepdims=True)), jnp.asarray(Q / Q.sum(1, keepdims=True))


def _drafts(Q, roots, key) -> jax.Array:
    """K draft tokens per row sampled autoregressively from Q after `roots`: [B, K]."""
    def draw(prev, kk):
        d = jax.random.categorical(kk, jnp.log(Q[prev])).astype(jnp.int32)
        return d, d
    return jax.lax.scan(draw, roots, jax.random.split(key, K))[1].T


def _chain_round(verify, P, Q, roots, key):
    """One speculative step per row: K drafts from Q (rows offer 0..K of them), checked by P."""
    k_draft, k_verify = jax.random.split(key)
    drafts = _drafts(Q, roots, k_draft)
    inputs = jnp.concatenate([roots[:, None], drafts], axis=1)
    num_draft = jnp.arange(roots.shape[0], dtype=jnp.int32) % (K + 1)
    return verify(P[inputs], Q[inputs[:, :K]], drafts, num_draft, k_verify)


def _chain_as_tree_round(P, Q, roots, key):
    k_draft, k_verify = jax.random.split(key)
    tokens = jnp.concatenate([roots[:, None], _drafts(Q, roots, k_draft)], axis=1)
    path, n, nxt = verify_tree_sampled(P[tokens], tokens, CHAIN, k_verify)
    return n, path_tokens(tokens, path, n, nxt)


def _tree_round(verify, P, Q, roots, key):
    """EAGLE-2-like candidates, not samples: each node's children are the draft's top-2 tokens
    after it, best first, 3 levels deep (15 nodes)."""
    top2 = jnp.argsort(-Q, axis=1)[:, :2]
    tokens = [roots]
    for i in range(1, len(BINARY_TREE)):
        tokens.append(top2[tokens[BINARY_TREE[i]], (i - 1) % 2])
    tokens = jnp.stack(tokens, axis=1).astype(jnp.int32)
    path, n, nxt = verify(P[tokens], tokens, BINARY_TREE, key)
    return n, path_tokens(tokens, path, n, nxt)


def _chain_resample_from_p(target_probs, draft_probs, draft_tokens, num_draft, key):
    """WRONG: the right acceptance test, but a rejected draft is replaced by a sample of p
    instead of max(p - q, 0): tokens the draft likes come out too often."""
    n, tokens = verify_sampled(target_probs, draft_probs, draft_tokens, num_draft, key)
    rows = jnp.arange(n.shape[0])
    fresh = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(target_probs[rows, n]))
    return n, tokens.at[rows, n].set(jnp.where(n < num_draft, fresh, tokens[rows, n]))


def _tree_sequential(target_probs, tree_tokens, parents, key, renormalize=True):
    """The tree rule as literally stated, independent of the library's "draw X, match" form:
    at a node try its children in order, accept c with probability r(c), on rejection remove c's
    mass from r and renormalize; when all are rejected (or at a leaf) draw from r.
    renormalize=False is WRONG: the second child is accepted with (1 - p(c1)) p(c2), not p(c2)."""
    parents, n_nodes, depth = jnp.asarray(parents), len(parents), tree_depth(parents)

    def row(probs, tokens, key):
        def level(carry, d):
            node, alive, emitted = carry
            k_u, k_x = jax.random.split(jax.random.fold_in(key, d))
            u = jax.random.uniform(k_u, (n_nodes,))

            def try_child(j, state):
                resid, taken = state
                trying = (parents[j] == node) & (taken < 0) & (d < depth)
                accept = trying & (u[j] < resid[tokens[j]])
                removed = resid.at[tokens[j]].set(0.0)
                if renormalize:
                    removed = removed / jnp.maximum(removed.sum(), 1e-30)
                return jnp.where(trying & ~accept, removed, resid), jnp.where(accept, j, taken)

            resid, taken = jax.lax.fori_loop(1, n_nodes, try_child, (probs[node], jnp.int32(-1)))
            moved = alive & (taken >= 0)
            x = jax.random.categorical(k_x, jnp.log(resid)).astype(jnp.int32)
            emitted = jnp.where(alive & ~moved, x, emitted)
            return (jnp.where(moved, taken, node), moved, emitted), jnp.where(moved, taken, -1)

        init = (jnp.int32(0), jnp.bool_(True), jnp.int32(-1))
        (_, _, emitted), steps = jax.lax.scan(level, init, jnp.arange(depth + 1))
        path = jnp.concatenate([jnp.zeros(1, jnp.int32), steps[:depth]])
        return path, jnp.sum(steps >= 0).astype(jnp.int32), emitted

    return jax.vmap(row, in_axes=(0, 0, 0))(target_probs, tree_tokens,
                                             jax.random.split(key, tree_tokens.shape[0]))


RULES = {  # name: (one speculative step, exact?)
    "chain": (functools.partial(_chain_round, verify_sampled), True),
    "chain_as_tree": (_chain_as_tree_round, True),
    "tree": (functools.partial(_tree_round, verify_tree_sampled), True),
    "tree_literal": (functools.partial(_tree_round, _tree_sequential), True),
    "WRONG_chain_resample_from_p": (
        functools.partial(_chain_round, _chain_resample_from_p), False),
    "WRONG_tree_no_renormalization": (functools.partial(
        _tree_round, functools.partial(_tree_sequential, renormalize=False)), False),
}


def _first_two(round_fn, P, Q, key):
    """The first two tokens speculative decoding emits after ROOT, ROWS independent times.

    What is exactly testable: the emitted *process* has the target's law, so the first two
    tokens (e1, e2) must follow P[ROOT, e1] P[e1, e2]. When a step emits one token only, e2 is
    the first token of the next step (from e1). Comparing (e1, e2) only over steps that emitted
    two would be wrong even for an exact rule: whether d_1 is accepted depends on e1."""
    round_fn = jax.jit(round_fn)  # one compilation, two calls
    n1, t1 = round_fn(P, Q, jnp.full(ROWS, ROOT, jnp.int32), jax.random.fold_in(key, 1))
    _, t2 = round_fn(P, Q, t1[:, 0], jax.random.fold_in(key, 2))
    return t1[:, 0], jnp.where(n1 >= 1, t1[:, 1], t2[:, 0]), n1


def _chi2(samples: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson statistic of samples against probs (cells expected below 5 pooled; a sample in a
    cell of probability 0 is infinitely wrong) and its threshold at ALPHA."""
    counts = np.bincount(samples, minlength=probs.size)
    expected = probs.ravel() * len(samples)
    if counts[expected == 0].any():
        return np.inf, 0.0
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(((obs - exp) ** 2 / exp).sum()), float(stats.chi2.ppf(1 - ALPHA, len(exp) - 1))


@pytest.mark.parametrize("name", RULES)
def test_sampled_rules_emit_the_target_distribution(name: str) -> None:
    round_fn, exact = RULES[name]
    P, Q = _toy()
    e1, e2, n1 = map(np.asarray, _first_two(round_fn, P, Q, _key(7)))
    P = np.asarray(P, np.float64)
    first = _chi2(e1, P[ROOT])
    pair = _chi2(e1 * V + e2, P[ROOT][:, None] * P)
    print(f"{name}: first token chi2 {first[0]:.1f} (threshold {first[1]:.1f}), "
          f"pair chi2 {pair[0]:.1f} (threshold {pair[1]:.1f}), mean accepted {n1.mean():.2f}")
    passed = first[0] < first[1] and pair[0] < pair[1]
    assert passed == exact, (name, first, pair)


def test_chain_as_tree_accepts_like_a_point_mass_chain() -> None:
    """Same drafts: the tree rule on a chain and the chain rule with q = one_hot(drafts) accept
    each draft with probability p(d) and resample from p without d: the same law of counts."""
    P, Q = _toy()

    @jax.jit
    def counts(key):
        k_draft, k_chain, k_tree = jax.random.split(key, 3)
        roots = jnp.full(ROWS, ROOT, jnp.int32)
        drafts = _drafts(Q, roots, k_draft)
        tokens = jnp.concatenate([roots[:, None], drafts], axis=1)
        n_chain, _ = verify_sampled(P[tokens], jax.nn.one_hot(drafts, V), drafts,
                                    jnp.full(ROWS, K), k_chain)
        _, n_tree, _ = verify_tree_sampled(P[tokens], tokens, CHAIN, k_tree)
        return n_chain, n_tree

    n_chain, n_tree = map(np.asarray, counts(_key(11)))
    table = np.stack([np.bincount(n_chain, minlength=K + 1), np.bincount(n_tree, minlength=K + 1)])
    assert stats.chi2_contingency(table).pvalue > ALPHA, table


# ---------------------------------------------------------------- n-gram proposals

def test_propose_ngram_hand_worked() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], k=3) == [4, 1, 2]
    # The longest n wins over a more recent shorter match: [5, 6] at 0 beats [6] at 4.
    assert propose_ngram([5, 6, 7, 8, 6, 9, 5, 6], k=3) == [7, 8, 6]
    assert propose_ngram([5, 6, 7, 8, 6, 9, 5, 6], k=3, max_n=1) == [9, 5, 6]
    # The most recent occurrence wins; proposals stop at the end of the sequence.
    assert propose_ngram([1, 2, 1, 3, 1], k=5) == [3, 1]
    assert propose_ngram([1, 2, 3, 1, 2], k=5) == [3, 1, 2]
    assert propose_ngram([7, 7, 7], k=4) == [7]  # an occurrence may overlap the suffix
    assert propose_ngram([1, 2, 3], k=3) == [] and propose_ngram([], k=3) == []
    assert propose_ngram([1, 2, 3, 1], k=3, min_n=2) == []
    assert propose_ngram([1, 2, 1], k=0) == []
    with pytest.raises(ValueError):
        propose_ngram([1], k=2, max_n=1, min_n=2)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=60), k=st.integers(0, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_ngram_index_agrees_with_propose_ngram(tokens, k, min_n, extra) -> None:
    index = NgramIndex(max_n=min_n + extra, min_n=min_n)
    for i, token in enumerate(tokens):
        index.append(token)
        assert index.propose(k) == propose_ngram(tokens[:i + 1], k, min_n + extra, min_n)
