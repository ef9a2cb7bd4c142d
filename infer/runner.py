"""The device side of the engine: turns a `StepPlan` into fixed-shape arrays, runs the jitted
step on the paged cache, and returns the sampled tokens.

Shapes are bucketed so that a serving run compiles a fixed set of programs, all during
`warmup()`: decode rows pad to a power of two up to `max_num_seqs`, prefill chunks to a power of
two up to `max_prefill_tokens`, and page tables to a power-of-two number of tokens (at least
`MIN_WINDOW`) up to `max_model_len`. Padding rows have no valid token: their writes are dropped
and their samples ignored. Sampling parameters and PRNG positions are arrays, never static.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.buckets import bucket_for
from infer.kv_cache import AttentionMetadata
from infer.model import Llama
from infer.paged_cache import PagedKVCache, copy_pages
from infer.sampling import SamplingArrays, SamplingParams
from infer.scheduler import PrefillChunk, SeqState, StepPlan

if TYPE_CHECKING:
    from infer.proposers import Proposer
from infer.steps import Steps

MIN_WINDOW = 128  # smallest attention window in tokens


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... up to and including hi (hi itself added if not a power)."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return tuple(out) + (hi,)


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

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        return powers_of_two(1, self.max_num_seqs)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return powers_of_two(min(16, self.max_prefill_tokens), self.max_prefill_tokens)

    @property
    def window_buckets(self) -> tuple[int, ...]:
        """Page-table widths in pages."""
        g = self.page_size
        tokens = powers_of_two(min(MIN_WINDOW, self.max_model_len), self.max_model_len)
        return tuple(dict.fromkeys(-(-t // g) for t in tokens))

    def window_for(self, tokens: int) -> int:
        """The page-table width bucket (in pages) that holds `tokens` tokens."""
        return bucket_for(-(-tokens // self.page_size), self.window_buckets)


def page_tables(seqs: Sequence[SeqState], rows: int, width: int,
                row_of: Sequence[int] | None = None) -> np.ndarray:
    """[rows, width] page ids, sequence i in row `row_of[i]` (default i), zero-padded (padding
    rows write nothing)."""
    tables = np.zeros((rows, width), np.int32)
    for i, s in zip(range(len(seqs)) if row_of is None else row_of, seqs):
        tables[i, :len(s.pages.pages)] = s.pages.pages
    return tables


@dataclasses.dataclass
class SpeculationStats:
    """Counts over the verify steps of a run (rows that proposed at least one draft)."""

    verify_steps: int = 0  # device passes that verified drafts
    rows: int = 0  # row verifications: one request in one verify step
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    def record(self, counts: np.ndarray, accepted: np.ndarray) -> None:
        used = counts > 0
        self.verify_steps += 1
        self.rows += int(used.sum())
        self.proposed += int(counts.sum())
        self.accepted += int(accepted[used].sum())

    def summary(self) -> dict[str, float]:
        """acceptance_rate = accepted / proposed; tokens_per_verify = tokens each verifying row
        emitted on average (its accepted drafts and the target's own token)."""
        return {**dataclasses.asdict(self),
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_verify": (self.accepted + self.rows) / self.rows if self.rows else 0.0}


class Runner:
    def __init__(self, model: Llama, config: RunnerConfig,
                 proposer: "Proposer | None" = None) -> None:
        if (proposer is None) != (config.num_speculative_tokens == 0):
            raise ValueError("speculative decoding needs both a proposer and "
                             "num_speculative_tokens > 0")
        self.config = config
        self.proposer = proposer
        self.spec_stats = SpeculationStats()
        self.steps = Steps(model)
        c = model.config
        self.cache = PagedKVCache.create(c.num_layers, config.num_pages, config.page_size,
                                         c.num_kv_heads, c.head_dim, config.kv_format,
                                         config.attention_backend)

    # -- one step -------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """Runs the plan; returns the tokens of each prefill chunk, then of each decode row
        (one, or with speculative decoding the accepted drafts and the target's token)."""
        if plan.page_copies:
            src, dst = zip(*plan.page_copies)
            self.cache = copy_pages(self.cache, list(src), list(dst))
        if plan.kind == "prefill":
            return [[t] for t in self._prefill(plan.prefill)]
        if plan.kind == "decode":
            if self.proposer is not None and any(plan.draft_limits):
                return self._speculate(plan.decode, plan.draft_limits, plan.decode_width)
            return self._decode(plan.decode, plan.decode_width)
        return []

    def _inputs(self, tokens: np.ndarray, cached: np.ndarray, q_lens: np.ndarray,
                tables: np.ndarray, params: Sequence[SamplingParams], steps: np.ndarray) -> tuple:
        """Device arrays for one step, built on the host: eager jnp arithmetic here would
        compile small programs of its own for every new shape."""
        b, t = tokens.shape
        positions = cached[:, None] + np.arange(t, dtype=np.int32)[None, :]
        meta = AttentionMetadata(positions=jnp.asarray(positions),
                                 lengths=jnp.asarray(cached + q_lens), q_lens=jnp.asarray(q_lens),
                                 page_tables=jnp.asarray(tables))
        return (jnp.asarray(tokens), meta, SamplingArrays.from_params(params, batch=b),
                jnp.asarray(steps))

    def _run(self, *host_inputs: np.ndarray | Sequence[SamplingParams]
             ) -> tuple[list[int], jax.Array]:
        """Sampled tokens and the final hidden states [rows, T, E] (a proposer's features)."""
        sampled, _, hidden, self.cache = self.steps.prefill_step(self.cache,
                                                                 *self._inputs(*host_inputs))
        return np.asarray(sampled).tolist(), hidden

    def _prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        rows = len(chunks)
        t = bucket_for(max(len(c.token_ids) for c in chunks), self.config.prefill_buckets)
        width = self.config.window_for(max(c.start + len(c.token_ids) for c in chunks))
        tokens = np.zeros((rows, t), np.int32)
        tables = page_tables([c.seq for c in chunks], rows, width)
        for i, c in enumerate(chunks):
            tokens[i, :len(c.token_ids)] = c.token_ids
        cached = np.array([c.start for c in chunks], np.int32)
        q_lens = np.array([len(c.token_ids) for c in chunks], np.int32)
        steps = np.array([len(c.seq.request.output_ids) for c in chunks], np.int32)
        sampled, hidden = self._run(tokens, cached, q_lens, tables,
                                    [c.seq.request.params for c in chunks], steps)
        if self.proposer is not None:
            self.proposer.observe_prefill(chunks, hidden)
        return sampled[:rows]

    def _decode(self, seqs: list[SeqState], width: int = 0) -> list[list[int]]:
        """`width`: rows to compute at least (a static batch computes its finished rows too)."""
        rows = bucket_for(max(len(seqs), width), self.config.decode_buckets)
        # Pages reserved for drafts that were then not proposed count too: the table holds them.
        width = self.config.window_for(max(max(s.num_computed + 1, s.pages.capacity) for s in seqs))
        tokens = np.zeros((rows, 1), np.int32)
        tables = page_tables(seqs, rows, width)
        cached = np.zeros(rows, np.int32)
        q_lens = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, 0] = s.request.last_token_id  # decode-ready: the one token not cached
            cached[i], q_lens[i] = s.num_computed, 1
            steps[i] = len(s.request.output_ids)
        sampled, hidden = self._run(tokens, cached, q_lens, tables,
                                    [s.request.params for s in seqs], steps)
        out = [[t] for t in sampled[:len(seqs)]]
        if self.proposer is not None:
            self.proposer.commit(seqs, out, hidden)
        return out

    def _speculate(self, seqs: list[SeqState], limits: list[int], width: int) -> list[list[int]]:
        """Proposals, then one target pass over [last token, drafts] per row and exact
        verification on device; each row advances by its own accepted length."""
        k = self.config.num_speculative_tokens
        rows = bucket_for(max(len(seqs), width), self.config.decode_buckets)
        drafts, counts, draft_probs = self.proposer.propose(seqs, limits, rows, k)
        if not counts.any():  # nothing to verify: a plain decode step is k+1 times cheaper
            return self._decode(seqs, width)
        tokens = np.zeros((rows, k + 1), np.int32)
        tokens[:, 1:] = drafts
        cached = np.zeros(rows, np.int32)
        q_lens = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, 0] = s.request.last_token_id
            cached[i], q_lens[i] = s.num_computed, 1 + counts[i]
            steps[i] = len(s.request.output_ids)
        tables = page_tables(seqs, rows, self.config.window_for(
            max(int((cached + q_lens).max()), max(s.pages.capacity for s in seqs))))
        params = [s.request.params for s in seqs]
        tok, meta, sampling, steps = self._inputs(tokens, cached, q_lens, tables, params, steps)
        accepted, emitted, hidden, self.cache = self.steps.verify_step(
            self.cache, tok, meta, jnp.asarray(drafts), jnp.asarray(counts), draft_probs,
            sampling, steps)
        accepted, emitted = np.asarray(accepted), np.asarray(emitted)
        out = [emitted[i, :accepted[i] + 1].tolist() for i in range(len(seqs))]
        self.spec_stats.record(counts[:len(seqs)], accepted[:len(seqs)])
        self.proposer.commit(seqs, out, hidden)
        return out


    # -- compilation ----------------------------------------------------------------------------

    def shapes(self) -> Iterator[tuple[int, int, int]]:
        """Every (rows, tokens per row, page-table width) a serving run can use; rows of
        k+1 tokens are speculative verification steps."""
        k = self.config.num_speculative_tokens
        for width in self.config.window_buckets:
            for rows in self.config.decode_buckets:
                yield rows, 1, width
                if k:
                    yield rows, k + 1, width
            for t in self.config.prefill_buckets:
                yield 1, t, width

    def _dummy(self, rows: int, t: int, width: int) -> tuple:
        """Inputs of one shape with no valid token: nothing is written, samples are ignored."""
        zeros = np.zeros(rows, np.int32)
        return (np.zeros((rows, t), np.int32), zeros, zeros, np.zeros((rows, width), np.int32),
                [SamplingParams()] * rows, zeros)

    def warmup(self, progress: bool = False, threads: int = 2) -> int:
        """Compiles every bucket; returns the number of programs.

        With JAX's persistent compilation cache on (`infer.platform.enable_compilation_cache`),
        the programs are first compiled ahead of time on `threads` threads into that cache;
        each is then run once, which loads it. Without it, each is compiled as it is run.
        """
        shapes = list(self.shapes())
        if jax.config.jax_compilation_cache_dir and threads > 1:
            import concurrent.futures

            def compile_one(shape: tuple[int, int, int]) -> None:
                args = self._inputs(*self._dummy(*shape))
                if self._is_verify(*shape):
                    rows, k = shape[0], self.config.num_speculative_tokens
                    self.steps.lower_verify(self.cache, args[0], args[1],
                                            jnp.zeros((rows, k), jnp.int32),
                                            jnp.zeros(rows, jnp.int32), None, *args[2:]).compile()
                else:
                    self.steps.lower_prefill(self.cache, *args).compile()

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(compile_one, shapes))
        todo = shapes
        if progress:
            from tqdm import tqdm
            todo = tqdm(shapes, desc="compiling buckets", leave=False)
        for shape in todo:
            self._run_shape(*shape)
        return len(shapes) + (self.proposer.warmup() if self.proposer is not None else 0)

    def _is_verify(self, rows: int, t: int, width: int) -> bool:
        return t > 1 and t == self.config.num_speculative_tokens + 1 and (
            rows > 1 or t not in self.config.prefill_buckets)

    def _run_shape(self, rows: int, t: int, width: int) -> None:
        k = self.config.num_speculative_tokens
        if not self._is_verify(rows, t, width):
            self._run(*self._dummy(rows, t, width))
            return
        tok, meta, sampling, steps = self._inputs(*self._dummy(rows, t, width))
        zeros = jnp.zeros(rows, jnp.int32)
        # Deterministic drafts come without probabilities; sampled ones with them: two programs.
        probs = [None]
        if self.proposer.samples_drafts:
            probs.append(jnp.zeros((rows, k, self.steps.config.vocab_size), jnp.float32))
        for draft_probs in probs:
            *_, self.cache = self.steps.verify_step(self.cache, tok, meta,
                                                    jnp.zeros((rows, k), jnp.int32), zeros,
                                                    draft_probs, sampling, steps)

    @property
    def kv_bytes(self) -> int:
        return self.cache.num_bytes


class CompileCounter:
    """Counts programs made executable while active, through JAX's monitoring events. The
    event times `compile_or_get_cached`, so it fires once per program whether XLA compiles it or
    loads it from the persistent compilation cache (a program an earlier engine or process
    compiled is still one this process had not run)."""

    EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT

    def __init__(self) -> None:
        self.count = 0

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        from jax._src import monitoring
        monitoring.unregister_event_duration_listener(self._listener)
