"""Exact verification for speculative decoding: short pure functions, jittable, static shapes.

Chain layout. After the last accepted token t a proposer offers drafts d_0..d_{k-1}. The target
runs over the k+1 inputs [t, d_0, ..., d_{k-1}]; its output row i predicts the token after
input i, so row i judges draft d_i and row num_draft[b] gives the bonus token. A row may offer
fewer drafts than k (`num_draft` [B]); draft positions >= num_draft are ignored.

Both chain rules return `num_accepted` [B] (n, 0 <= n <= num_draft) and `tokens` [B, k+1]:
tokens[b, :n+1] = d_0..d_{n-1} then one token from the target (its correction at the first
rejection, or the bonus after all drafts), and -1 after that. The cache entries the verify pass
wrote for t, d_0..d_{n-1} are valid, so a row's length advances by n+1; tokens[b, n] is not in the
cache yet: it is the next step's input, exactly like a sampled token in plain decoding.

Tree layout. Node 0 is the root (the last accepted token t); every other node is a candidate
token whose parent comes earlier (`parents` [N], -1 for the root, or [B, N] for one tree per row;
pad unused nodes with token -1, which never matches). The target runs over the N nodes with a
tree mask (a node sees the cache and its ancestors) at positions len + depth(node); its row n
predicts the token after node n. `max_depth` is computed from concrete `parents` (NumPy, the
usual case); pass it (static) when `parents` is traced. The tree functions return `path`
[B, max_depth+1] (node indices of the accepted path, path[:, 0] = 0, -1 past its end),
`num_accepted` [B] (candidates on the path) and `next_token` [B]; `path_tokens` turns these into
the chain rules' `tokens` layout. The accepted nodes' cache entries sit at their tree slots: the
engine must move them to contiguous positions len+1..len+n (the root's stays at len).

Sampled rules take one PRNG key (one draw for the whole batch) or keys [B], one per row (the
verify stream, `sampling.verify_keys(seeds, sample_index)`: with threefry keys a row's draws
then ignore its batch neighbours). Each rule makes a single random draw: a few uniforms per
row, for the acceptance tests and for the inverse-CDF draws (`sampling.inverse_cdf_pick`) of the
emitted tokens.
Probabilities are those of the row's sampling distribution (after temperature / top-k / top-p);
a greedy row can pass one-hot probabilities. A deterministic proposer (n-gram, or a draft model
run greedily) must pass `draft_probs = one_hot(draft_tokens)`: point-mass proposals keep the rule
exact (accept with p(x), resample from p without x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from infer.sampling import (SamplingArrays, argmax, inverse_cdf_pick, sampling_probs,
                             verify_keys)

_TINY = float(np.finfo(np.float32).tiny)


def verify_greedy(target_logits: jax.Array, draft_tokens: jax.Array,
                  num_draft: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, k+1, V], [B, k], [B] -> num_accepted [B], tokens [B, k+1]: accept drafts while they
    equal the target's argmax, then emit the target's argmax at the first mismatch (or bonus)."""
    k = draft_tokens.shape[1]
    target = argmax(target_logits)  # [B, k+1]
    ok = (draft_tokens == target[:, :k]) & (jnp.arange(k) < num_draft[:, None])
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    last = jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
    return n, _emit(draft_tokens, n, last)


def verify_sampled(target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array,
                   num_draft: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, k+1, V], [B, k, V], [B, k], [B], key -> num_accepted [B], tokens [B, k+1] (k >= 1).

    Leviathan et al. / Chen et al.: accept d_i with probability min(1, p(d_i) / q(d_i)); at the
    first rejection emit a token from normalize(max(p - q, 0)); after all drafts a bonus from p.
    A token is then emitted with probability min(p, q) + (1 - sum min(p, q)) * resid = p exactly.
    """
    (batch, k), vocab = draft_tokens.shape, target_probs.shape[-1]
    rows = jnp.arange(batch)
    # One draw per row serves the k acceptance tests and the residual's inverse-CDF draw.
    noise = _uniform(key, batch, (k + 1,))
    u = noise[:, :k]
    tok = jnp.clip(draft_tokens, 0, vocab - 1)[..., None]
    p = jnp.take_along_axis(target_probs[:, :k], tok, axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, tok, axis=-1)[..., 0]
    # u < p / q without dividing: q = 0 accepts whatever the target allows; p = 0 never passes.
    ok = (u * q < p) & (jnp.arange(k) < num_draft[:, None])
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_n = target_probs[rows, n]
    q_n = jnp.where((n < num_draft)[:, None], draft_probs[rows, jnp.minimum(n, k - 1)], 0.0)
    resid = jnp.maximum(p_n - q_n, 0.0)
    # p == q leaves no residual; a rejection then has probability 0, so any fallback is exact.
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_n)
    last = inverse_cdf_pick(noise[:, k], resid)
    return n, _emit(draft_tokens, n, last)


def verify_tree_greedy(target_logits: jax.Array, tree_tokens: jax.Array, parents,
                       max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, N, V], [B, N], [N] or [B, N] -> path [B, max_depth+1], num_accepted [B], next [B]:
    from the root, step to the first child whose token is the target's argmax at the current
    node, as deep as possible; next_token is the argmax at the last node of the path."""
    def choose(logits, node, step):
        return argmax(logits[node])
    return _walk(choose, (target_logits,), tree_tokens, parents, max_depth)


def verify_tree_sampled(target_probs: jax.Array, tree_tokens: jax.Array, parents, key: jax.Array,
                        max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, N, V], [B, N], [N] or [B, N], key -> path, num_accepted, next_token (as the greedy).

    For candidate sets that are not samples of the draft (EAGLE-2's top-k expansion, n-gram).
    The rule, with point-mass proposals: at a node, try its children c_1, c_2, ... in order;
    accept c_j with probability r_j(c_j), where r_1 = p (the target at the node) and r_{j+1} is
    r_j with c_j's mass removed and renormalized; if none is accepted (or the node is a leaf),
    emit a token drawn from the last residual. With distinct tokens, r_j = p / (1 - p(c_1..c_{j-1}))
    off the rejected ones, so c_j is accepted with probability prod_{i<j}(1 - r_i(c_i)) * r_j(c_j)
    = p(c_j), and a token y outside the children is emitted with probability
    (1 - p(children)) * p(y) / (1 - p(children)) = p(y); a repeated token has residual 0.
    That is exactly the law of "draw X ~ p at the node, accept the first child whose token is X,
    else emit X", which is what this function does (with no renormalization to divide by 0).
    Each visited node draws its own X, so the emitted sequence is the target's own token-by-token
    sampling: exact for any candidate tree, whatever the children's order (which only decides
    which duplicate, if any, is taken).
    """
    def choose(probs, u, node, step):  # a draw from probs[node], a uniform per step
        return inverse_cdf_pick(u[step], probs[node])
    depth = tree_depth(parents) if max_depth is None else max_depth
    u = _uniform(key, len(target_probs), (depth + 1,))
    return _walk(choose, (target_probs, u), tree_tokens, parents, depth)


def path_tokens(tree_tokens: jax.Array, path: jax.Array, num_accepted: jax.Array,
                next_token: jax.Array) -> jax.Array:
    """The tree rules' outputs in the chain rules' layout: tokens [B, max_depth+1] whose first
    num_accepted+1 entries are the path's candidate tokens then next_token, and -1 after."""
    accepted = jnp.take_along_axis(tree_tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    return _emit(accepted, num_accepted, next_token)


def tree_depth(parents) -> int:
    """Depth of the deepest node (the root has depth 0) of a concrete parents array [N] / [B, N]."""
    parents = np.atleast_2d(np.asarray(parents))
    n = parents.shape[1]
    if not (parents[:, 0] == -1).all() or not (parents[:, 1:] < np.arange(1, n)).all() \
            or (parents[:, 1:] < 0).any():
        raise ValueError(f"parents must be -1 at the root and < own index elsewhere: {parents}")
    depth = np.zeros(parents.shape, np.int64)
    for i in range(1, n):
        depth[:, i] = depth[np.arange(len(parents)), parents[:, i]] + 1
    return int(depth.max())


def tree_structure(parents: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """depth [N] and the ancestor mask [N, N] (node j is node i or one of its ancestors) of a
    tree given by parents [N] (-1 at the root; traced, e.g. a tree chosen on device) whose
    nodes lie at most `max_depth` below the root."""
    parents = jnp.asarray(parents, jnp.int32)
    nodes = jnp.arange(parents.shape[-1], dtype=jnp.int32)
    mask = nodes[:, None] == nodes[None, :]
    depth = jnp.zeros_like(nodes)
    up = nodes
    for _ in range(max_depth):
        above = parents[up]
        live = above >= 0
        depth += live
        up = jnp.where(live, above, up)  # stays at the root once there
        mask |= up[:, None] == nodes[None, :]
    return depth, mask


def _walk(choose, row_args, tree_tokens, parents, max_depth):
    """Per row: at the current node take the target's token x = choose(*row_args, node, step);
    move to the first child whose token is x, or stop and emit x. max_depth+1 steps, the last one
    only emits (a path cut at max_depth is still exact: its last node is treated as a leaf)."""
    depth = tree_depth(parents) if max_depth is None else max_depth
    batch, n = tree_tokens.shape
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch, n))

    def row(args, tokens, parents):
        def step(carry, d):
            node, alive, emitted = carry
            x = choose(*args, node, d).astype(jnp.int32)
            hit = (parents == node) & (tokens == x) & (d < depth)
            child = jnp.argmax(hit).astype(jnp.int32)  # the first hit
            moved = alive & hit[child]
            emitted = jnp.where(alive & ~moved, x, emitted)
            return (jnp.where(moved, child, node), moved, emitted), jnp.where(moved, child, -1)

        init = (jnp.int32(0), jnp.bool_(True), jnp.int32(-1))
        (_, _, emitted), steps = jax.lax.scan(step, init, jnp.arange(depth + 1))
        path = jnp.concatenate([jnp.zeros(1, jnp.int32), steps[:depth]])
        return path, jnp.sum(steps >= 0).astype(jnp.int32), emitted

    return jax.vmap(row)(row_args, tree_tokens, parents)


def _emit(drafts: jax.Array, n: jax.Array, last: jax.Array) -> jax.Array:
    """[B, k], [B], [B] -> [B, k+1]: drafts[:n], then last, then -1."""
    pos = jnp.arange(drafts.shape[1] + 1)
    padded = jnp.pad(drafts.astype(jnp.int32), ((0, 0), (0, 1)))
    return jnp.where(pos < n[:, None], padded, jnp.where(pos == n[:, None], last[:, None], -1))


def _uniform(key: jax.Array, batch: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms in (0, 1) [batch, *shape]: one draw from one key (typed or raw uint32[2]), or
    one draw per row from keys [batch] (a row's randomness then ignores its batch neighbours)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        return jax.random.uniform(key, (batch, *shape), minval=_TINY)
    return jax.vmap(lambda row_key: jax.random.uniform(row_key, shape, minval=_TINY))(key)


def verify_chain(logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array,
                 draft_probs: jax.Array | None, sampling: SamplingArrays, sample_index: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Verifies each row with its own rule: greedy rows by argmax, sampled rows by rejection
    sampling against their sampling distribution (temperature, top-k, top-p applied to the
    target's logits), with the verify stream's key of `sample_index` [B] (the row's tokens
    sampled before this step). Deterministic proposals (draft_probs None) are point masses."""
    n_greedy, greedy = verify_greedy(logits, draft_tokens, num_draft)

    def sampled(_):
        p = sampling_probs(logits, sampling)
        v = logits.shape[-1]
        q = jax.nn.one_hot(draft_tokens, v, dtype=p.dtype) if draft_probs is None else draft_probs
        n, out = verify_sampled(p, q, draft_tokens, num_draft,
                                verify_keys(sampling.seeds, sample_index))
        use = sampling.temperature > 0
        return jnp.where(use, n, n_greedy), jnp.where(use[:, None], out, greedy)

    return jax.lax.cond(jnp.any(sampling.temperature > 0), sampled,
                        lambda _: (n_greedy, greedy), None)


def verify_tree(logits: jax.Array, tree_tokens: jax.Array, parents: jax.Array,
                sampling: SamplingArrays, sample_index: jax.Array, max_depth: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify_chain` for trees, one per row (tokens and parents [B, N], node 0 the root, -1
    tokens never accepted): greedy rows walk the target's argmax, sampled rows the tree rule
    against their sampling distribution with the verify stream's key of `sample_index` [B].
    Returns path [B, max_depth+1], num_accepted [B], next_token [B] (`verify_tree_greedy`)."""
    greedy = verify_tree_greedy(logits, tree_tokens, parents, max_depth)

    def sampled(_):
        drawn = verify_tree_sampled(sampling_probs(logits, sampling), tree_tokens, parents,
                                    verify_keys(sampling.seeds, sample_index), max_depth)
        use = sampling.temperature > 0
        return tuple(jnp.where(use.reshape(-1, *[1] * (a.ndim - 1)), a, g)
                     for a, g in zip(drawn, greedy))

    return jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, lambda _: greedy, None)
