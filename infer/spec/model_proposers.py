"""Model proposers for speculative decoding in the engine: a draft model (a distilled small
Llama, or the target's own first layers) and an EAGLE head over the target's features.

Both keep their KV in a paged cache of their own that uses the target's page tables: a
request's draft KV lives in the same page ids, at the same positions, as its target KV, so the
scheduler's allocator (admission, preemption, prefix sharing, freeing) covers both and nothing
here allocates. A proposer only remembers, per request, up to which position its cache is right
(`valid`), and catches up lazily before proposing:

  draft model   position t holds the draft's KV of token x_t. After a verify step that accepted
                a of k drafts, its KV is right up to the last accepted draft it was fed; the
                catch-up feeds the one or two tokens after that (width 2).
  EAGLE head    slot t holds the head's KV of row (h_t, x_{t+1}): the target's feature at t and
                the token after it. Rows need the target's features, which the runner hands over
                after every prefill chunk and verify step; the catch-up feeds the a + 1 rows whose
                features the last verify produced (width k + 1).

A request's first catch-up covers its whole prompt, in chunks of at most `max_prefill_tokens`
on one row. Then one jitted call per step catches every row up and drafts k tokens, feeding
each draft back (rows stop writing past their own limit, so no write leaves their pages). With
a tree (`RunnerConfig.tree`), the EAGLE proposer's call instead drafts one tree per row
(`infer.spec.tree_draft.draft_tree`, the batch-1 speculator's code), its head rows written to
the row's reserved slots after its last token.
Drafts are greedy for greedy requests and sampled from the request's own warped distribution
(temperature, top-k, top-p) otherwise; their probabilities go to the verifier, which keeps the
output distribution exactly the target's whatever the drafts are.

With prefix caching, a request adopts the draft KV in the pages it shares (written by the
request that computed them); only acceptance, never the output, depends on it being right.

A reduced draft vocabulary (FR-Spec, `SpeculativeConfig.draft_vocab_size`): the draft scores
only the N target ids of `vocab_ids` (the most frequent in the target's own generations,
`experiments.draft_vocab`), through their rows of the LM head, gathered once here. The full
[V, E] projection is most of a drafted token's cost for SmolLM2 (its tied head is 28.3M of
134.5M parameters), whatever the draft's depth. Choices map back to target ids before anything
sees them (the EAGLE head feeds back the target embedding of the mapped id), and a sampled
draft's q is scattered to [rows, V], zero outside the subset: rejection sampling is exact for
any q whose support holds the draft, so the verifier stays as it is.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.cache.metadata import AttentionMetadata, paged_metadata
from infer.cache.page_allocator import SequencePages
from infer.cache.paged import PagedKVCache
from infer.engine.buckets import bucket_for
from infer.engine.plan import PrefillChunk, SeqState
from infer.model.binding import binding, committed_device
from infer.model.llama import Llama
from infer.model.programs import PROGRAMS, count_executables, jit_on
from infer.sampling import SamplingArrays, draft_keys, draw
from infer.spec.draft_vocab import DraftVocab, draft_logits, draft_vocab_rows
from infer.spec.eagle_head import EagleHead
from infer.spec.tree_draft import draft_tree, top_children

if TYPE_CHECKING:
    from infer.engine.runner import RunnerConfig


def _draw_draft(model: Llama, hidden: jax.Array, vocab: DraftVocab | None,
                sampling: SamplingArrays, keys: jax.Array, sampled: bool
                ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """`draw` from final hidden states [B, E] through `model`'s LM head, over its whole
    vocabulary or, with `vocab`, over those rows only: target ids [B]; when `sampled`, q over
    the vocabulary [B, V] (zero outside the subset), else None; and the draft's confidence [B]
    (XLA drops it where unused): the top probability of the distribution the row draws from,
    its warped q when it samples, the plain softmax when it is greedy. The top, not the drawn
    token's own probability: a stop that looked at the drawn value would keep some draws and
    drop others, and the kept ones would no longer be distributed as the q the verifier
    corrects for (greedy drafts are the top, so there both are the same)."""
    logits = draft_logits(model, hidden, vocab)
    choice, probs = draw(logits, sampling, keys, with_probs=sampled)
    confidence = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
    if probs is not None:
        confidence = jnp.where(sampling.temperature > 0, jnp.max(probs, axis=-1), confidence)
    if vocab is None:
        return choice, probs, confidence
    ids = vocab[1]
    if probs is not None:
        probs = jnp.zeros((hidden.shape[0], model.config.vocab_size),
                          probs.dtype).at[:, ids].set(probs)
    return ids[choice], probs, confidence


Feed = Callable[[jax.Array, jax.Array, int, jax.Array, PagedKVCache],
                tuple[jax.Array, PagedKVCache]]


def _draft_chain(draw_from: Callable[[jax.Array, int], tuple[jax.Array, jax.Array | None,
                                                                jax.Array]],
                 feed: Feed, state: jax.Array, cache: PagedKVCache, limits: jax.Array, k: int,
                 confidence: float | None
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, PagedKVCache]:
    """k drafts per row, each fed back to get the next: the loop both model proposers run.

    `draw_from(state, j)` draws draft j from the state [B, E] it comes from; `feed(state,
    tokens, j, write, cache)` runs the draft model on draft j (writing its KV only where
    `write` [B] bool) and returns the next state. A row wants its first `limits` drafts. With
    `confidence`, a row also stops before its first draft whose running product of
    confidences (each draft's top probability, known before the draw: see `_draw_draft`) is
    below it; a feed no row wants is skipped at run time (`lax.cond`), so a batch of unsure
    rows pays one draft step. Returns (drafts [B, k], q [B, k, V] or None, counts [B]: the
    limits without a stop, cache)."""
    drafts, probs = [], []
    alive = limits > 0
    product = jnp.ones(limits.shape, jnp.float32)
    counts = jnp.zeros_like(limits)
    for j in range(k):
        token, p, sure = draw_from(state, j)
        drafts.append(token)
        probs.append(p)
        if confidence is not None:
            product = product * sure
            alive = alive & (product >= confidence) & (j < limits)
            counts = counts + alive
        if j + 1 == k:
            break
        write = j + 1 < limits  # feed draft j+1 (1-based) only if the row wants draft j+2
        if confidence is None:
            state, cache = feed(state, token, j, write, cache)
        else:
            write = write & alive
            state, cache = jax.lax.cond(
                jnp.any(write), lambda s, c: feed(s, token, j, write, c), lambda s, c: (s, c),
                state, cache)
    drafts = jnp.stack(drafts, axis=1)
    q = jnp.stack(probs, axis=1) if probs[0] is not None else None
    return drafts, q, (counts if confidence is not None else limits), cache


def _no_logits(batch: int) -> jax.Array:
    """A `logit_index` that picks no position: the forward's vocabulary projection is empty."""
    return jnp.zeros((batch, 0), jnp.int32)


def _step_meta(positions: jax.Array, write: jax.Array, tables: jax.Array) -> AttentionMetadata:
    """One token per row at `positions` [B], written only where `write` [B] bool. A row that
    does not write reads nothing either (its output is unused): past its limit, its position
    may lie beyond its page table, whose width covers the slots rows write."""
    return AttentionMetadata.for_prefill(write.astype(jnp.int32), 1,
                                         cached=jnp.where(write, positions, 0),
                                         page_tables=tables)


@dataclasses.dataclass(eq=False)
class _ProposerPrograms:
    """A model proposer's jitted programs, shared through `PROGRAMS` by proposers over equal
    weights and settings: catch-up, chain drafting, and (EAGLE) tree drafting."""

    forward: Callable
    chain: Callable
    tree: Callable | None = None

    def executables(self) -> int:
        return count_executables(*(f for f in (self.forward, self.chain, self.tree) if f))


@dataclasses.dataclass
class _Track:
    """What a proposer knows of one request: its pages object (a new one after preemption means
    a fresh start) and the first position its cache does not hold right."""

    pages: SequencePages
    valid: int
    drafts_fed: int = 0  # drafts the last chain fed back (draft model: their KV is written)
    # One key per full page of the request, over its tokens up to that page's end (chained):
    # the KV in a page depends on nothing else.
    page_keys: list[int] = dataclasses.field(default_factory=list)
    feature_start: int = 0  # EAGLE: target features held for positions [start, start + len)
    features: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def feature_end(self) -> int:
        return self.feature_start + sum(len(f) for f in self.features)

    def features_from(self, start: int, end: int) -> np.ndarray:
        if not self.feature_start <= start <= end <= self.feature_end:
            raise ValueError(f"features of positions [{start}, {end}) asked for; held: "
                             f"[{self.feature_start}, {self.feature_end})")
        held = np.concatenate(self.features) if len(self.features) > 1 else self.features[0]
        self.features = [held]
        return held[start - self.feature_start:end - self.feature_start]

    def drop_features_before(self, position: int) -> None:
        if self.features and position > self.feature_start:
            held = np.concatenate(self.features)[position - self.feature_start:]
            self.features, self.feature_start = [held], position


class _ModelProposer:
    """Bookkeeping, shapes and warm-up shared by the draft-model and EAGLE proposers; a subclass
    says how a row catches up (`_pending`) and supplies the two jitted programs."""

    catch_up_width: int
    samples_drafts = True
    state_from_tokens = False  # it follows the target's KV pages, which a preemption drops
    feature_layers: tuple[int, ...] = ()  # the EAGLE proposer takes its head's

    def __init__(self, config: "RunnerConfig", num_layers: int, num_kv_heads: int,
                 head_dim: int, vocab: DraftVocab | None, confidence: float | None,
                 device: jax.sharding.Sharding | None) -> None:
        """`device`: where the proposer's weights were put explicitly (its cache goes there
        too), or None."""
        self.config = config
        self._vocab = vocab  # None: drafts score the whole vocabulary
        self.confidence = confidence  # the chain's stop (`_draft_chain`); None: none
        self.k = config.num_speculative_tokens
        self.cache = PagedKVCache.create(num_layers, config.num_pages, config.page_size,
                                         num_kv_heads, head_dim, "float32",
                                         config.attention_backend, device=device)
        self._tracks: dict[str, _Track] = {}
        # Page id -> the key (`_Track.page_keys`) of the tokens whose KV this cache holds in
        # that page, for pages some request's draft filled and nothing has written since.
        # Pages a request takes from the prefix cache hold the target's KV, but the draft's
        # only if the request that computed them drafted past them: one that never drafted
        # (one token, logprobs, aborted) leaves zeros or an earlier request's KV.
        self._page_holds: dict[int, int] = {}
        self.proposed = 0

    # -- the proposer protocol ------------------------------------------------------------------

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, jax.Array | None]:
        if k != self.k:
            raise ValueError(f"proposer built for k={self.k}, asked for {k}")
        limits = [limit if self._can_draft(seq) else 0 for seq, limit in zip(seqs, limits)]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        for i in active:
            self._catch_up_long(seqs[i])
        # A row writes at most its limit's slots, which the scheduler reserved: a table sized
        # for k would outgrow the largest window near max_model_len.
        width = self.config.window_for(max(max(s.num_computed + 1 + limit, s.pages.capacity)
                                           for s, limit in zip(seqs, limits)))
        limits_arr = np.zeros(rows, np.int32)
        limits_arr[:len(limits)] = limits
        inputs = self._chain_inputs([seqs[i] for i in active], active, rows, width,
                                    np.maximum(limits_arr - 1, 0))
        params = [s.request.params for s in seqs]
        sampling = SamplingArrays.from_params(params, batch=rows)
        sampled = any(not p.greedy for p in params)
        sample_index = np.zeros(rows, np.int32)
        sample_index[:len(seqs)] = [len(s.request.output_ids) for s in seqs]
        drafts, probs, counts, self.cache = self._chain(
            self.cache, *inputs, jnp.asarray(limits_arr), sampling, jnp.asarray(sample_index), k,
            sampled)
        counts = np.asarray(counts)
        for i in active:
            # Drafts fed back: each draft but the last the row wanted, and none past a stop.
            self._tracks[seqs[i].request.request_id].drafts_fed = min(limits[i] - 1,
                                                                      int(counts[i]))
        self.proposed += int(counts.sum())
        return np.asarray(drafts), counts, probs

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None:
        """After a decode or verify step: `emitted[i]` are row i's accepted drafts then the
        target's token; `hidden` [rows, T, E] the target's features at the fed positions."""
        for seq, out in zip(seqs, emitted):
            track = self._tracks.get(seq.request.request_id)
            if track is not None and track.pages is seq.pages:
                # The chain fed drafts at positions n+1 .. n+drafts_fed; accepted ones are right.
                n = seq.num_computed  # not yet advanced: the fed token's position
                if track.valid == n + 1:
                    self._advance(seq, track, n + 1 + min(len(out) - 1, track.drafts_fed))
                track.drafts_fed = 0

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    # -- catching up ----------------------------------------------------------------------------

    def _track(self, seq: SeqState) -> _Track:
        track = self._tracks.get(seq.request.request_id)
        if track is None or track.pages is not seq.pages:
            track = _Track(seq.pages, 0)
            track.valid = self._held_prefix(seq, track)
            self._tracks[seq.request.request_id] = track
        if seq.num_computed < track.valid:  # the target will write those positions anew
            self._written(seq, seq.num_computed, track.valid)
            track.valid = seq.num_computed
        return track

    def _keys(self, seq: SeqState, track: _Track, num_pages: int) -> list[int]:
        """`track.page_keys` of the request's first `num_pages` full pages."""
        size, tokens = self.config.page_size, seq.request.all_token_ids
        while len(track.page_keys) < num_pages:
            j = len(track.page_keys)
            previous = track.page_keys[-1] if j else 0
            track.page_keys.append(hash((previous, tuple(tokens[j * size:(j + 1) * size]))))
        return track.page_keys[:num_pages]

    def _held_prefix(self, seq: SeqState, track: _Track) -> int:
        """How many of the tokens a request took from the prefix cache lead pages holding the
        draft's KV of exactly those tokens."""
        size = self.config.page_size
        keys = self._keys(seq, track, seq.cached_prefix // size)
        held = 0
        while held < len(keys) and self._page_holds.get(seq.pages.pages[held]) == keys[held]:
            held += 1
        return min(held * size, seq.cached_prefix)

    def _advance(self, seq: SeqState, track: _Track, valid: int) -> None:
        """The draft's KV of positions below `valid` is now right: pages it fills are held."""
        size = self.config.page_size
        first, end = track.valid // size, valid // size
        if end > first:
            keys = self._keys(seq, track, end)
            for j in range(first, end):
                self._page_holds[seq.pages.pages[j]] = keys[j]
        track.valid = valid

    def _written(self, seq: SeqState, start: int, end: int) -> None:
        """The draft writes (or the target will write anew) positions [start, end): the pages
        they fall in hold no known KV until a request's draft fills them again."""
        size = self.config.page_size
        for page in seq.pages.pages[start // size:-(-end // size)]:
            self._page_holds.pop(page, None)

    def _catch_up_long(self, seq: SeqState) -> None:
        """Feeds all but the last `catch_up_width` pending rows, a chunk at a time on one row."""
        track = self._track(seq)
        last = self._last_pending(seq) - self.catch_up_width
        while track.valid < last:
            end = min(last, track.valid + self.config.max_prefill_tokens)
            t = bucket_for(end - track.valid, self.config.prefill_buckets)
            width = self.config.window_for(max(end, seq.pages.capacity))
            meta = paged_metadata([seq.pages], 1, width, np.array([track.valid], np.int32),
                                  np.array([end - track.valid], np.int32), t, names=[seq.label],
                                  with_windows=False)  # the proposer's cache keeps none
            self._written(seq, track.valid, end)
            self.cache = self._forward(self.cache, *self._rows(seq, track, track.valid, end, t),
                                       meta)
            self._advance(seq, track, end)

    def _chain_inputs(self, seqs: Sequence[SeqState], rows_of: Sequence[int], rows: int,
                      width: int, writes_past: np.ndarray) -> tuple:
        """The draft program's inputs: each row's catch-up rows, then its metadata, checked for
        the `writes_past` [rows] slots it writes after the catch-up too (a chain feeds back
        drafts 1 .. limit-1 there, a tree writes its head rows)."""
        w = self.catch_up_width
        cached = np.zeros(rows, np.int32)
        q_lens = np.zeros(rows, np.int32)
        row_inputs = [np.zeros((rows, w, *shape), dtype) for shape, dtype in self._row_spec()]
        for seq, i in zip(seqs, rows_of):
            track = self._tracks[seq.request.request_id]
            end = self._last_pending(seq)
            cached[i], q_lens[i] = track.valid, end - track.valid
            for buffer, values in zip(row_inputs, self._rows(seq, track, track.valid, end, w)):
                buffer[i] = values[0]
            self._written(seq, track.valid, end + int(writes_past[i]))
            self._advance(seq, track, end)
        write_ends = cached + q_lens + writes_past
        meta = paged_metadata([s.pages for s in seqs], rows, width, cached, q_lens, w, rows_of,
                              write_ends, names=[s.label for s in seqs], with_windows=False)
        return (*[jax.device_put(b) for b in row_inputs], meta)

    # -- warm-up --------------------------------------------------------------------------------

    def warmup(self) -> int:
        """Runs every shape a serving run can use, with nothing written, through the input
        builders a run uses (a host-to-device copy of a new shape is a program too); returns
        the count."""
        count = 0
        for width in self.config.window_buckets:
            zero = np.zeros(1, np.int32)
            for t in self.config.prefill_buckets:
                rows = [np.zeros((1, t, *shape), dtype) for shape, dtype in self._row_spec()]
                self.cache = self._forward(self.cache, *rows,
                                           paged_metadata([], 1, width, zero, zero, t))
                count += 1
            for rows in self.config.decode_buckets:
                zeros = np.zeros(rows, np.int32)
                inputs = self._chain_inputs([], [], rows, width, zeros)
                if self.config.tree is not None:
                    *_, self.cache = self._tree(self.cache, *inputs, jnp.asarray(zeros))
                    count += 1
                    continue
                sampling = SamplingArrays.from_params([], batch=rows)
                for sampled in (False, True):
                    *_, self.cache = self._chain(self.cache, *inputs, jnp.asarray(zeros),
                                                 sampling, jnp.asarray(zeros), self.k, sampled)
                    count += 1
        jax.block_until_ready(self.cache)  # as the runner's warm-up: nothing left queued
        return count

    # -- what a subclass provides ---------------------------------------------------------------

    def _can_draft(self, seq: SeqState) -> bool:
        """Whether the row can draft this step (a draft model catches up from any point)."""
        return True

    def _last_pending(self, seq: SeqState) -> int:
        """One past the last position (draft model) or row (EAGLE) to feed before drafting."""
        raise NotImplementedError

    def _row_spec(self) -> list[tuple[tuple[int, ...], type]]:
        """Per-position input arrays: (trailing shape, dtype) of each."""
        raise NotImplementedError

    def _rows(self, seq: SeqState, track: _Track, start: int, end: int, pad_to: int
              ) -> list[np.ndarray]:
        """The inputs of positions [start, end) as [1, pad_to, ...] arrays."""
        raise NotImplementedError

    _forward: Callable
    _chain: Callable


class DraftModelProposer(_ModelProposer):
    """A small Llama sharing the target's tokenizer drafts k tokens autoregressively; with
    `vocab_ids` [N] (target ids), over those ids only."""

    catch_up_width = 2

    def __init__(self, draft: Llama, config: "RunnerConfig",
                 vocab_ids: np.ndarray | None = None, confidence: float | None = None) -> None:
        c = draft.config
        bound = binding(draft)
        device = committed_device(bound.params)  # in the signature: the key covers it
        super().__init__(config, c.num_layers, c.num_kv_heads, c.head_dim,
                         draft_vocab_rows(draft, vocab_ids), confidence, device)
        # The programs close over the structure alone (`PROGRAMS` may keep them past this
        # proposer): never over `bound`, which holds the weights.
        bind, self.params = bound.structure.bind, bound.params

        def build() -> _ProposerPrograms:
            def forward(params, cache, tokens, meta):
                _, _, cache = bind(params)(tokens, cache, meta,
                                           logit_index=_no_logits(tokens.shape[0]))
                return cache

            def chain(params, vocab, cache, tokens, meta, limits, sampling, sample_index, k,
                      sampled):
                model = bind(params)
                last = jnp.maximum(meta.q_lens - 1, 0)[:, None]

                def run(tokens, cache, meta, last):
                    """The forward; the final hidden state [B, E] at position `last` [B, 1],
                    what drafts come from."""
                    _, hidden, cache = model(tokens, cache, meta,
                                             logit_index=_no_logits(len(tokens)))
                    return jnp.take_along_axis(hidden, last[:, :, None], axis=1)[:, 0], cache

                def draw_from(state, j):
                    keys = draft_keys(sampling.seeds, sample_index, j)
                    return _draw_draft(model, state, vocab, sampling, keys, sampled)

                def feed(state, token, j, write, cache):
                    # x_n sits at lengths - 1: draft j + 1 (1-based) at lengths + j.
                    return run(token[:, None], cache, _step_meta(meta.lengths + j, write,
                                                                 meta.page_tables),
                               jnp.zeros_like(last))

                state, cache = run(tokens, cache, meta, last)
                return _draft_chain(draw_from, feed, state, cache, limits, k, confidence)

            return _ProposerPrograms(jit_on(forward, device, donate_argnums=1),
                                     jit_on(chain, device, donate_argnums=2,
                                            static_argnums=(8, 9)))

        programs = PROGRAMS.get(("draft", bound.signature, confidence), build)
        self._forward_jit, self._chain_jit = programs.forward, programs.chain

    def _forward(self, cache, tokens, meta):
        return self._forward_jit(self.params, cache, tokens, meta)

    def _chain(self, cache, tokens, meta, limits, sampling, sample_index, k, sampled):
        return self._chain_jit(self.params, self._vocab, cache, tokens, meta, limits, sampling,
                               sample_index, k, sampled)

    def _last_pending(self, seq: SeqState) -> int:
        return seq.num_computed + 1  # through x_n, the token the target is about to verify from

    def _row_spec(self):
        return [((), np.int32)]

    def _rows(self, seq, track, start, end, pad_to):
        tokens = np.zeros((1, pad_to), np.int32)
        tokens[0, :end - start] = seq.request.all_token_ids[start:end]
        return [tokens]


class _EagleDraft(nnx.Module):
    """The head with the target whose embedding and LM head it shares (arrays not copied)."""

    def __init__(self, head: EagleHead, target: Llama) -> None:
        self.head = head
        self.target = target


class EagleProposer(_ModelProposer):
    """EAGLE: the head turns the target's feature h_t and token x_{t+1} into ĥ_{t+1}, whose
    logits through the target's head give a draft; its own predictions then stand in for the
    features of the drafts. With `vocab_ids` [N] (target ids), the logits of those ids only."""

    def __init__(self, head: EagleHead, target: Llama, config: "RunnerConfig",
                 vocab_ids: np.ndarray | None = None, confidence: float | None = None) -> None:
        c = head.config
        bound = binding(_EagleDraft(head, target))
        device = committed_device(bound.params)
        super().__init__(config, 1, c.num_kv_heads, c.head_dim, draft_vocab_rows(target, vocab_ids),
                         confidence, device)
        self.catch_up_width = config.num_speculative_tokens + 1
        self.feature_size = head.feature_size
        self.feature_layers = head.feature_layers
        bind, self.params = bound.structure.bind, bound.params  # as the draft model's
        tree_shape = config.tree  # `tree` below is traced only when there is one
        if tree_shape is not None:
            self.catch_up_width = tree_shape.depth + 1  # a step accepts at most depth drafts
        log_confidence = None if confidence is None else float(np.log(confidence))

        def build() -> _ProposerPrograms:
            def forward(params, cache, features, next_tokens, meta):
                m = bind(params)
                _, cache = m.head(m.head.features_in(features), next_tokens, m.target.embed, cache,
                                  meta)
                return cache

            def chain(params, vocab, cache, features, next_tokens, meta, limits, sampling,
                      sample_index, k, sampled):
                m = bind(params)
                predicted, cache = m.head(m.head.features_in(features), next_tokens,
                                          m.target.embed, cache, meta)
                last = jnp.maximum(meta.q_lens - 1, 0)
                feature = jnp.take_along_axis(predicted, last[:, None, None], axis=1)[:, 0]

                def draw_from(feature, j):
                    keys = draft_keys(sampling.seeds, sample_index, j)
                    # A reduced vocabulary's token is the target id already: its target embedding
                    # is what the head reads next.
                    return _draw_draft(m.target, feature, vocab, sampling, keys, sampled)

                def feed(feature, token, j, write, cache):
                    # Rows t sit at slot t: the next row's slot is lengths + j.
                    predicted, cache = m.head(feature[:, None], token[:, None], m.target.embed,
                                              cache, _step_meta(meta.lengths + j, write,
                                                                meta.page_tables))
                    return predicted[:, 0], cache

                return _draft_chain(draw_from, feed, feature, cache, limits, k, confidence)

            def tree(params, vocab, cache, features, next_tokens, meta, limits):
                m = bind(params)
                predicted, cache = m.head(m.head.features_in(features), next_tokens,
                                          m.target.embed, cache, meta)
                last = jnp.maximum(meta.q_lens - 1, 0)[:, None]
                h_root = jnp.take_along_axis(predicted, last[..., None], axis=1)[:, 0]
                root = jnp.take_along_axis(next_tokens, last, axis=1)[:, 0]

                def call_head(features, tokens, meta, cache):
                    return m.head(features, tokens, m.target.embed, cache, meta)

                tokens, parents, scores, cache = draft_tree(
                    tree_shape, call_head, lambda h, k: top_children(m.target, vocab, h, k), cache,
                    h_root, root, meta.lengths, limits > 0, meta.page_tables)
                n = tree_shape.num_nodes
                counts = jnp.minimum(limits, n - 1)
                if log_confidence is not None:
                    # Up to the last candidate the head is sure enough of; its ancestors are surer
                    # still, so the prefix holds every confident path.
                    sure = scores[:, 1:] >= log_confidence
                    counts = jnp.minimum(counts, jnp.max(jnp.where(sure, jnp.arange(1, n), 0),
                                                         axis=1))
                return tokens[:, 1:], parents, counts, cache

            return _ProposerPrograms(jit_on(forward, device, donate_argnums=1),
                                     jit_on(chain, device, donate_argnums=2,
                                            static_argnums=(9, 10)),
                                     jit_on(tree, device, donate_argnums=2))

        programs = PROGRAMS.get(("eagle", bound.signature, confidence, tree_shape), build)
        self._forward_jit, self._chain_jit = programs.forward, programs.chain
        self._tree_jit = programs.tree

    def _tree(self, cache, features, next_tokens, meta, limits):
        return self._tree_jit(self.params, self._vocab, cache, features, next_tokens, meta, limits)

    def propose_tree(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int
                     ) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """One tree per row (`RunnerConfig.tree`): candidates [rows, N-1] and parents [rows, N]
        on device, and counts [rows] on the host, the candidates each row verifies: a prefix
        of its tree (drafting order keeps a prefix a tree) of at most its limit, cut after its
        last candidate whose path the head gives at least `confidence`. A row whose limit
        leaves no room for the head's rows (`TreeShape.head_rows`, written after its last
        token) drafts nothing."""
        shape = self.config.tree
        limits = [limit if limit + 1 >= shape.head_rows and self._can_draft(seq) else 0
                  for seq, limit in zip(seqs, limits)]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        for i in active:
            self._catch_up_long(seqs[i])
        width = self.config.window_for(max(max(s.num_computed + 1, s.pages.capacity)
                                           for s in seqs))
        limits_arr = np.zeros(rows, np.int32)
        limits_arr[:len(limits)] = limits
        inputs = self._chain_inputs([seqs[i] for i in active], active, rows, width,
                                    np.where(limits_arr > 0, shape.head_rows, 0))
        nodes, parents, counts, self.cache = self._tree(self.cache, *inputs,
                                                        jax.device_put(limits_arr))
        counts = np.asarray(counts)
        self.proposed += int(counts.sum())
        return nodes, parents, counts

    def _forward(self, cache, features, next_tokens, meta):
        return self._forward_jit(self.params, cache, features, next_tokens, meta)

    def _chain(self, cache, features, next_tokens, meta, limits, sampling, sample_index, k,
               sampled):
        return self._chain_jit(self.params, self._vocab, cache, features, next_tokens, meta,
                               limits, sampling, sample_index, k, sampled)

    def _last_pending(self, seq: SeqState) -> int:
        return seq.num_computed  # rows t < n: the feature of x_n comes with the next verify

    def _row_spec(self):
        return [((self.feature_size,), np.float32), ((), np.int32)]

    def _track(self, seq: SeqState) -> _Track:
        track = super()._track(seq)
        # Rows without features (a prefix taken from the cache) keep the head KV already in the
        # shared pages; acceptance, not exactness, depends on it.
        start = track.feature_start if track.features else seq.num_computed
        track.valid = max(track.valid, min(start, seq.num_computed))
        return track

    def _can_draft(self, seq: SeqState) -> bool:
        """The head drafts from the target's features of the pending rows: a request whose
        prompt came whole from the prefix cache has none until a plain step computes one."""
        track = self._track(seq)
        return track.valid < self._last_pending(seq) <= track.feature_end

    def _rows(self, seq, track, start, end, pad_to):
        features = np.zeros((1, pad_to, self.feature_size), np.float32)
        tokens = np.zeros((1, pad_to), np.int32)
        features[0, :end - start] = track.features_from(start, end)
        tokens[0, :end - start] = seq.request.all_token_ids[start + 1:end + 1]
        return [features, tokens]

    def _keep(self, seq: SeqState, start: int, rows: np.ndarray) -> None:
        track = self._tracks.get(seq.request.request_id)
        if track is None or track.pages is not seq.pages:
            track = _Track(seq.pages, seq.cached_prefix, feature_start=start)
            self._tracks[seq.request.request_id] = track
        if start != track.feature_end or not track.features:
            track.features, track.feature_start = [], start  # a gap: start over from here
        track.features.append(rows)
        track.drop_features_before(min(track.valid, start))

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None:
        host = np.asarray(hidden, np.float32)
        for i, chunk in enumerate(chunks):
            self._keep(chunk.seq, chunk.start, host[i, :len(chunk.token_ids)])

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None:
        host = np.asarray(hidden, np.float32)
        for i, (seq, out) in enumerate(zip(seqs, emitted)):
            # Features of the fed token x_n and of the accepted drafts, positions n .. n + a.
            self._keep(seq, seq.num_computed, host[i, :len(out)])
