"""EAGLE-2-style tree speculation at batch 1 over contiguous KV caches, greedy or sampled (the
engine runs trees at any batch over its paged cache: `SpeculativeConfig(tree=...)`).

One step, after the target has cached x_0..x_{n-1} and emitted x_n (the *root*):

1. Draft. The EAGLE head first catches up on the rows the target has verified since the last
   step, (h_s, x_{s+1}) with true features, the last being (h_{n-1}, x_n) -> ĥ_n. The root's
   children are the top-`branches` tokens of logits(ĥ_n); then each level's nodes get their
   top-`branches` children, `depth` levels in all: a full tree, so every step has the same
   shapes (2 x 3: 1 + 2 + 4 + 8 = 15 nodes, 14 candidates). `branches=1` is the chain.
   EAGLE-2's dynamic tree (a `budget`, `TreeShape`) instead expands only the `width` nodes of
   each level whose path the head finds likeliest (cumulative log-probability), then verifies
   the `budget` likeliest of all it drafted: the tree is deep where the head is sure and wide
   where it is not, chosen on device, with the same node count every step.
2. Verify. One target pass over all nodes with a tree mask (a node sees the cache and its
   ancestors), nodes in consecutive slots n.., each at position n + depth; `verify_tree_greedy`
   / `verify_tree_sampled` pick the accepted path and the target's next token. The sampled rule
   judges against the request's own sampling distribution (temperature, top-k, top-p:
   `infer.sampling.sampling_probs`) with the verify stream's key, so the output follows exactly
   the distribution plain sampling with the same `SamplingParams` draws from.
3. Compact. The accepted nodes' KV moves to slots n+1..n+m, so the cache is what a plain pass
   over the accepted tokens would have written; the path's features become the head's next
   catch-up rows.

The head's drafting (`draft_tree`, batched) lives in `infer.spec.tree_draft`, which the engine's
EAGLE proposer shares.

The target runs on the engine's `DeviceSteps`: its prompt goes through `prefill_step` (the
program the simple loop runs, sampling the first token like it), and the tree programs take the
target's weights from the same binding, so a baseline and a speculator built on one
`DeviceSteps` bind the target once. Everything a step needs stays on device. A `TreeSpeculator`
holds its jitted pieces (fixed shapes: no compile per step or per prompt, beyond one prefill
per power-of-two prompt bucket), and `step` fuses draft + verify + compaction into one
dispatch. The host loop around the steps is the simple loop's `timed_generate` (see
`tree_generate`), the same one the plain baseline runs. Nothing is cached per process: a caller
that generates more than once keeps the object, and dropping it frees the programs and the
models they were built for. The caches' bounds are checked on the host before each call
(`check_writes`): out of range, the jitted writes would drop tokens and the compaction would
clamp onto other slots, silently.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata, check_writes
from infer.engine.buckets import next_power_of_two, prompt_bucket
from infer.engine.device_steps import DeviceSteps, verify_tree_pass
from infer.engine.simple_loop import check_loop_params, timed_generate
from infer.model.binding import binding
from infer.model.llama import Llama
from infer.sampling import SamplingArrays
from infer.sampling_params import SamplingParams
from infer.spec.eagle_head import EagleHead
from infer.spec.draft_vocab import draft_vocab_rows
from infer.spec.tree_draft import TreeShape, draft_tree, full_tree, top_children
from infer.spec.verify import tree_depth

Bind = Callable[[tuple], tuple[Llama, EagleHead]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Device state between steps. The target has cached `length` tokens; the head has
    committed slots 0..length-count-1, and `pending_*` [depth+1] hold its next catch-up rows,
    (feature h_s, token x_{s+1}) for s = length-count .. length-1, the last token being the root.
    A greedy request's verify skips the sampled rule at run time (`verify_tree`)."""

    target_cache: KVCache
    head_cache: KVCache
    length: jax.Array  # int32 scalar
    pending_features: jax.Array  # [depth+1, F], the target's features (`head.feature_size`)
    pending_tokens: jax.Array  # [depth+1] int32
    count: jax.Array  # int32 scalar, valid pending rows (>= 1)
    sample_index: jax.Array  # int32 scalar, tokens emitted so far (the PRNG streams' index)
    sampling: SamplingArrays  # one row

    @property
    def root(self) -> jax.Array:
        return self.pending_tokens[self.count - 1]


def _tree_programs(bind: Bind, shape: TreeShape):
    """Jitted (draft, verify, step) for one model structure and tree shape. `draft` returns
    the tree, tokens [N] and parents [N] (node 0: the root), and the head's cache."""
    depth, width, n = shape.depth, shape.depth + 1, shape.num_nodes

    def catch_up(target: Llama, head: EagleHead, state: SpecState) -> tuple[jax.Array, KVCache]:
        """The head over its pending rows: the root's predicted feature ĥ_n, and its cache."""
        meta = AttentionMetadata.for_prefill(state.count[None], width,
                                             cached=(state.length - state.count)[None])
        predicted, cache = head(head.features_in(state.pending_features[None]),
                                state.pending_tokens[None], target.embed, state.head_cache,
                                meta)
        return predicted[0, state.count - 1], cache

    def draft(params, state: SpecState) -> tuple[jax.Array, jax.Array, KVCache]:
        (target, head), vocab = bind(params), params[2]
        h_root, cache = catch_up(target, head, state)

        def call_head(features, tokens, meta, cache):
            return head(features, tokens, target.embed, cache, meta)

        tokens, parents, _, cache = draft_tree(
            shape, call_head, lambda h, k: top_children(target, vocab, h, k), cache,
            h_root[None], state.root[None], state.length[None], jnp.ones(1, bool))
        return tokens[0], parents[0], cache

    def verify(params, state: SpecState, tokens: jax.Array, parents: jax.Array
               ) -> tuple[SpecState, jax.Array, jax.Array]:
        """Target pass over the tree, the accepted path, compaction. Returns (state,
        emitted [depth+1] (accepted candidates, the target's token, then -1), accepted)."""
        target, head = bind(params)
        meta = AttentionMetadata.for_prefill(jnp.int32(n)[None], n, cached=state.length[None])
        _, accepted, emitted, hidden, cache = verify_tree_pass(
            target, state.target_cache, tokens[None], parents[None], meta, state.sampling,
            state.sample_index[None], depth, head.feature_layers)
        emitted = emitted[0]
        keep = jnp.arange(width) <= accepted[0]
        features = jnp.where(keep[:, None], hidden[0], 0.0)
        return dataclasses.replace(
            state, target_cache=cache, length=state.length + accepted[0] + 1,
            pending_features=features, pending_tokens=jnp.where(keep, emitted, 0),
            count=accepted[0] + 1, sample_index=state.sample_index + accepted[0] + 1
        ), emitted, accepted[0]

    def step(params, state):
        tokens, parents, head_cache = draft(params, state)
        return verify(params, dataclasses.replace(state, head_cache=head_cache), tokens,
                      parents)

    return (jax.jit(draft), jax.jit(verify, donate_argnums=1),
            jax.jit(step, donate_argnums=1))


def _head_prefill_program(bind: Bind, depth: int, max_len: int):
    """Jitted: the head over the prompt's true features, and the state after the prompt."""

    def prefill(params, target_cache, hidden, tokens, length, first, sampling):
        """hidden [1, P, E] and tokens [1, P] of the target's prefill (padded past `length`),
        its first token `first` [1]."""
        target, head = bind(params)
        # The head commits rows 0..n-2, (h_s, x_{s+1}); (h_{n-1}, x_n) is the first pending.
        meta = AttentionMetadata.for_prefill((length - 1)[None], tokens.shape[1])
        _, head_cache = head(head.features_in(hidden), jnp.roll(tokens, -1, axis=1), target.embed,
                             head.create_cache(1, max_len), meta)
        width = depth + 1
        features = jnp.zeros((width, hidden.shape[-1]), jnp.float32).at[0].set(
            hidden[0, length - 1])
        return SpecState(target_cache=target_cache, head_cache=head_cache, length=length,
                         pending_features=features,
                         pending_tokens=jnp.zeros(width, jnp.int32).at[0].set(first[0]),
                         count=jnp.int32(1), sample_index=jnp.int32(1), sampling=sampling)

    return jax.jit(prefill, donate_argnums=1)


class TreeSpeculator:
    """EAGLE tree (or chain, `branches=1`) speculation for one target and head, caches of
    `max_len` slots; with a `budget`, EAGLE-2's dynamic tree (`TreeShape`). The target runs on
    `target`'s `DeviceSteps` (pass the object a baseline uses, so the target is bound once; a
    `Llama` gets its own) and its binding: the weights are read once, when that binding was
    made, and the head's here (later edits are unseen). It holds its compiled programs:
    generate through one object to compile once."""

    def __init__(self, target: Llama | DeviceSteps, head: EagleHead, branches: int, depth: int,
                 max_len: int = 512, budget: int | None = None, width: int | None = None,
                 draft_vocab: np.ndarray | None = None) -> None:
        """`draft_vocab`: target ids the head drafts from (`load_draft_vocab`), None: all."""
        self.steps = (target if isinstance(target, DeviceSteps)
                      else DeviceSteps(target, feature_layers=head.feature_layers))
        if self.steps.feature_layers != head.feature_layers:
            raise ValueError(f"the head reads the target's layers {head.feature_layers}, the "
                             f"target's steps return {self.steps.feature_layers}: build the "
                             f"DeviceSteps with feature_layers={head.feature_layers}")
        self.config = self.steps.config
        self.shape = TreeShape(branches, depth, budget, width)
        self.branches, self.depth, self.max_len = branches, depth, max_len
        # The full tree's fixed parents; a dynamic tree's come with each draft.
        self.parents = full_tree(branches, depth) if budget is None else None
        self.num_nodes = self.shape.num_nodes
        # Slots from `length` that a step writes: the target's candidates, and the head's rows
        # (one per expanded node), which a wide dynamic tree has more of (8x6/15: 40 against 16).
        self.step_slots = max(self.num_nodes, self.shape.head_rows)
        t, h = self.steps.binding, binding(head)
        if draft_vocab is not None and len(draft_vocab) < branches:
            raise ValueError(f"a draft vocabulary of {len(draft_vocab)} ids cannot give "
                             f"{branches} children per node")
        # The vocabulary's LM-head rows are gathered once, here, like the weights' binding.
        self.params = (t.params, h.params, draft_vocab_rows(t.bind(t.params), draft_vocab))

        def bind(params: tuple) -> tuple[Llama, EagleHead]:
            return t.bind(params[0]), h.bind(params[1])

        self._draft, self._verify, self._step = _tree_programs(bind, self.shape)
        self._head_prefill = _head_prefill_program(bind, depth, max_len)

    # -- the pieces, for tests and timing -----------------------------------------------------

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()
                ) -> SpecState:
        """The state after the prompt (its first generated token is `state.root`, drawn by
        `DeviceSteps.prefill_step` from `sampling` like the simple loop's). An unseeded
        `sampling` gets its seed here, once for the whole generation."""
        n = len(prompt_ids)
        if n < 1 or n + self.step_slots > self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_len={self.max_len}")
        p = prompt_bucket(n, cap=self.max_len)
        tokens = np.zeros((1, p), np.int32)
        tokens[0, :n] = prompt_ids
        tokens = jnp.asarray(tokens)
        sampling = sampling.with_resolved_seed()
        arrays = SamplingArrays.from_params([sampling])
        c = self.config
        cache = KVCache.create(c.num_layers, 1, self.max_len, c.num_kv_heads, c.head_dim)
        meta = AttentionMetadata.for_prefill(np.array([n], np.int32), p)
        first, _, hidden, cache = self.steps.prefill_step(cache, tokens, meta, arrays,
                                                          jnp.zeros(1, jnp.int32))
        return self._head_prefill(self.params, cache, hidden, tokens, jnp.int32(n), first,
                                  arrays)

    def _check_room(self, state: SpecState) -> None:
        """Draft, verify and step write slots [length, length + step_slots) of the caches (the
        head's catch-up rows lie below length)."""
        length = int(state.length)
        check_writes(length, length + self.step_slots, self.max_len)

    def draft(self, state: SpecState) -> tuple[jax.Array, jax.Array, KVCache]:
        """The candidate tree, tokens [N] and parents [N] (node 0: the root), and the head's
        cache."""
        self._check_room(state)
        return self._draft(self.params, state)

    def verify(self, state: SpecState, tree_tokens: jax.Array, parents: jax.Array | None = None
               ) -> tuple[SpecState, jax.Array, jax.Array]:
        """Verifies a given tree (root: `state.root`; `parents` default to the full tree's)
        with the state's sampling rule; donates `state`."""
        self._check_room(state)
        if parents is None:
            if self.parents is None:
                raise ValueError("a dynamic tree's shape comes with its draft: pass its parents")
            parents = self.parents
        tokens = jnp.asarray(tree_tokens, jnp.int32)
        host_parents = np.asarray(parents)
        if tokens.shape != (self.num_nodes,) or host_parents.shape != (self.num_nodes,):
            raise ValueError(f"a tree of this speculator has {self.num_nodes} nodes: got tokens "
                             f"{tokens.shape}, parents {host_parents.shape}")
        # The program's masks and positions reach `depth` levels only: a deeper tree would be
        # verified against missing ancestors.
        if tree_depth(host_parents) > self.depth:
            raise ValueError(f"a tree deeper than this speculator's {self.depth} levels")
        return self._verify(self.params, state, tokens, jnp.asarray(host_parents, jnp.int32))

    def step(self, state: SpecState) -> tuple[SpecState, jax.Array, jax.Array]:
        """Draft + verify + compaction in one dispatch; donates `state`. Returns (state,
        emitted [depth+1], accepted candidates)."""
        self._check_room(state)
        return self._step(self.params, state)


def tree_generate(spec: TreeSpeculator, prompt_ids: Sequence[int], max_new_tokens: int,
                  sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = ()
                  ) -> tuple[list[int], dict[str, float]]:
    """Generates with `spec` through the simple loop's `timed_generate`: token ids (at most
    max_new_tokens, stopping after an eos id) and its stats (verify_steps, accepted,
    full_steps: steps that accepted a whole path of `depth`, mean_accepted, tokens_per_step,
    prefill_s, decode_s, decode_tok_s). Exact: greedy output equals the target's greedy
    decoding, sampled output follows its distribution under `sampling`."""
    check_loop_params([sampling])
    if len(prompt_ids) + max_new_tokens + spec.step_slots > spec.max_len:
        raise ValueError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens + a step's "
                         f"{spec.step_slots} slots exceed max_len={spec.max_len}")
    state: SpecState | None = None

    def first() -> int:
        nonlocal state
        state = spec.prefill(prompt_ids, sampling)
        return int(state.root)

    def step() -> list[int]:
        nonlocal state
        state, emitted, accepted = spec.step(state)
        return np.asarray(emitted)[:int(accepted) + 1].tolist()

    return timed_generate(first, step, max_new_tokens, eos_ids, max_step_tokens=spec.depth + 1)


def eagle_generate(target: Llama | DeviceSteps, head: EagleHead, prompt_ids: Sequence[int],
                   max_new_tokens: int, *, branches: int, depth: int,
                   sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
                   max_len: int | None = None, budget: int | None = None
                   ) -> tuple[list[int], dict[str, float]]:
    """`tree_generate` with a speculator built for this call (`branches=1`: a chain of `depth`
    drafts; a `budget`: the dynamic tree); `max_len` (the caches' slots) defaults to a power of
    two >= 256 that fits. One call, one compilation: to generate more than once, keep a `TreeSpeculator`."""
    shape = TreeShape(branches, depth, budget)
    need = len(prompt_ids) + max_new_tokens + max(shape.num_nodes, shape.head_rows)
    spec = TreeSpeculator(target, head, branches, depth, max_len or next_power_of_two(need, 256),
                          budget)
    return tree_generate(spec, prompt_ids, max_new_tokens, sampling, eos_ids)
