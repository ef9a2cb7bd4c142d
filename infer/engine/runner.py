"""The device side of the engine: turns a `StepPlan` into fixed-shape arrays, runs the jitted
step on the paged cache, and returns the sampled tokens.

Shapes are bucketed so that a serving run compiles a fixed set of programs, all during
`warmup()`: decode rows pad to a power of two up to `max_num_seqs`, prefill chunks to a power of
two up to `max_prefill_tokens` (and 1.5 times each where page tables have one width), and page
tables to a power-of-two number of tokens (at least `min_window`) up to `max_model_len`.
`Runner.shapes` lists every program those buckets make (`Shape`: prefill, decode or verify,
with or without draft probabilities). Padding rows have no valid token: their writes are
dropped and their samples ignored. Sampling parameters and PRNG positions are arrays, never
static.

Every write is checked on the host before the step (`infer.cache.metadata.paged_metadata`): a
row may write only into pages it holds, and a violation raises instead of corrupting another
row's page. The padding rules are `infer.engine.buckets`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import jax
import numpy as np

from infer.cache import kivi
from infer.cache.metadata import MixedMetadata, paged_metadata
from infer.cache.paged import PagedKVCache, copy_pages, window_slots
from infer.engine.buckets import (MIN_PREFILL_TOKENS, MIN_WINDOW, bucket_for, powers_of_two,
                                  with_midpoints)
from infer.engine.device_steps import DeviceSteps
from infer.engine.metrics import StepTimes
from infer.engine.plan import (Emitted, EmittedLogprobs, InFlight, PrefillChunk, SeqState,
                               StepPlan, check_step_kinds)
from infer.engine.request import TokenLogprob
from infer.model.binding import placement
from infer.model.llama import Llama
from infer.platform import logger
from infer.sampling import SampleLogprobs, SamplingArrays
from infer.sampling_params import SamplingParams, is_integer
from infer.spec.stats import SpeculationStats
from infer.spec.tree_draft import TreeShape
from infer.structured import fill_bitmask, mask_words

if TYPE_CHECKING:
    from infer.spec.proposer import Proposer


def check_speculation_fits(tree: TreeShape | None, num_speculative_tokens: int,
                           kv_format: str, mixed_steps: bool) -> None:
    """The step kinds and cache formats speculation cannot run with. Also asked by
    EngineConfig, so that LLM refuses them before it reads the checkpoint."""
    if tree is not None and kv_format == kivi.KIVI_FORMAT:
        raise ValueError(f"tree speculation moves the accepted path's KV token by token, "
                         f"which {kivi.KIVI_FORMAT}'s per-channel key pages cannot do: use "
                         f"another kv_cache_dtype or a chain (no tree)")
    check_step_kinds(mixed_steps, num_speculative_tokens)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    num_pages: int
    page_size: int = 16
    kv_format: str = "float32"
    attention_backend: str = "reference"
    max_num_seqs: int = 32
    max_prefill_tokens: int = 256
    max_model_len: int = 2048
    num_speculative_tokens: int = 0
    # Smallest attention window in tokens: shorter sequences still attend over this many slots,
    # and each power of two above it up to max_model_len is one more set of programs.
    min_window: int = MIN_WINDOW
    # One forward over a prefill chunk and the decode rows together (`Runner._mixed`): each
    # chunk bucket is one more program per page-table width.
    mixed_steps: bool = False
    # EAGLE tree speculation (`infer.spec.tree_draft.TreeShape`): verify steps take a tree per row,
    # `num_speculative_tokens` being the slots a step may write past a row's last token.
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        check_speculation_fits(self.tree, self.num_speculative_tokens, self.kv_format,
                               self.mixed_steps)
        if self.tree is not None and self.num_speculative_tokens != self.tree.reserved_slots:
            raise ValueError(f"a {self.tree} tree writes {self.tree.reserved_slots} slots past a "
                             f"row's last token: num_speculative_tokens must be that, got "
                             f"{self.num_speculative_tokens}")
        w = self.min_window
        if not is_integer(w) or w < 1:
            raise ValueError(f"min_window must be a positive number of tokens, got {w!r}")

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        return powers_of_two(1, self.max_num_seqs)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Chunk lengths: powers of two, and 1.5 times each where one page-table width serves
        every length (each chunk bucket is then one program, not one per width). None past
        max_model_len: no chunk is longer than a sequence, and warm-up compiles each bucket."""
        top = min(self.max_prefill_tokens, self.max_model_len)
        buckets = powers_of_two(min(MIN_PREFILL_TOKENS, top), top)
        return with_midpoints(buckets) if len(self.window_buckets) == 1 else buckets

    @property
    def window_buckets(self) -> tuple[int, ...]:
        """Page-table widths in pages."""
        g = self.page_size
        tokens = powers_of_two(min(self.min_window, self.max_model_len), self.max_model_len)
        return tuple(dict.fromkeys(-(-t // g) for t in tokens))

    def window_for(self, tokens: int) -> int:
        """The page-table width bucket (in pages) that holds `tokens` tokens."""
        return bucket_for(-(-tokens // self.page_size), self.window_buckets)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One compiled program of a serving run: which step, and the shapes that reach jit."""

    # "prefill" (one chunk), "decode" (rows of one token), "verify" (rows of k+1), "tree" (rows
    # of a tree of `tokens` nodes), "mixed" (a chunk of `tokens` and `rows` decode rows)
    kind: str
    rows: int
    tokens: int  # per row; a mixed step's chunk
    width: int  # page-table width in pages
    draft_probs: bool = False  # verify: the drafts come with their probabilities [rows, k, V]
    # Variants of a step's program, compiled on first use (never by warm-up, so that runs
    # without them compile nothing more): a structured-output mask, logprobs.
    constrained: bool = False
    logprobs: bool = False
    # decode: its tokens are the step before's, still on the device (a step planned ahead).
    # The same program, but jit dispatches a device array apart from host tokens: reached
    # first from a device array once JAX's lowering cache has dropped the program (a long
    # process), it compiles again. Warm-up runs it; `shapes` lists programs, not these.
    fed: bool = False

    def __str__(self) -> str:
        extras = [name for name, on in (("draft probabilities", self.draft_probs),
                                        ("a structured-output mask", self.constrained),
                                        ("logprobs", self.logprobs),
                                        ("tokens fed from the device", self.fed)) if on]
        return (f"{self.kind} program: {self.rows} rows x {self.tokens} tokens, "
                f"{self.width}-page tables" + "".join(f", with {e}" for e in extras))


def _unfed(shape: Shape) -> Shape:
    """The program a fed variant reaches (itself when not fed; no copy on the step's path)."""
    return dataclasses.replace(shape, fed=False) if shape.fed else shape


class Runner:
    def __init__(self, model: Llama, config: RunnerConfig,
                 proposer: "Proposer | None" = None, mesh: jax.sharding.Mesh | None = None
                 ) -> None:
        """`mesh`: the model's weights are placed on it (`infer.parallel.placement`); the cache is
        allocated on it, split over KV heads."""
        if (proposer is None) != (config.num_speculative_tokens == 0):
            raise ValueError("speculative decoding needs both a proposer and "
                             "num_speculative_tokens > 0")
        self.config = config
        self.proposer = proposer
        self.spec_stats = SpeculationStats()
        self.device_steps = DeviceSteps(model, mesh, proposer.feature_layers if proposer else ())
        # Programs this runner has run. The first run of one that no engine over these weights
        # ran (`_compiled`) compiles it (or loads it from the persistent cache) inside a user's
        # step, and says so.
        self.ready: set[Shape] = set()
        self.times = StepTimes()  # the latest step's
        # The last step's sampling arrays and the params they hold, reused while a batch's
        # rows stay the same requests (every decode step of a steady batch).
        self._last_sampling: tuple[int, tuple[SamplingParams, ...], SamplingArrays] | None = None
        # Across hosts, process 0's runner sends each step (and warm-up) here first, so that the
        # other processes run it too (`infer.parallel.distributed`); None on one host.
        self.mirror: Callable[..., object] | None = None
        c = model.config
        self.cache = PagedKVCache.create(c.num_layers, config.num_pages, config.page_size,
                                         c.num_kv_heads, c.head_dim, config.kv_format,
                                         config.attention_backend, mesh=mesh,
                                         num_windows=window_slots(config.kv_format,
                                                                  config.max_num_seqs),
                                         device=self.device_steps.device)
        # What a step program depends on past its Shape and the weights (`DeviceSteps.programs`
        # are shared by engines over equal weights): the cache's layout and the tree's.
        self._layout = (jax.tree.structure(self.cache), config.tree,
                        tuple(map(placement, jax.tree.leaves(self.cache))))

    @property
    def _with_windows(self) -> bool:
        """Whether step metadata carries window slots: when the cache keeps windows, on every
        step, warm-up's empty ones included, so that each shape compiles once."""
        return self.cache.window_tags is not None

    # -- one step -------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """Runs the plan; returns the tokens of each prefill chunk, then of each decode row
        (one, or with speculative decoding the accepted drafts and the target's token)."""
        self.times = StepTimes()
        return self.dispatch(plan).result()

    def dispatch(self, plan: StepPlan, after: InFlight | None = None) -> InFlight:
        """Starts the plan's step on the device and returns at once for a plain decode step
        (its tokens come with `result()`); other steps are done when this returns. A plan from
        `Scheduler.plan_ahead` needs `after`, the step in flight it follows: its rows feed that
        step's tokens."""
        if plan.ahead != (after is not None):
            raise ValueError("a step planned ahead runs after the step in flight it follows, "
                             "and only such a step does")
        if plan.kind != "idle" and plan.empty:
            raise ValueError(f"a {plan.kind} step with no rows: the scheduler planned nothing")
        if self.mirror is not None:
            self.mirror("step", plan)
        if plan.page_copies:
            src, dst = zip(*plan.page_copies)
            self.cache = copy_pages(self.cache, list(src), list(dst))
        if plan.kind == "prefill":
            return InFlight.done(plan, *self._prefill(plan.prefill))
        if plan.kind == "mixed":
            return InFlight.done(plan, *self._mixed(plan))
        if plan.kind == "decode":
            if self.proposer is not None and any(plan.draft_limits):
                return InFlight.done(plan, *self._speculate(plan))
            return self._decode(plan, after)
        return InFlight.done(plan, [])

    def _inputs(self, seqs: Sequence[SeqState], tokens: np.ndarray, cached: np.ndarray,
                q_lens: np.ndarray, width: int, sample_index: np.ndarray,
                feed: jax.Array | None = None) -> tuple:
        """One step's inputs: host arrays, which the jitted step moves itself (`paged_metadata`
        says why not `jax.device_put`; eager jnp here, even `jnp.asarray`, would compile small
        programs of its own for every new shape), and the sampling arrays, which stay on the
        device while the batch does. `sample_index` [rows]: each row's tokens sampled so far,
        its position in its PRNG stream. One token per row goes as [rows] (the step's sampled
        tokens have that shape): `feed`, the tokens of a step still on the device, replaces
        `tokens` then."""
        b, t = tokens.shape
        meta = paged_metadata([s.pages for s in seqs], b, width, cached, q_lens, t,
                              names=[s.label for s in seqs],
                              with_windows=self._with_windows)
        if feed is not None and feed.shape != (b,):
            raise ValueError(f"a step of {b} rows fed {feed.shape} tokens")
        tok = (tokens[:, 0] if t == 1 else tokens) if feed is None else feed
        return tok, meta, self._sampling(seqs, b), sample_index

    def _sampling(self, seqs: Sequence[SeqState], rows: int) -> SamplingArrays:
        """The rows' sampling arrays; with a structured-output bitmask when some row is
        constrained, each such row's filled by its matcher (the others allow every token)."""
        constrained = [(i, s.request.constraint) for i, s in enumerate(seqs)
                       if s.request.constraint is not None]
        params = tuple(s.request.params for s in seqs)
        if constrained:  # the bitmask changes every step
            allowed = np.full((rows, mask_words(self.device_steps.config.vocab_size)), -1,
                              np.int32)
            fill_bitmask(constrained, allowed)
            return SamplingArrays.from_params(params, batch=rows, allowed=allowed)
        last = self._last_sampling
        if (last is not None and last[0] == rows and len(last[1]) == len(params)
                and all(a is b for a, b in zip(last[1], params))):
            return last[2]
        arrays = SamplingArrays.from_params(params, batch=rows)
        self._last_sampling = (rows, params, arrays)
        return arrays

    def _host_logprobs(self, seqs: Sequence[SeqState], logprobs: SampleLogprobs | None
                       ) -> list[TokenLogprob | None] | None:
        """Each row's logprobs on the host, cut to the top alternatives it asked for (None for
        a row that asked for none); None for a step without logprobs."""
        if logprobs is None:
            return None
        chosen, rank, top_ids, top = (self._wait(a) for a in (
            logprobs.logprob, logprobs.rank, logprobs.top_ids, logprobs.top_logprobs))
        out: list[TokenLogprob | None] = []
        for i, s in enumerate(seqs):
            k = s.request.params.logprobs
            out.append(None if k is None else TokenLogprob(
                token_id=-1, logprob=float(chosen[i]), rank=int(rank[i]),
                top=tuple(zip(top_ids[i, :k].tolist(), top[i, :k].tolist()))))
        return out

    @staticmethod
    def _emitted(tokens: list[int], logprobs: list[TokenLogprob | None] | None
                 ) -> tuple[Emitted, EmittedLogprobs]:
        """One-token rows as a step's result, each logprob naming its token."""
        if logprobs is None:
            return [[t] for t in tokens], None
        return [[t] for t in tokens], [
            [None if lp is None else dataclasses.replace(lp, token_id=t)]
            for t, lp in zip(tokens, logprobs)]

    def _dispatch(self, seqs: Sequence[SeqState], tokens: np.ndarray, cached: np.ndarray,
                  q_lens: np.ndarray, width: int, sample_index: np.ndarray,
                  feed: jax.Array | None = None
                  ) -> tuple[jax.Array, SampleLogprobs | None, jax.Array]:
        """Starts one step; its sampled tokens [rows], their logprobs (when a row asked) and
        final hidden states [rows, T, E] (a proposer's features), on the device."""
        rows, t = tokens.shape
        start = time.perf_counter()
        inputs = self._inputs(seqs, tokens, cached, q_lens, width, sample_index, feed)
        sampling = inputs[2]
        with self._first_use(Shape("decode" if t == 1 else "prefill", rows, t, width,
                                   constrained=sampling.allowed is not None,
                                   logprobs=bool(sampling.num_logprobs),
                                   fed=feed is not None)):
            sampled, logprobs, hidden, self.cache = self.device_steps.prefill_step(self.cache,
                                                                                   *inputs)
        self.times.inputs_s += time.perf_counter() - start
        return sampled, logprobs, hidden

    def _wait(self, values: jax.Array) -> np.ndarray:
        """`values` on the host, once the device has them: the time counts as the device's."""
        start = time.perf_counter()
        if not values.is_fully_addressable:  # replicated over hosts: this host's copy is whole
            values = values.addressable_data(0)
        out = np.asarray(values)
        self.times.device_s += time.perf_counter() - start
        return out

    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[Emitted, EmittedLogprobs]:
        rows = len(chunks)
        t = bucket_for(max(len(c.token_ids) for c in chunks), self.config.prefill_buckets)
        width = self.config.window_for(max(c.start + len(c.token_ids) for c in chunks))
        tokens = np.zeros((rows, t), np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :len(c.token_ids)] = c.token_ids
        cached = np.array([c.start for c in chunks], np.int32)
        q_lens = np.array([len(c.token_ids) for c in chunks], np.int32)
        sample_index = np.array([len(c.seq.request.output_ids) for c in chunks], np.int32)
        seqs = [c.seq for c in chunks]
        sampled, logprobs, hidden = self._dispatch(seqs, tokens, cached, q_lens, width,
                                                   sample_index)
        sampled = self._wait(sampled).tolist()
        if self.proposer is not None:
            self.proposer.observe_prefill(chunks, hidden)
        return self._emitted(sampled[:rows], self._host_logprobs(seqs, logprobs))

    def _mixed_inputs(self, chunk: PrefillChunk | None, seqs: Sequence[SeqState], rows: int,
                      t: int, width: int) -> tuple:
        """A mixed step's arguments: one chunk padded to t tokens, then `rows` decode rows (the
        first len(seqs) real), packed into one row; each row samples after its last token. No
        chunk and no rows (warm-up's dummy): no valid token."""
        ids = chunk.token_ids if chunk is not None else ()
        chunk_seqs = [chunk.seq] if chunk is not None else []
        chunk_meta = paged_metadata([s.pages for s in chunk_seqs], 1, width,
                                    np.array([chunk.start if chunk else 0], np.int32),
                                    np.array([len(ids)], np.int32), t,
                                    names=[s.label for s in chunk_seqs],
                                    with_windows=self._with_windows)
        decode_tokens, cached, q_lens, decode_index = self._decode_rows(seqs, rows)
        decode_meta = paged_metadata([s.pages for s in seqs], rows, width, cached, q_lens, 1,
                                     names=[s.label for s in seqs],
                                     with_windows=self._with_windows)
        tokens = np.zeros(t + rows, np.int32)
        tokens[:len(ids)], tokens[t:] = ids, decode_tokens
        logit_index = np.concatenate([[max(len(ids) - 1, 0)], t + np.arange(rows)])
        chunk_index = [len(chunk.seq.request.output_ids)] if chunk is not None else [0]
        return (tokens[None], MixedMetadata((chunk_meta, decode_meta)),
                logit_index[None].astype(np.int32),
                self._sampling(chunk_seqs + list(seqs), rows + 1),
                np.concatenate([chunk_index, decode_index]).astype(np.int32))

    def _mixed(self, plan: StepPlan) -> tuple[Emitted, EmittedLogprobs]:
        """A prefill chunk and every decode row in one forward: the weights are read once for
        both, where alternating steps read them twice."""
        (chunk,), seqs = plan.prefill, plan.decode
        # Decode rows pad to the largest batch: the chunk dominates the step's cost, and one row
        # bucket keeps the mixed programs to chunk buckets x widths (each pair of buckets ran
        # XLA:CPU out of memory maps for its compiled code at 105 programs).
        rows = self.config.decode_buckets[-1]
        t = bucket_for(len(chunk.token_ids), self.config.prefill_buckets)
        width = max(self.config.window_for(chunk.start + len(chunk.token_ids)),
                    self._decode_window(seqs))
        start = time.perf_counter()
        inputs = self._mixed_inputs(chunk, seqs, rows, t, width)
        sampling = inputs[3]
        with self._first_use(Shape("mixed", rows, t, width,
                                   constrained=sampling.allowed is not None,
                                   logprobs=bool(sampling.num_logprobs))):
            sampled, logprobs, self.cache = self.device_steps.mixed_step(self.cache, *inputs)
        self.times.inputs_s += time.perf_counter() - start
        real = [chunk.seq] + list(seqs)
        return self._emitted(self._wait(sampled)[:len(real)].tolist(),
                             self._host_logprobs(real, logprobs))

    def _decode_rows(self, seqs: Sequence[SeqState], rows: int, ahead: int = 0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Decode rows padded to `rows`: (fed tokens, cached tokens, query counts, PRNG
        indices), each [rows]. Planned ahead (ahead=1), each row sits one slot further and its
        token comes from the device, not from here."""
        tokens, cached, q_lens, sample_index = (np.zeros(rows, np.int32) for _ in range(4))
        for i, s in enumerate(seqs):
            if not ahead:
                tokens[i] = s.request.last_token_id  # decode-ready: the one token not cached
            cached[i], q_lens[i] = s.num_computed + ahead, 1
            sample_index[i] = len(s.request.output_ids) + ahead
        return tokens, cached, q_lens, sample_index

    def _decode_window(self, seqs: Sequence[SeqState], ahead: int = 0) -> int:
        """The page-table width of decode rows. Pages reserved for drafts that were then not
        proposed count too: the table holds them."""
        return self.config.window_for(
            max(max(s.num_computed + 1 + ahead, s.pages.capacity) for s in seqs))

    def _decode(self, plan: StepPlan, after: InFlight | None = None) -> InFlight:
        """One token per row. A static batch computes its finished rows too: `decode_width`
        rows at least. Planned ahead (`after`), each row sits one slot further than its
        computed tokens and feeds the token `after` samples for it."""
        seqs, ahead = plan.decode, int(after is not None)
        rows = bucket_for(max(len(seqs), plan.decode_width), self.config.decode_buckets)
        width = self._decode_window(seqs, ahead)
        tokens, cached, q_lens, sample_index = self._decode_rows(seqs, rows, ahead)
        sampled, logprobs, hidden = self._dispatch(
            seqs, tokens[:, None], cached, q_lens, width, sample_index,
            feed=after.feed if after is not None else None)

        def collect() -> tuple[Emitted, EmittedLogprobs]:
            out = self._emitted(self._wait(sampled)[:len(seqs)].tolist(),
                                self._host_logprobs(seqs, logprobs))
            if self.proposer is not None:
                self.proposer.commit(seqs, out[0], hidden)
            return out

        return InFlight(plan, collect, feed=sampled)

    def _speculate(self, plan: StepPlan) -> tuple[Emitted, EmittedLogprobs]:
        """Proposals, then one target pass over [last token, drafts] per row and exact
        verification on device; each row advances by its own accepted length."""
        seqs, k = plan.decode, self.config.num_speculative_tokens
        drafted = [s.label for s, n in zip(seqs, plan.draft_limits)
                   if n and s.request.params.plain_steps_only]
        if drafted:
            raise ValueError(f"{', '.join(drafted)} asked for logprobs or structured output, "
                             "which hold for one position: the scheduler plans no drafts for "
                             "such a row")
        rows = bucket_for(max(len(seqs), plan.decode_width), self.config.decode_buckets)
        if self.config.tree is not None:
            return self._speculate_tree(plan, rows)
        drafts, counts, draft_probs = self.proposer.propose(seqs, plan.draft_limits, rows, k)
        if not counts.any():  # nothing to verify: a plain decode step is k+1 times cheaper
            pending = self._decode(plan)
            return pending.result(), pending.logprobs()
        tokens = np.zeros((rows, k + 1), np.int32)
        tokens[:, 1:] = drafts
        cached = np.zeros(rows, np.int32)
        q_lens = np.zeros(rows, np.int32)
        sample_index = np.zeros(rows, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, 0] = s.request.last_token_id
            cached[i], q_lens[i] = s.num_computed, 1 + counts[i]
            sample_index[i] = len(s.request.output_ids)
        width = self._verify_window(seqs, cached + q_lens)
        start = time.perf_counter()
        tok, meta, sampling, index = self._inputs(seqs, tokens, cached, q_lens, width,
                                                  sample_index)
        with self._first_use(Shape("verify", rows, k + 1, width, draft_probs is not None,
                                   constrained=sampling.allowed is not None,
                                   logprobs=bool(sampling.num_logprobs))):
            accepted, emitted, logprobs, hidden, self.cache = self.device_steps.verify_step(
                self.cache, tok, meta, jax.device_put(drafts), jax.device_put(counts),
                draft_probs, sampling, index)
        self.times.inputs_s += time.perf_counter() - start
        return self._accepted(seqs, counts, accepted, emitted, logprobs, hidden)

    def _verify_window(self, seqs: Sequence[SeqState], ends: np.ndarray) -> int:
        """The page-table width of a verify step whose rows write up to `ends` [rows]; pages
        reserved past them count too (the table holds them)."""
        return self.config.window_for(max(int(ends.max()), max(s.pages.capacity for s in seqs)))

    def _accepted(self, seqs: Sequence[SeqState], counts: np.ndarray, accepted: jax.Array,
                  emitted: jax.Array, logprobs: SampleLogprobs | None, hidden: jax.Array
                  ) -> tuple[Emitted, EmittedLogprobs]:
        """A verify step's tokens per row (its accepted drafts, then the target's own), once
        the device has them; counted, and handed to the proposer with the path's features.
        Logprobs, where the step has them, are of the rows without drafts (the only rows that
        ask: `Scheduler` drafts none for them), each of its one token."""
        accepted, emitted = self._wait(accepted), self._wait(emitted)
        out = [emitted[i, :accepted[i] + 1].tolist() for i in range(len(seqs))]
        self.spec_stats.record(counts[:len(seqs)], accepted[:len(seqs)])
        self.proposer.commit(seqs, out, hidden)
        row_logprobs = self._host_logprobs(seqs, logprobs)
        if row_logprobs is None:
            return out, None
        return out, [[None] * len(tokens) if lp is None
                     else [dataclasses.replace(lp, token_id=tokens[0])]
                     for tokens, lp in zip(out, row_logprobs)]

    def _speculate_tree(self, plan: StepPlan, rows: int) -> tuple[Emitted, EmittedLogprobs]:
        """A tree per row from the proposer, one target pass over every row's tree with a tree
        mask, exact verification, and the accepted paths' KV compacted in place
        (`DeviceSteps.tree_verify_step`); each row advances by its own path."""
        seqs, shape = plan.decode, self.config.tree
        nodes, parents, counts = self.proposer.propose_tree(seqs, plan.draft_limits, rows)
        if not counts.any():  # nothing to verify: a plain decode step is far cheaper
            pending = self._decode(plan)
            return pending.result(), pending.logprobs()
        n = shape.num_nodes
        roots, cached, q_lens, sample_index = self._decode_rows(seqs, rows)
        q_lens[:len(seqs)] += counts[:len(seqs)]
        width = self._verify_window(seqs, cached + q_lens)
        start = time.perf_counter()
        _, meta, sampling, index = self._inputs(seqs, np.zeros((rows, n), np.int32), cached,
                                                q_lens, width, sample_index)
        with self._first_use(Shape("tree", rows, n, width,
                                   constrained=sampling.allowed is not None,
                                   logprobs=bool(sampling.num_logprobs))):
            accepted, emitted, logprobs, hidden, self.cache = self.device_steps.tree_verify_step(
                self.cache, jax.device_put(roots), nodes, parents, meta, sampling, index,
                shape.depth)
        self.times.inputs_s += time.perf_counter() - start
        return self._accepted(seqs, counts, accepted, emitted, logprobs, hidden)


    # -- compilation ----------------------------------------------------------------------------

    def shapes(self) -> list[Shape]:
        """Every step program a serving run can execute, listed from the buckets, not guessed
        back from (rows, tokens): a one-row verify of k+1 tokens is its own program even when
        k+1 is also a prefill chunk's bucket."""
        k = self.config.num_speculative_tokens
        probs = [False]
        if k and self.proposer.samples_drafts:
            probs.append(True)  # sampled drafts come with their probabilities: one more program
        out = []
        for width in self.config.window_buckets:
            for rows in self.config.decode_buckets:
                out.append(Shape("decode", rows, 1, width))
                if self.config.tree is not None:
                    out.append(Shape("tree", rows, self.config.tree.num_nodes, width))
                    continue
                out += [Shape("verify", rows, k + 1, width, p) for p in probs if k]
            # A one-token chunk runs the one-row decode program (same step, same shapes).
            out += [Shape("prefill", 1, t, width) for t in self.config.prefill_buckets if t > 1]
            if self.config.mixed_steps:
                rows = self.config.decode_buckets[-1]
                out += [Shape("mixed", rows, t, width) for t in self.config.prefill_buckets]
        return out

    def page_copy_sizes(self) -> tuple[int, ...]:
        """The padded lengths `copy_pages` can be called with: powers of two up to the most
        pages one step writes (a copy-on-write copies only pages the step writes into)."""
        c = self.config
        spanned = lambda tokens: -(-(tokens - 1) // c.page_size) + 1  # pages `tokens` can touch
        most = max(spanned(c.max_prefill_tokens),
                   c.max_num_seqs * spanned(c.num_speculative_tokens + 1))
        return powers_of_two(1, 1 << (min(most, c.num_pages) - 1).bit_length())

    def _dummy(self, shape: Shape) -> tuple:
        """Step arguments of one shape with no valid token: nothing is written, samples are
        ignored. Verify steps get (drafts, counts, draft_probs) after the metadata."""
        rows, t = shape.rows, shape.tokens
        if shape.kind == "mixed":
            return self._mixed_inputs(None, [], rows, t, shape.width)
        zeros = np.zeros(rows, np.int32)
        tok, meta, sampling, index = self._inputs([], np.zeros((rows, t), np.int32), zeros,
                                                  zeros, shape.width, zeros)
        if shape.kind == "tree":
            return (jax.device_put(zeros), jax.device_put(np.zeros((rows, t - 1), np.int32)),
                    jax.device_put(np.tile(np.arange(t, dtype=np.int32) - 1, (rows, 1))), meta,
                    sampling, index, self.config.tree.depth)
        if shape.kind != "verify":
            return tok, meta, sampling, index
        k = t - 1
        vocab = self.device_steps.config.vocab_size
        probs = (jax.device_put(np.zeros((rows, k, vocab), np.float32))
                 if shape.draft_probs else None)
        return (tok, meta, jax.device_put(np.zeros((rows, k), np.int32)), jax.device_put(zeros),
                probs, sampling, index)

    def _compiled(self, shape: Shape) -> bool:
        """Whether this runner, or an engine over these weights, ran `shape`'s program (what
        this runner ran, `ready`, is marked there too)."""
        return (shape, self._layout) in self.device_steps.programs.ran

    def _ran(self, shape: Shape) -> None:
        """Marks `shape` run, once its step has returned: its program is compiled (`ready`
        holds programs: a fed variant's is its twin's)."""
        self.ready.add(_unfed(shape))
        self.device_steps.programs.ran.add((shape, self._layout))

    @contextlib.contextmanager
    def _first_use(self, shape: Shape) -> Iterator[None]:
        """Around the step that runs `shape`: announces a program nothing over these weights ran
        (its step compiles it, or loads it from the persistent cache)."""
        # A fed variant's program is its twin's, which it reuses unless JAX dropped it since.
        if not self._compiled(shape) and not (shape.fed and self._compiled(_unfed(shape))):
            if shape.constrained or shape.logprobs:
                logger().info("compiling the %s (a variant compiled on its first use only)",
                              shape)
            else:
                logger().info("compiling the %s (its first use in this process; "
                              "Engine.warmup() compiles all %d ahead)", shape, len(self.shapes()))
        yield
        self._ran(shape)

    def _run_shape(self, shape: Shape) -> None:
        args = self._dummy(shape)
        step, _ = self._program(shape)
        if shape.fed:  # fed, as a step planned ahead is, by a step's sampled tokens
            sampled, *_, self.cache = step(self.cache, *args)
            args = (sampled, *args[1:])
        *_, self.cache = step(self.cache, *args)
        self._ran(shape)

    def fed_shapes(self) -> list[Shape]:
        """The decode programs reached with tokens still on the device: every decode shape
        where steps are planned ahead (no speculation)."""
        if self.config.num_speculative_tokens:
            return []
        return [dataclasses.replace(s, fed=True) for s in self.shapes() if s.kind == "decode"]

    def _program(self, shape: Shape
                 ) -> tuple[Callable[..., tuple], Callable[..., jax.stages.Lowered]]:
        """(the step, its lowering) that runs `shape`: prefill and decode shapes share
        prefill_step; verify and mixed steps have their own."""
        steps = self.device_steps
        if shape.kind == "verify":
            return steps.verify_step, steps.lower_verify
        if shape.kind == "tree":
            return steps.tree_verify_step, steps.lower_tree_verify
        if shape.kind == "mixed":
            return steps.mixed_step, steps.lower_mixed
        return steps.prefill_step, steps.lower_prefill

    def warmup(self, progress: bool = False, threads: int = 2) -> int:
        """Compiles every program a serving run can execute (`shapes`, the page copies, and the
        proposer's own); returns their number.

        With JAX's persistent compilation cache on (`infer.platform.enable_compilation_cache`),
        the step programs are first compiled ahead of time on `threads` threads into that cache;
        each is then run once, which loads it. Without it, each is compiled as it is run.
        """
        if self.mirror is not None:
            self.mirror("warmup", False, threads)
        shapes = self.shapes()
        fed = self.fed_shapes()
        # Programs an earlier engine over these weights ran are compiled: nothing to do.
        todo = [shape for shape in shapes + fed if not self._compiled(shape)]
        if jax.config.jax_compilation_cache_dir and threads > 1:
            import concurrent.futures

            def compile_one(shape: Shape) -> None:
                _, lower = self._program(shape)
                lower(self.cache, *self._dummy(shape)).compile()

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(compile_one, [s for s in todo if not s.fed]))
        if progress:
            from tqdm import tqdm
            todo = tqdm(todo, desc="compiling buckets", leave=False)
        for shape in todo:
            self._run_shape(shape)
        self.ready.update(shapes)  # those an engine over these weights ran included
        copies = self.page_copy_sizes()
        for n in copies:  # copies onto page num_pages are dropped: the pool is unchanged
            self.cache = copy_pages(self.cache, [0] * n, [self.config.num_pages] * n)
        proposed = self.proposer.warmup() if self.proposer else 0
        # Steps are dispatched asynchronously: without this, warm-up returned with its empty
        # steps still queued (with programs loaded from the persistent cache, seconds of them)
        # and the caller's first real step waited behind them.
        jax.block_until_ready(self.cache)
        return len(shapes) + len(copies) + proposed

    @property
    def kv_bytes(self) -> int:
        return self.cache.num_bytes


