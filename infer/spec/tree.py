"""EAGLE-2-style tree speculation at batch 1 over contiguous KV caches, greedy or sampled.

One step, after the target has cached x_0..x_{n-1} and emitted x_n (the *root*):

1. Draft. The EAGLE head first catches up on the rows the target has verified since the last
   step, (h_s, x_{s+1}) with true features, the last being (h_{n-1}, x_n) -> ĥ_n. The root's
   children are the top-`branches` tokens of logits(ĥ_n); then each level's nodes get their
   top-`branches` children, `depth` levels in all: a full tree, so every step has the same
   shapes (2 x 3: 1 + 2 + 4 + 8 = 15 nodes, 14 candidates). `branches=1` is the chain.
2. Verify. One target pass over all nodes with a tree mask (a node sees the cache and its
   ancestors), nodes in consecutive slots n.., each at position n + depth; `verify_tree_greedy`
   / `verify_tree_sampled` pick the accepted path and the target's next token.
3. Compact. The accepted nodes' KV moves to slots n+1..n+m, so the cache is what a plain pass
   over the accepted tokens would have written; the path's features become the head's next
   catch-up rows.

How the head expands a tree: each level is one head call over *all* tree rows so far (BFS
order, so they are a prefix of a fixed-size row block) with the same kind of tree mask the
target uses, written to scratch slots after the head's committed ones. Recomputing the upper
levels costs a few rows of one layer. Keeping them cached instead and adding one level per call
would not work with one cache: the attention shows every cached slot before a call's first new
row, siblings included, so each branch would need a cache of its own.

Everything a step needs stays on device. A `TreeSpeculator` holds its jitted pieces (fixed
shapes: no compile per step or per prompt, beyond one prefill per power-of-two prompt bucket),
and `step` fuses draft + verify + compaction into one dispatch; `PlainGenerator` holds the
baseline's. Nothing is cached per process: a caller that generates more than once keeps the
object, and dropping it frees the programs and the models they were built for. The caches'
bounds are checked on the host before each call (`check_writes`): out of range, the jitted
writes would drop tokens and the compaction would clamp onto other slots, silently.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata, check_writes
from infer.engine.buckets import next_power_of_two
from infer.model.llama import Llama
from infer.spec.eagle_head import EagleHead
from infer.spec.verify import path_tokens, verify_tree_greedy, verify_tree_sampled


def full_tree(branches: int, depth: int) -> np.ndarray:
    """parents [N] of the complete `branches`-ary tree of `depth` levels below the root, in BFS
    order: node i's children are branches*i + 1 .. branches*i + branches."""
    if branches < 1 or depth < 1:
        raise ValueError(f"need branches >= 1 and depth >= 1, got {branches}, {depth}")
    n = sum(branches ** d for d in range(depth + 1))
    return np.array([-1] + [(i - 1) // branches for i in range(1, n)], np.int32)


def _depths(parents: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[N, N] bool: node j is node i or one of its ancestors."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Device state between steps. The target has cached `length` tokens; the head has
    committed slots 0..length-count-1, and `pending_*` [depth+1] hold its next catch-up rows,
    (feature h_s, token x_{s+1}) for s = length-count .. length-1, the last token being the root."""

    target_cache: KVCache
    head_cache: KVCache
    length: jax.Array  # int32 scalar
    pending_features: jax.Array  # [depth+1, E]
    pending_tokens: jax.Array  # [depth+1] int32
    count: jax.Array  # int32 scalar, valid pending rows (>= 1)
    steps: jax.Array  # int32 scalar, verify steps so far (the sampled rule's PRNG stream)

    @property
    def root(self) -> jax.Array:
        return self.pending_tokens[self.count - 1]


def _binder(graphs: tuple):
    """params (target leaves, head leaves) -> (target, head) modules, inside a trace."""
    t_graph, t_def, h_graph, h_def = graphs

    def bind(params):
        t, h = params
        return (nnx.merge(t_graph, jax.tree.unflatten(t_def, t)),
                nnx.merge(h_graph, jax.tree.unflatten(h_def, h)))
    return bind


def _tree_programs(graphs: tuple, branches: int, depth: int):
    """Jitted (draft, verify, step) for one model structure and tree shape."""
    bind = _binder(graphs)
    parents = full_tree(branches, depth)
    node_depth = _depths(parents)
    ancestors = _ancestor_mask(parents)
    n, width = len(parents), depth + 1
    # Head rows: nodes of depth 1..depth-1 (nodes 1..rows), the ones that have children.
    rows = int((node_depth[1:] < depth).sum())
    parent_row = np.maximum(parents[1:rows + 1] - 1, 0)
    under_root = (parents[1:rows + 1] == 0)[:, None]

    def draft(params, state: SpecState) -> tuple[jax.Array, KVCache]:
        """Head catch-up, then the tree's tokens [N] level by level (node 0: the root)."""
        target, head = bind(params)
        meta = AttentionMetadata(
            positions=(state.length - state.count + jnp.arange(width, dtype=jnp.int32))[None],
            lengths=state.length[None], q_lens=state.count[None])
        predicted, cache = head(state.pending_features[None], state.pending_tokens[None],
                                target.embed, state.head_cache, meta)
        h_root = predicted[0, state.count - 1]
        tokens = jnp.full(n, -1, jnp.int32).at[0].set(state.root)
        _, first = jax.lax.top_k(target.logits(h_root), branches)
        tokens = tokens.at[1:1 + branches].set(first.astype(jnp.int32))
        out = jnp.zeros((rows, h_root.shape[-1]), jnp.float32)
        for level in range(2, depth + 1):
            lo, hi = int((node_depth < level - 1).sum()), int((node_depth < level).sum())
            # Row r (node r+1) reads its parent's predicted feature: ĥ_n under the root.
            features = jnp.where(under_root, h_root[None], out[parent_row])
            meta = AttentionMetadata(
                positions=(state.length + node_depth[1:rows + 1] - 1)[None],
                lengths=(state.length + hi - 1)[None], q_lens=jnp.int32(hi - 1)[None],
                tree_mask=jnp.asarray(ancestors[1:rows + 1, 1:rows + 1])[None])
            pred, cache = head(features[None], jnp.maximum(tokens[1:rows + 1], 0)[None],
                               target.embed, cache, meta)
            out = pred[0]
            _, kids = jax.lax.top_k(target.logits(out[lo - 1:hi - 1]), branches)
            tokens = tokens.at[branches * lo + 1:branches * hi + 1].set(
                kids.reshape(-1).astype(jnp.int32))
        return tokens, cache

    def verify(params, state: SpecState, tokens: jax.Array, temperature: jax.Array,
               seed: jax.Array, sampled: bool) -> tuple[SpecState, jax.Array, jax.Array]:
        """Target pass over the tree, the accepted path, compaction. Returns (state,
        emitted [depth+1] (accepted candidates, the target's token, then -1), accepted)."""
        target, _ = bind(params)
        meta = AttentionMetadata(positions=(state.length + node_depth)[None],
                                 lengths=(state.length + n)[None], q_lens=jnp.int32(n)[None],
                                 tree_mask=jnp.asarray(ancestors)[None])
        logits, hidden, cache = target(tokens[None], state.target_cache, meta)
        if sampled:
            probs = jax.nn.softmax(logits / temperature, axis=-1)
            key = jax.random.fold_in(jax.random.key(seed), state.steps + 1)
            path, accepted, nxt = verify_tree_sampled(probs, tokens[None], parents, key)
        else:
            path, accepted, nxt = verify_tree_greedy(logits, tokens[None], parents)
        emitted = path_tokens(tokens[None], path, accepted, nxt)[0]
        cache = compact(cache, state.length, path[0])
        keep = jnp.arange(width) <= accepted[0]
        features = jnp.where(keep[:, None], hidden[0, jnp.maximum(path[0], 0)], 0.0)
        return dataclasses.replace(
            state, target_cache=cache, length=state.length + accepted[0] + 1,
            pending_features=features, pending_tokens=jnp.where(keep, emitted, 0),
            count=accepted[0] + 1, steps=state.steps + 1), emitted, accepted[0]

    def step(params, state, temperature, seed, sampled):
        tokens, head_cache = draft(params, state)
        state = dataclasses.replace(state, head_cache=head_cache)
        return verify(params, state, tokens, temperature, seed, sampled)

    return (jax.jit(draft), jax.jit(verify, static_argnums=5, donate_argnums=1),
            jax.jit(step, static_argnums=4, donate_argnums=1))


def _prefill_program(graphs: tuple, depth: int, max_len: int):
    """Jitted prefill of the target and the head over a prompt."""
    bind = _binder(graphs)

    def prefill(params, tokens, length, temperature, seed, sampled):
        """Target and head over the prompt [P] (padded past `length`); samples x_n."""
        target, head = bind(params)
        c, p = target.config, tokens.shape[0]
        cache = KVCache.create(c.num_layers, 1, max_len, c.num_kv_heads, c.head_dim)
        meta = AttentionMetadata.for_prefill(length[None], p)
        logits, hidden, cache = target(tokens[None], cache, meta,
                                       logit_index=(length - 1)[None, None])
        logits = logits[0, 0]
        if sampled:
            key = jax.random.fold_in(jax.random.key(seed), 0)
            first = jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        else:
            first = jnp.argmax(logits).astype(jnp.int32)
        # The head commits rows 0..n-2, (h_s, x_{s+1}); (h_{n-1}, x_n) is the first pending.
        head_cache = head.create_cache(1, max_len)
        meta = AttentionMetadata.for_prefill((length - 1)[None], p)
        _, head_cache = head(hidden, jnp.roll(tokens, -1)[None], target.embed, head_cache, meta)
        width = depth + 1
        features = jnp.zeros((width, c.hidden_size), jnp.float32).at[0].set(
            hidden[0, length - 1])
        return SpecState(target_cache=cache, head_cache=head_cache, length=length,
                         pending_features=features,
                         pending_tokens=jnp.zeros(width, jnp.int32).at[0].set(first),
                         count=jnp.int32(1), steps=jnp.int32(0))

    return jax.jit(prefill, static_argnums=5)


class TreeSpeculator:
    """EAGLE tree (or chain, `branches=1`) speculation for one target and head, caches of
    `max_len` slots. The head and target weights are read once, here (later edits are unseen);
    their structure is closed over and their arrays are passed as arguments, as in `DeviceSteps`.
    It holds its compiled programs: generate through one object to compile once."""

    def __init__(self, target: Llama, head: EagleHead, branches: int, depth: int,
                 max_len: int = 512) -> None:
        self.config = target.config
        self.target, self.head = target, head
        self.branches, self.depth, self.max_len = branches, depth, max_len
        self.parents = full_tree(branches, depth)
        self.num_nodes = len(self.parents)
        t_graph, t_state = nnx.split(target)
        h_graph, h_state = nnx.split(head)
        t_leaves, t_def = jax.tree.flatten(t_state)
        h_leaves, h_def = jax.tree.flatten(h_state)
        self.params = (t_leaves, h_leaves)
        graphs = (t_graph, t_def, h_graph, h_def)
        self._draft, self._verify, self._step = _tree_programs(graphs, branches, depth)
        self._prefill = _prefill_program(graphs, depth, max_len)

    # -- the pieces, for tests and timing -----------------------------------------------------

    def prefill(self, prompt_ids: Sequence[int], temperature: float = 0.0, seed: int = 0
                ) -> SpecState:
        """The state after the prompt (its first generated token is `state.root`)."""
        n = len(prompt_ids)
        if n < 1 or n + self.num_nodes > self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_len={self.max_len}")
        p = min(next_power_of_two(n, 16), self.max_len)
        tokens = np.zeros(p, np.int32)
        tokens[:n] = prompt_ids
        return self._prefill(self.params, jnp.asarray(tokens), jnp.int32(n),
                             jnp.float32(max(temperature, 1e-6)), jnp.uint32(seed),
                             temperature > 0)

    def _check_room(self, state: SpecState) -> None:
        """Draft, verify and step write slots [length, length + N) of both caches (the head's
        catch-up rows lie below length)."""
        length = int(state.length)
        check_writes(length, length + self.num_nodes, self.max_len)

    def draft(self, state: SpecState) -> tuple[jax.Array, KVCache]:
        """The candidate tree's tokens [N] (order of `self.parents`) and the head's cache."""
        self._check_room(state)
        return self._draft(self.params, state)

    def verify(self, state: SpecState, tree_tokens: jax.Array, temperature: float = 0.0,
               seed: int = 0) -> tuple[SpecState, jax.Array, jax.Array]:
        """Verifies a given tree (root: `state.root`); donates `state`."""
        self._check_room(state)
        return self._verify(self.params, state, jnp.asarray(tree_tokens, jnp.int32),
                            jnp.float32(max(temperature, 1e-6)), jnp.uint32(seed),
                            temperature > 0)

    def step(self, state: SpecState, temperature: float = 0.0, seed: int = 0
             ) -> tuple[SpecState, jax.Array, jax.Array]:
        """Draft + verify + compaction in one dispatch; donates `state`. Returns (state,
        emitted [depth+1], accepted candidates)."""
        self._check_room(state)
        return self._step(self.params, state, jnp.float32(max(temperature, 1e-6)),
                          jnp.uint32(seed), temperature > 0)

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, eos_ids: Sequence[int] = ()
                 ) -> tuple[list[int], dict[str, float]]:
        """Generated token ids (at most max_new_tokens, stopping after an eos id) and stats:
        verify_steps, accepted (candidates accepted in all), full_steps (steps that accepted a
        whole path of `depth`), mean_accepted and tokens_per_step (per verify step), prefill_s
        (to the first token), decode_s and decode_tok_s (the steps after it)."""
        if len(prompt_ids) + max_new_tokens + self.num_nodes > self.max_len:
            raise ValueError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens + a tree of "
                             f"{self.num_nodes} exceed max_len={self.max_len}")
        start = time.perf_counter()
        state = self.prefill(prompt_ids, temperature, seed)
        out = [int(state.root)]
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        accepted_total, steps, full, stop = 0, 0, 0, set(eos_ids)
        while len(out) < max_new_tokens and out[-1] not in stop:
            state, emitted, accepted = self.step(state, temperature, seed)
            emitted, accepted = np.asarray(emitted), int(accepted)
            steps += 1
            accepted_total += accepted
            full += accepted == self.depth
            for token in emitted[:accepted + 1].tolist():
                out.append(token)
                if token in stop or len(out) == max_new_tokens:
                    break
        decode_s = time.perf_counter() - start
        return out, {"verify_steps": steps, "accepted": accepted_total, "full_steps": full,
                     "mean_accepted": accepted_total / steps if steps else float("nan"),
                     "tokens_per_step": (accepted_total + steps) / steps if steps else float("nan"),
                     "prefill_s": prefill_s, "decode_s": decode_s,
                     "decode_tok_s": (len(out) - 1) / decode_s if decode_s > 0 else float("nan")}


def compact(cache: KVCache, length: jax.Array, path: jax.Array) -> KVCache:
    """Moves the KV of the accepted path's nodes (tree slots length + path[j]) to slots
    length + j, for every layer. Entries past the path (-1) copy their own slot: those slots
    lie past the new length and are overwritten later."""
    width = path.shape[0]
    src = length + jnp.where(path >= 0, path, jnp.arange(width, dtype=path.dtype))
    # Gather everything before writing anything: a node may move onto a slot another one leaves.
    move = lambda x: jax.lax.dynamic_update_slice(x, jnp.take(x, src, axis=2),
                                                  (0, 0, length, 0))
    return KVCache(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def eagle_generate(target: Llama, head: EagleHead, prompt_ids: Sequence[int],
                   max_new_tokens: int, *, branches: int, depth: int, temperature: float = 0.0,
                   seed: int = 0, eos_ids: Sequence[int] = (), max_len: int | None = None
                   ) -> tuple[list[int], dict[str, float]]:
    """Generates with EAGLE tree speculation (`branches=1`: a chain of `depth` drafts); exact:
    greedy output equals the target's greedy decoding, sampled output follows its distribution
    at `temperature`. Returns (token ids, stats: see `TreeSpeculator.generate`). `max_len` (the
    caches' slots) defaults to a power of two >= 256 that fits. One call, one compilation:
    to generate more than once, keep a `TreeSpeculator`."""
    need = len(prompt_ids) + max_new_tokens + sum(branches ** d for d in range(depth + 1))
    spec = TreeSpeculator(target, head, branches, depth, max_len or next_power_of_two(need, 256))
    return spec.generate(prompt_ids, max_new_tokens, temperature=temperature, seed=seed,
                         eos_ids=eos_ids)


class PlainGenerator:
    """The baseline over the same contiguous cache layout: one target step per token, caches of
    `max_len` slots. Like `TreeSpeculator`, it reads the weights once and holds its compiled
    prefill and decode: generate through one object to compile once."""

    def __init__(self, target: Llama, max_len: int = 512) -> None:
        self.max_len = max_len
        graphdef, state = nnx.split(target)
        self.params, treedef = jax.tree.flatten(state)

        def bind(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def pick(logits, temperature, seed, index, sampled):
            if not sampled:
                return jnp.argmax(logits).astype(jnp.int32)
            key = jax.random.fold_in(jax.random.key(seed), index)
            return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

        def prefill(params, tokens, length, temperature, seed, sampled):
            model = bind(params)
            c = model.config
            cache = KVCache.create(c.num_layers, 1, max_len, c.num_kv_heads, c.head_dim)
            meta = AttentionMetadata.for_prefill(length[None], tokens.shape[0])
            logits, _, cache = model(tokens[None], cache, meta,
                                     logit_index=(length - 1)[None, None])
            return pick(logits[0, 0], temperature, seed, 0, sampled), cache

        def decode(params, cache, token, length, index, temperature, seed, sampled):
            logits, _, cache = bind(params)(token[None, None], cache,
                                            AttentionMetadata.for_decode(length[None]))
            return pick(logits[0, 0], temperature, seed, index, sampled), cache

        self._prefill = jax.jit(prefill, static_argnums=5)
        self._decode = jax.jit(decode, static_argnums=7, donate_argnums=1)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, eos_ids: Sequence[int] = ()
                 ) -> tuple[list[int], dict[str, float]]:
        """Generated token ids (at most max_new_tokens, stopping after an eos id) and stats:
        prefill_s, decode_s, decode_tok_s, decode_step_s."""
        n, max_len = len(prompt_ids), self.max_len
        if n + max_new_tokens > max_len:
            raise ValueError(f"{n} prompt + {max_new_tokens} new tokens exceed max_len={max_len}")
        p = min(next_power_of_two(n, 16), max_len)
        tokens = np.zeros(p, np.int32)
        tokens[:n] = prompt_ids
        temp, sd, sampled = jnp.float32(max(temperature, 1e-6)), jnp.uint32(seed), temperature > 0
        start = time.perf_counter()
        token, cache = self._prefill(self.params, jnp.asarray(tokens), jnp.int32(n), temp, sd,
                                     sampled)
        out = [int(token)]
        prefill_s = time.perf_counter() - start
        start, stop = time.perf_counter(), set(eos_ids)
        while len(out) < max_new_tokens and out[-1] not in stop:
            # The fed token goes to slot n + len(out) - 1 < max_len (checked above).
            token, cache = self._decode(self.params, cache, token, jnp.int32(n + len(out) - 1),
                                        jnp.int32(len(out)), temp, sd, sampled)
            out.append(int(token))
        decode_s = time.perf_counter() - start
        steps = len(out) - 1
        return out, {"prefill_s": prefill_s, "decode_s": decode_s,
                     "decode_tok_s": steps / decode_s if decode_s > 0 else float("nan"),
                     "decode_step_s": decode_s / steps if steps else float("nan")}


def plain_generate(target: Llama, prompt_ids: Sequence[int], max_new_tokens: int, *,
                   temperature: float = 0.0, seed: int = 0, eos_ids: Sequence[int] = (),
                   max_len: int = 512) -> tuple[list[int], dict[str, float]]:
    """`PlainGenerator(target, max_len).generate(...)`: one call, one compilation (keep a
    `PlainGenerator` to generate more than once)."""
    return PlainGenerator(target, max_len).generate(prompt_ids, max_new_tokens,
                                                    temperature=temperature, seed=seed,
                                                    eos_ids=eos_ids)
