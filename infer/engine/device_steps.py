"""The jitted device steps: prefill (compute-bound) and decode (memory-bound), kept separate.

`DeviceSteps(model)` binds the steps to one model through the one binder
(`infer.model.binding`): the weights travel as a flat list of arrays, the structure is closed
over. Its `binding` is public so that other programs over the same target (tree speculation)
take the weights bound here instead of binding them again. The KV cache is donated, so XLA
updates it in place. Everything that changes between calls (tokens, lengths, page tables,
sampling parameters) is an array; only shapes are static.

`sample_index` [B] is each row's count of tokens sampled so far: the index of its PRNG streams
(`infer.sampling`), and nothing else.

With a mesh (tensor parallelism, `infer.parallel`) every step is traced and run under it: the
weights and the cache come placed, every other input is made whole on each device before the
call, and sampled tokens leave replicated, so the next step's feed needs no transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp

from infer.cache.metadata import AttentionMetadata, MixedMetadata
from infer.model.binding import Binding, Structure, binding, committed_device
from infer.model.llama import CacheT, Llama
from infer.model.programs import PROGRAMS, count_executables, jit_on
from infer.model.sharding import replicate
from infer.sampling import SampleLogprobs, SamplingArrays, sample, sample_logprobs
from infer.spec.verify import path_tokens, tree_structure, verify_chain, verify_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one decode step needs from the previous one, kept on device between steps."""

    tokens: jax.Array  # [B] int32, the last sampled token of each row (the next input)
    lengths: jax.Array  # [B] int32, tokens in the cache
    sample_index: jax.Array  # [B] int32, tokens sampled so far (the PRNG streams' index)
    sampling: SamplingArrays
    page_tables: jax.Array | None = None  # [B, n] int32 for a paged cache


R = TypeVar("R")


def verify_tree_pass(model: Llama, cache: CacheT, nodes: jax.Array, parents: jax.Array,
                     meta: AttentionMetadata, sampling: SamplingArrays, sample_index: jax.Array,
                     depth: int, feature_layers: tuple[int, ...] = ()
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, CacheT]:
    """One target pass over a tree per row, exact verification and compaction: the program of
    `DeviceSteps.tree_verify_step` and of the batch-1 tree speculator (`infer.spec.tree`), over
    any cache with `move_tokens`.

    nodes [B, N] (node 0 the row's last token) with parents [B, N] in drafting order, at most
    `depth` below the root; the first meta.q_lens[b] are verified, node i written to slot
    meta.starts[b] + i at position starts + its depth, seeing the cache and its ancestors
    (`meta`'s positions and tree mask are replaced here). Returns (the roots' logits [B, V],
    num_accepted [B], emitted [B, depth+1], hidden states [B, depth+1, E] of the path's nodes,
    cache with the path's KV moved to slots starts+1 .. starts+num_accepted)."""
    real = jnp.arange(nodes.shape[1])[None] < meta.q_lens[:, None]
    nodes = jnp.where(real, nodes, -1)  # never accepted, never written
    node_depth, ancestors = jax.vmap(tree_structure, (0, None))(parents, depth)
    meta = dataclasses.replace(meta, positions=meta.starts[:, None] + node_depth,
                               tree_mask=ancestors)
    logits, hidden, cache = model(jnp.maximum(nodes, 0), cache, meta,
                                  feature_layers=feature_layers)
    path, accepted, nxt = verify_tree(logits, nodes, parents, sampling, sample_index, depth)
    emitted = path_tokens(nodes, path, accepted, nxt)
    # The accepted nodes' KV moves from their tree slots to the slots after the root's, as a
    # plain pass over the accepted tokens would have written it.
    step = jnp.arange(depth + 1, dtype=jnp.int32)[None]
    cache = cache.move_tokens(meta.page_tables, meta.starts[:, None] + jnp.maximum(path, 0),
                              meta.starts[:, None] + step,
                              (step >= 1) & (step <= accepted[:, None]))
    hidden = jnp.take_along_axis(hidden, jnp.maximum(path, 0)[..., None], axis=1)
    return logits[:, 0], accepted, emitted, hidden, cache


@dataclasses.dataclass(eq=False)
class StepPrograms:
    """The jitted steps of one signature (`infer.model.programs`), shared by every `DeviceSteps`
    over equal weights, mesh and feature layers; `ran` holds what their users have run (the
    runner's keys), so a later engine knows which programs are compiled already."""

    prefill: Callable
    decode: Callable
    forward: Callable
    verify: Callable
    tree_verify: Callable
    mixed: Callable
    jitted: tuple[Callable, ...]  # the jax.jit functions themselves, whose executables count
    ran: set = dataclasses.field(default_factory=set)

    def executables(self) -> int:
        return count_executables(*self.jitted)


def _step_programs(structure: Structure[Llama], mesh: jax.sharding.Mesh | None,
                   feature_layers: tuple[int, ...], device: jax.sharding.Sharding | None
                   ) -> StepPrograms:
    """The six steps, jitted with the cache donated. They close over the structure, never over
    weights: the memo may keep them after their first model is gone."""
    bind = structure.bind

    def sampled(logits, sampling, sample_index):
        tokens = sample(logits, sampling, sample_index)
        logprobs = None
        if sampling.num_logprobs:  # static: only the logprobs variant computes them
            logprobs = sample_logprobs(logits, tokens, sampling.num_logprobs)
        return replicate((tokens, logprobs))

    def prefill(params, cache, tokens, meta, sampling, sample_index):
        model = bind(params)
        if tokens.ndim == 1:  # one token per row, as a step samples them: [B] -> [B, 1]
            tokens = tokens[:, None]
        last = jnp.maximum(meta.q_lens - 1, 0)[:, None]
        logits, hidden, cache = model(tokens, cache, meta, logit_index=last,
                                      feature_layers=feature_layers)
        tokens, logprobs = sampled(logits[:, 0], sampling, sample_index)
        return tokens, logprobs, hidden, cache

    def decode(params, cache, state):
        model = bind(params)
        meta = AttentionMetadata.for_decode(state.lengths, state.page_tables)
        logits, _, cache = model(state.tokens[:, None], cache, meta)
        logits = logits[:, 0]
        tokens = replicate(sample(logits, state.sampling, state.sample_index))
        state = dataclasses.replace(state, tokens=tokens, lengths=state.lengths + 1,
                                    sample_index=state.sample_index + 1)
        return state, logits, cache

    def forward(params, cache, tokens, meta):
        return bind(params)(tokens, cache, meta, feature_layers=feature_layers)

    def undrafted(root_logits, emitted, alone, sampling, sample_index):
        """Rows that verify no drafts (`alone` [B]: one query token; padding rows have
        none, so a batch whose rows all drafted skips the draw) emit what a plain decode
        step samples: the token stream's draw, under the row's structured-output mask,
        with logprobs. So a row's tokens do not depend on whether its batch-mates
        speculate, and a row that asks for logprobs or a mask (never drafted) shares a
        step with rows that do."""
        if sampling.num_logprobs:
            tokens, logprobs = sampled(root_logits, sampling, sample_index)
        else:  # the common case: every row drafted, and no second draw to pay for
            tokens, logprobs = jax.lax.cond(
                jnp.any(alone), lambda: sample(root_logits, sampling, sample_index),
                lambda: emitted[:, 0]), None
        return emitted.at[:, 0].set(jnp.where(alone, tokens, emitted[:, 0])), logprobs

    def verify(params, cache, tokens, meta, draft_tokens, num_draft, draft_probs, sampling,
               sample_index):
        logits, hidden, cache = bind(params)(tokens, cache, meta,
                                             feature_layers=feature_layers)
        # Drafted rows are never constrained: their mask would hold for one position only.
        num_accepted, emitted = verify_chain(
            logits, draft_tokens, num_draft, draft_probs,
            dataclasses.replace(sampling, allowed=None), sample_index)
        emitted, logprobs = undrafted(logits[:, 0], emitted, meta.q_lens == 1, sampling,
                                      sample_index)
        return replicate(num_accepted), replicate(emitted), logprobs, hidden, cache

    def tree_verify(params, cache, roots, nodes, parents, meta, sampling, sample_index,
                    depth):
        nodes = jnp.concatenate([roots[:, None], nodes], axis=1)  # [B, N], node 0 the root
        root_logits, accepted, emitted, hidden, cache = verify_tree_pass(
            bind(params), cache, nodes, parents, meta,
            dataclasses.replace(sampling, allowed=None), sample_index, depth,
            feature_layers)
        emitted, logprobs = undrafted(root_logits, emitted, meta.q_lens == 1, sampling,
                                      sample_index)
        return replicate(accepted), replicate(emitted), logprobs, hidden, cache

    def mixed(params, cache, tokens, meta, logit_index, sampling, sample_index):
        logits, _, cache = bind(params)(tokens, cache, meta, logit_index=logit_index)
        tokens, logprobs = sampled(logits[0], sampling, sample_index)
        return tokens, logprobs, cache

    raw = {name: jit_on(fn, device, donate_argnums=1)
           for name, fn in (("prefill", prefill), ("decode", decode), ("forward", forward),
                            ("verify", verify), ("mixed", mixed))}
    # Speculation runs on one device (the engine refuses it on a mesh), so no placement.
    raw["tree_verify"] = jit_on(tree_verify, device, donate_argnums=1, static_argnums=8)
    placed = {name: fn if name == "tree_verify" else _under_mesh(fn, mesh)
              for name, fn in raw.items()}
    return StepPrograms(**placed, jitted=tuple(raw.values()))


def _under_mesh(program: Callable[..., R], mesh: jax.sharding.Mesh | None
                ) -> Callable[..., R]:
    """`program` called (and lowered: `.lower`) under the mesh, its inputs past the weights and
    the cache replicated onto it; `program` itself without a mesh."""
    if mesh is None:
        return program
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(run: Callable[..., R]) -> Callable[..., R]:
        def call(params, cache, *inputs):
            with jax.set_mesh(mesh):
                return run(params, cache, *jax.device_put(inputs, whole))
        return call

    call = placed(program)
    call.lower = placed(program.lower)
    return call


class DeviceSteps:
    """`prefill_step` and `decode_step` of one model, jitted with the cache donated; under
    `mesh` when the model's weights are placed on one (`infer.parallel.placement`). The programs
    come from `PROGRAMS`: engines over weights of one signature share them."""

    def __init__(self, model: Llama, mesh: jax.sharding.Mesh | None = None,
                 feature_layers: tuple[int, ...] = ()) -> None:
        """`feature_layers`: what the hidden states that prefill, forward and verify return
        hold (`Llama.__call__`): the final hidden state alone by default, or also the residual
        stream after those layers, for a draft head that reads several depths."""
        self.config = model.config
        self.mesh = mesh
        self.feature_layers = tuple(feature_layers)
        self.binding: Binding[Llama] = binding(model)
        self.params: list[jax.Array] = self.binding.params
        # Weights put on one device explicitly: every input goes there (caches included).
        self.device = committed_device(self.params) if mesh is None else None
        self.programs = PROGRAMS.get(
            ("steps", self.binding.signature, mesh, self.feature_layers),
            lambda: _step_programs(self.binding.structure, mesh, self.feature_layers,
                                   self.device))
        p = self.programs
        self._prefill, self._decode, self._forward = p.prefill, p.decode, p.forward
        self._verify, self._tree_verify, self._mixed = p.verify, p.tree_verify, p.mixed

    def forward_step(self, cache: CacheT, tokens: jax.Array, meta: AttentionMetadata
                     ) -> tuple[jax.Array, jax.Array, CacheT]:
        """Logits [B, T, V] and hidden states [B, T, E] at every new position, and the cache:
        for scoring text (perplexity, KL) and for verifying speculated tokens."""
        return self._forward(self.params, cache, tokens, meta)

    def verify_step(self, cache: CacheT, tokens: jax.Array, meta: AttentionMetadata,
                    draft_tokens: jax.Array, num_draft: jax.Array, draft_probs: jax.Array | None,
                    sampling: SamplingArrays, sample_index: jax.Array
                    ) -> tuple[jax.Array, jax.Array, SampleLogprobs | None, jax.Array, CacheT]:
        """One target pass over [last token, drafts] [B, k+1] and exact verification.

        Returns (num_accepted [B], emitted [B, k+1] (accepted drafts, then the target's own
        token, then -1), the logprobs of rows without drafts when `sampling.num_logprobs` asks
        (else None; a row without drafts emits what a plain decode step samples, under its
        structured-output mask), hidden states [B, k+1, E], cache). The cache holds valid KV for the
        first num_accepted + 1 inputs of each row; the rest lies past the row's length and is
        overwritten later (rollback is not advancing the length). `draft_probs` [B, k, V] are
        the draft's sampling probabilities, or None for deterministic proposals."""
        return self._verify(self.params, cache, tokens, meta, draft_tokens, num_draft,
                            draft_probs, sampling, sample_index)

    def tree_verify_step(self, cache: CacheT, roots: jax.Array, nodes: jax.Array,
                         parents: jax.Array, meta: AttentionMetadata, sampling: SamplingArrays,
                         sample_index: jax.Array, depth: int
                         ) -> tuple[jax.Array, jax.Array, SampleLogprobs | None, jax.Array,
                                    CacheT]:
        """`verify_tree_pass` over rows whose trees are their last token roots [B] then
        candidates nodes [B, N-1] (parents [B, N]); `meta` a paged step's metadata over N tokens.

        Returns (num_accepted [B], emitted [B, depth+1] (the accepted path's candidates, the
        target's token, then -1), logprobs of rows without candidates as verify_step's, hidden
        states [B, depth+1, E] of the root and the path's nodes, cache). The path's KV is moved
        to slots starts+1 .. starts+num_accepted, so the cache is what verifying the accepted
        tokens as a chain would leave."""
        return self._tree_verify(self.params, cache, roots, nodes, parents, meta, sampling,
                                 sample_index, depth)

    def lower_tree_verify(self, cache: CacheT, roots: jax.Array, nodes: jax.Array,
                          parents: jax.Array, meta: AttentionMetadata, sampling: SamplingArrays,
                          sample_index: jax.Array, depth: int) -> jax.stages.Lowered:
        """tree_verify_step lowered for these shapes, for ahead-of-time compilation."""
        return self._tree_verify.lower(self.params, cache, roots, nodes, parents, meta,
                                       sampling, sample_index, depth)

    def prefill_step(self, cache: CacheT, tokens: jax.Array, meta: AttentionMetadata,
                     sampling: SamplingArrays, sample_index: jax.Array
                     ) -> tuple[jax.Array, SampleLogprobs | None, jax.Array, CacheT]:
        """Runs rows of new tokens [B, T] (padded past meta.q_lens) through the model, writing
        their KV, and samples one token after each row's last valid token. One token per row
        may come as [B], the shape of the tokens it returns: a decode step fed the previous
        step's tokens without their leaving the device.

        Returns (next tokens [B], their logprobs when `sampling.num_logprobs` asks (else
        None), final hidden states at every position [B, T, E] (an EAGLE head's features),
        cache).
        """
        return self._prefill(self.params, cache, tokens, meta, sampling, sample_index)

    def mixed_step(self, cache: CacheT, tokens: jax.Array, meta: MixedMetadata,
                   logit_index: jax.Array, sampling: SamplingArrays, sample_index: jax.Array
                   ) -> tuple[jax.Array, SampleLogprobs | None, CacheT]:
        """One forward over a mixed step's packed tokens [1, N] (a prefill chunk and decode rows,
        `MixedMetadata`), sampling a token at each of `logit_index` [1, R]'s positions: each
        row's last valid token. Returns (tokens [R], their logprobs or None as prefill_step's,
        cache)."""
        return self._mixed(self.params, cache, tokens, meta, logit_index, sampling, sample_index)

    def lower_mixed(self, cache: CacheT, tokens: jax.Array, meta: MixedMetadata,
                    logit_index: jax.Array, sampling: SamplingArrays, sample_index: jax.Array
                    ) -> jax.stages.Lowered:
        """mixed_step lowered for these shapes, for ahead-of-time compilation."""
        return self._mixed.lower(self.params, cache, tokens, meta, logit_index, sampling,
                                 sample_index)

    def lower_prefill(self, cache: CacheT, tokens: jax.Array, meta: AttentionMetadata,
                      sampling: SamplingArrays, sample_index: jax.Array) -> jax.stages.Lowered:
        """prefill_step lowered for these shapes, for ahead-of-time compilation."""
        return self._prefill.lower(self.params, cache, tokens, meta, sampling, sample_index)

    def lower_verify(self, cache: CacheT, tokens: jax.Array, meta: AttentionMetadata,
                     draft_tokens: jax.Array, num_draft: jax.Array, draft_probs: jax.Array | None,
                     sampling: SamplingArrays, sample_index: jax.Array) -> jax.stages.Lowered:
        """verify_step lowered for these shapes, for ahead-of-time compilation."""
        return self._verify.lower(self.params, cache, tokens, meta, draft_tokens, num_draft,
                                  draft_probs, sampling, sample_index)

    def decode_step(self, cache: CacheT, state: DecodeState
                    ) -> tuple[DecodeState, jax.Array, CacheT]:
        """Feeds each row's last token, writes its KV, samples the next.
        Returns (state, logits [B, V], cache)."""
        return self._decode(self.params, cache, state)


