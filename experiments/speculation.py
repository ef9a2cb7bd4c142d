"""Speculative decoding on SmolLM2: what each proposer's acceptance buys, against the lesson's
cost model.

  python -m experiments.speculation                     # the full sweep (see below)
  python -m experiments.speculation --quick             # a smoke run (~3 min)
  python -m experiments.speculation --methods=ngram --ks=2,4 --batch_sizes=1

Cost on 2 shared CPU cores (load ~5), first run: batch 1 with ngram + self_draft, all ks and
both temperatures, ~9 min; each method adds ~4-5 min per batch size, so the full default sweep
(4 methods x 2 batch sizes + the tree part, ~4 min) is ~35-40 min there. Programs persist in
JAX's compilation cache, so later runs compile less.

Part `engine`: method x k (drafts per step) x temperature x batch, each through the serving
engine (`LLM.from_loaded(..., speculative={"method": m, "num_tokens": k})`) against the same
engine without speculation, on the same prompts in the same run. n-gram lookup gets
input-grounded prompts (summarize / rewrite / repeat with edits a held-out snippet: text it can
copy); suffix decoding gets repetitive ones (two extraction instructions over many records of
one shape: templated answers, whose template its corpus of finished outputs holds); the model
drafts (draft, self_draft, eagle) get chat prompts. --prompt_kind gives every method one kind
(`--methods=ngram,suffix --prompt_kind=repetitive`: n-gram as suffix decoding's peer).
--draft_confidence gives the model drafts a confidence stop (`SpeculativeConfig.draft_confidence`;
its rows say `draft_confidence`, the tables' `stop`). Each timed pass starts suffix decoding with an empty corpus, so a pass repeated for warm-up drafts
nothing from its own earlier outputs. Snippets come from
`real_text` at >= 360,000 characters, which draft training never saw. A method whose weights
file is missing is skipped with a note. --engine_trees=2x3,3x4/15 adds EAGLE trees to method
eagle's chains, through the same engine (`speculative={"method": "eagle", "tree": ...}`, one
tree per row at any batch); their rows name the tree, and their k is the candidates a row
verifies at most (c is then per candidate, and tokens per verify step is the tree's).

Part `tree`: `infer.spec.tree.tree_generate` at batch 1, the EAGLE head expanded as a
tree (2 x 3: 14 candidates), as a chain of the same depth, or (--dynamic_trees) as EAGLE-2's
dynamic trees, against plain decoding over the same contiguous cache.

Measured per row: decode tokens/s (tokens after each request's first, over the time of the
engine's decode steps; prefill steps are not counted), speedup over the baseline, acceptance
rate (accepted / proposed drafts), tokens emitted per verify step (accepted + the target's own),
and the draft/target cost ratio c (proposer time per drafted token over a baseline decode step)
and verify ratio v (a verify step's own time over a baseline decode step). Beside each row, the
lesson's cost model: with per-token acceptance alpha and k drafts a verify step emits
E = (1 - alpha^(k+1)) / (1 - alpha) tokens on average and costs k c + v baseline steps, so

    predicted speedup = E / (k c + v)         (Leviathan et al. take v = 1)

evaluated at alpha = the measured acceptance rate, and (`pred_mle` columns) at the per-position
acceptance alpha_mle = accepted / (drafts the verifier looked at: accepted + first rejections),
which is what the formula's alpha means; the acceptance rate (accepted / proposed) understates
it, since drafts after a rejection count as proposed but are never judged.

Output: results/speculation.jsonl, Markdown tables on stdout, results/speculation.png.

The parallel flags are `LLM`'s, but speculative decoding runs on one device (its proposers are
not placed on a mesh) and the rows time one engine's steps: --tensor_parallel_size and
--data_parallel_size other than 1 are refused before any work.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from experiments.workloads import build_prompts  # the prompts of both parts
from infer.parallel.flags import define_parallel_flags


def _tree_shape(text: str) -> Any:
    """`TreeShape.parse` (ValueError on a bad shape), imported when the flags are checked."""
    from infer.spec.tree_draft import TreeShape

    return TreeShape.parse(text)


FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("parts", ["engine", "tree"], "engine (chain methods through the serving "
                  "engine), tree (eagle_generate tree vs chain at batch 1)", flag_values=FLAGS)
validate_list_flag(FLAGS, "parts", choices=["engine", "tree"])
# SpeculativeConfig's SPECULATIVE_METHODS (infer.spec.config starts JAX: not imported here).
METHODS = ["ngram", "draft", "self_draft", "eagle", "suffix"]
flags.DEFINE_list("methods", METHODS, "speculative methods", flag_values=FLAGS)
validate_list_flag(FLAGS, "methods", choices=METHODS)
flags.DEFINE_enum("prompt_kind", "", ["", "grounded", "chat", "repetitive"], "one prompt kind "
                  "for every method; empty: each method's own (ngram: grounded, suffix: "
                  "repetitive, the model drafts: chat)", flag_values=FLAGS)
flags.DEFINE_list("ks", ["1", "2", "4", "8"], "drafts per step", flag_values=FLAGS)
# SpeculativeConfig's num_tokens range, refused there only once the baselines were measured.
validate_list_flag(FLAGS, "ks", parse=int, lower_bound=1, upper_bound=16)
flags.DEFINE_list("temperatures", ["0", "0.7"], "sampling temperatures", flag_values=FLAGS)
validate_list_flag(FLAGS, "temperatures", parse=float, lower_bound=0.0)
flags.DEFINE_list("batch_sizes", ["1", "8"], "engine batch sizes (max_num_seqs)",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", parse=int, lower_bound=1)
flags.DEFINE_integer("num_prompts", 3, "prompts per run, at least one per batch slot (batch 1 "
                     "runs them one by one)", lower_bound=1, flag_values=FLAGS)
# Two at least: a row's decode tokens are those after its first (prefill's); with one there
# are none, and its tok/s and speedup are NaN (the tree part's divide by zero).
flags.DEFINE_integer("max_tokens", 32, "output tokens per request at most", lower_bound=2,
                     flag_values=FLAGS)
flags.DEFINE_integer("snippet_chars", 500, "characters of held-out text per prompt at most",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_enum("warmup", "pass", ["pass", "engine"], "pass: a workload runs again while "
                  "its pass built new programs (only the shapes it uses get built); engine: "
                  "llm.engine.warmup() first (every bucket: more programs), then the same",
                  flag_values=FLAGS)
flags.DEFINE_integer("tree_branches", 2, "children per node of the EAGLE tree", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("tree_depth", 3, "levels of the EAGLE tree (and drafts of its chain)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("dynamic_trees", [], "EAGLE-2 dynamic trees of the tree part, each "
                  "BxD/N or BxDwW/N (`TreeShape.parse`: top-B children, D levels, the N likeliest "
                  "candidates verified, W nodes expanded per level, default B)",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "dynamic_trees", parse=_tree_shape, allow_empty=True)
flags.DEFINE_list("engine_trees", [], "EAGLE trees run through the serving engine in the engine "
                  "part, each 'BxD' (full) or 'BxD/N' (dynamic, N candidates), beside method eagle's "
                  "chains (needs eagle in --methods)", flag_values=FLAGS)
validate_list_flag(FLAGS, "engine_trees", parse=_tree_shape, allow_empty=True)
flags.DEFINE_integer("tree_prompts", 4, "chat prompts of the tree part", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_bool("random_head", False, "tree part without trained EAGLE weights: a random head "
                  "(exactness and timing only; acceptance is near 0)", flag_values=FLAGS)
flags.DEFINE_bool("quick", False, "smoke run: ks 1,2; temperature 0; batch 1,2; 2 prompts; "
                  "16 tokens", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "sampling seed of the first request", flag_values=FLAGS)
flags.DEFINE_integer("draft_vocab_size", 0, "model drafts and the tree part's head score only "
                     "this many of the most frequent target ids (FR-Spec, "
                     "weights/draft_vocab_smollm2.npy); 0: the whole vocabulary",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_float("draft_confidence", 0.0, "model drafts stop before the first draft whose "
                   "running product of top probabilities is below this (EAGLE-2's confidence); "
                   "0: no stop", lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_string("eagle_path", "", "the EAGLE head (EAGLE-1 or EAGLE-3) of method eagle and "
                    "of the tree part; empty: SpeculativeConfig's default", flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the target's weights (and KV "
                  "cache); draft heads and draft models keep their own dtype", flag_values=FLAGS)
flags.DEFINE_string("out", "results/speculation.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)

WEIGHT_PATHS = {"draft": "draft_path", "eagle": "eagle_path"}  # SpeculativeConfig fields
METHOD_PROMPTS = {"ngram": "grounded", "suffix": "repetitive"}  # the others: chat


def prompt_kind_of(method: str, override: str = "") -> str:
    """The prompt kind a method runs on: `override` when set, else the method's own."""
    return override or METHOD_PROMPTS.get(method, "chat")


def check_prompt_count(kind: str, count: int, snippet_chars: int, flag: str) -> None:
    """Refuses, naming `flag`, more prompts of `kind` than `build_prompts` can make of the
    held-out text (a grounded prompt takes a paragraph, a chat prompt one after the first
    `count`), without the tokenizer: before the model loads."""
    from experiments.workloads import held_out_paragraphs

    if kind == "repetitive":  # records, made up: no limit
        return
    try:
        held_out_paragraphs(count, max_chars=snippet_chars, skip=count if kind == "chat" else 0)
    except ValueError as e:
        raise ValueError(f"--{flag}={count}: more {kind} prompts than the held-out text gives "
                         f"({e})") from None


# -- the cost model --------------------------------------------------------------------------

def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a verify step emits on average with k drafts each accepted with probability alpha
    (given the ones before it were): (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: float, c: float, v: float, verify_fraction: float = 1.0,
                      depth: float | None = None, step_fraction: float | None = None,
                      plain_cost: float = 1.0) -> float:
    """The lesson's cost model: a verify step emits expected_tokens(alpha, depth) tokens for k
    draft steps (c each) and one verify pass (v), in baseline decode steps; `depth`, the
    longest path a step can accept, is k for a chain (the default) and a tree's depth for its
    k candidates. With `verify_fraction` < 1 (n-gram finds nothing to propose at some steps)
    the other rows emit one token each. `step_fraction` is the share of steps that verified
    (default `verify_fraction`, as at batch 1); the others are plain decode steps, cost 1. At
    batch > 1 a row with nothing to propose rides in its batch's verify step, so steps verify
    more often than rows do: tokens per row-step over cost per step, the rows per step being
    the baseline's. `plain_cost`: a plain step's cost in baseline steps (above 1 when the
    proposer runs in it and drafts nothing: a confidence stop still pays its first draft)."""
    f = verify_fraction
    fs = f if step_fraction is None else step_fraction
    tokens = f * expected_tokens(alpha, k if depth is None else depth) + (1 - f)
    cost = fs * (k * c + v) + (1 - fs) * plain_cost
    return tokens / cost if cost > 0 else float("nan")


def alpha_mle(accepted_counts: Sequence[int], proposed_counts: Sequence[int],
              depth: int | None = None, reach_counts: Sequence[int] | None = None) -> float:
    """Per-position acceptance (the cost model's alpha): accepted drafts over the drafts the
    verifier judged, i.e. accepted ones plus the first rejection of each step that had one. A
    step can accept at most its reach: `reach_counts` when given (per step, the depth of the
    tree prefix it verified: see `prefix_depths`), else min(proposed, depth) (a tree's depth,
    below its candidates); one that accepted that many had no rejection."""
    if reach_counts is None:
        reach_counts = [p if depth is None else min(p, depth) for p in proposed_counts]
    judged = sum(a + (a < r) for a, p, r in zip(accepted_counts, proposed_counts, reach_counts)
                 if p > 0)
    return sum(accepted_counts) / judged if judged else float("nan")


def prefix_depths(parents: Any, counts: Sequence[int]) -> list[int]:
    """Per row, the depth of the tree prefix it verifies, the most drafts it can accept: the
    deepest of nodes 1..count of parents [rows, N] (-1 at the root; drafting order puts parents
    first, so a prefix is a tree). A prefix cut by the row's limit or by the confidence stop
    can be shallower than its tree."""
    import numpy as np

    parents = np.asarray(parents)
    depth = np.zeros(parents.shape, np.int64)
    rows = np.arange(parents.shape[0])
    for j in range(1, parents.shape[1]):
        depth[:, j] = depth[rows, parents[:, j]] + 1
    return [int(depth[r, 1:c + 1].max()) if c > 0 else 0 for r, c in enumerate(counts)]


# -- engine measurements ---------------------------------------------------------------------

class ProposerProbe:
    """Times a live engine's proposer and counts its drafts, by wrapping the instance's
    `propose` and `commit` (nothing in the engine changes). Per propose call: start, end and
    the row counts; per commit: the emitted lengths, so accepted = len - 1 for rows with
    drafts in the step that proposed them. Per tree proposal with drafts, its parents, which
    `summary` reads back to find how deep each row's verified prefix reaches."""

    def __init__(self, proposer: Any) -> None:
        self.proposer = proposer
        self.calls: list[tuple[float, float, list[int]]] = []
        self.emitted: list[list[int]] = []
        self.trees: list[Any] = []  # parents [rows, N] of each verifying tree proposal
        self._pending: list[int] | None = None
        propose, commit = proposer.propose, proposer.commit

        def timed_propose(seqs, limits, rows, k, *args, **kwargs):
            start = time.perf_counter()
            out = propose(seqs, limits, rows, k, *args, **kwargs)
            if out[2] is not None:
                out[2].block_until_ready()
            counts = [int(c) for c in out[1][:len(seqs)]]
            self.calls.append((start, time.perf_counter(), counts))
            self._pending = counts if any(counts) else None
            return out

        def counting_commit(seqs, emitted, *args, **kwargs):
            # A commit after a plain decode step (nothing proposed) has nothing to count.
            if self._pending is not None:
                self.emitted.append([len(e) for e in emitted])
                self._pending = None
            return commit(seqs, emitted, *args, **kwargs)

        proposer.propose, proposer.commit = timed_propose, counting_commit
        if getattr(getattr(proposer, "config", None), "tree", None) is not None:
            propose_tree = proposer.propose_tree

            def timed_propose_tree(seqs, limits, rows):
                start = time.perf_counter()
                out = propose_tree(seqs, limits, rows)
                out[0].block_until_ready()
                counts = [int(c) for c in out[2][:len(seqs)]]
                self.calls.append((start, time.perf_counter(), counts))
                self._pending = counts if any(counts) else None
                if self._pending is not None:
                    # Kept on the device: read back by `summary`, outside the timed steps.
                    self.trees.append(out[1])
                return out

            proposer.propose_tree = timed_propose_tree

    def reset(self) -> None:
        self.calls, self.emitted, self.trees, self._pending = [], [], [], None

    def drafting_calls(self) -> list[tuple[float, float, list[int]]]:
        """The calls since reset that drafted for some row: one per verify step, inside it."""
        return [call for call in self.calls if any(call[2])]

    def summary(self) -> dict[str, Any]:
        """Counts over the verify steps since reset: rows with drafts, drafts proposed and
        accepted, and per row the (accepted, proposed) pairs."""
        drafting = self.drafting_calls()
        verifying = [c for _, _, c in drafting]
        # The most a row can accept: its drafts in a chain, its prefix's depth in a tree (a
        # prefix cut short is shallower than the tree; counted at the tree's depth, a step that
        # accepted all of it would read as a rejection).
        reaches = ([prefix_depths(parents, counts)
                    for parents, counts in zip(self.trees, verifying)] if self.trees
                   else verifying)
        accepted, proposed, reached = [], [], []
        for counts, lens, reach in zip(verifying, self.emitted, reaches):
            for p, n, r in zip(counts, lens, reach):
                if p > 0:
                    proposed.append(p)
                    accepted.append(n - 1)
                    reached.append(r)
        return {"verify_steps": len(self.emitted), "verify_rows": len(proposed),
                "proposed": sum(proposed), "accepted": sum(accepted),
                "accepted_counts": accepted, "proposed_counts": proposed,
                "reach_counts": reached,
                "propose_s": sum(e - s for s, e, _ in self.calls),
                "propose_calls": len(self.calls),
                "drafting_propose_s": sum(e - s for s, e, _ in drafting),
                "drafting_calls": len(drafting)}


def verify_records(records: Sequence[Any], probe: ProposerProbe) -> list[Any]:
    """The step records during which the probed proposer proposed drafts: the verify steps."""
    starts = [s for s, _, _ in probe.drafting_calls()]
    return [r for r in records if any(r.start_s <= s <= r.end_s for s in starts)]


def decode_time(records: Sequence[Any], probe: ProposerProbe | None = None
                ) -> dict[str, float]:
    """Time and row-steps of the decode steps among `records`; with a probe, also the mean
    duration of the steps that verified drafts and of those that did not."""
    decode = [r for r in records if r.kind == "decode"]
    out = {"decode_s": sum(r.end_s - r.start_s for r in decode), "decode_steps": len(decode),
           "decode_row_steps": sum(r.decode_rows for r in decode)}
    out["decode_step_s"] = out["decode_s"] / len(decode) if decode else float("nan")
    if probe is not None:
        verify = verify_records(decode, probe)
        out["verify_step_s"] = (sum(r.end_s - r.start_s for r in verify) / len(verify)
                                if verify else float("nan"))
    return out


def run_workload(llm, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int,
                 probe: ProposerProbe | None) -> dict[str, Any]:
    """One timed pass of the prompts through the engine; the row's measurements."""
    from infer.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    first_step = llm.engine.num_steps
    if probe is not None:
        probe.reset()
    before = _engine_stats(llm)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    records = llm.engine.step_records(first_step)
    row: dict[str, Any] = decode_time(records, probe)
    tokens = [o.token_ids for o in outputs]
    row["output_tokens"] = sum(map(len, tokens))
    row["decode_tokens"] = sum(max(len(t) - 1, 0) for t in tokens)  # first ones: prefill's
    row["decode_tok_s"] = (row["decode_tokens"] / row["decode_s"] if row["decode_s"]
                           else float("nan"))
    row["tokens_per_decode_step"] = (row["decode_tokens"] / row["decode_row_steps"]
                                     if row["decode_row_steps"] else float("nan"))
    row["tpot_s_mean"] = _mean([o.metrics.tpot_s for o in outputs])
    row["ttft_s_mean"] = _mean([o.metrics.ttft_s for o in outputs])
    row["token_ids"] = [[int(t) for t in ids] for ids in tokens]  # as JSON reads them back
    if probe is not None:
        row["probe"] = probe.summary()
        after = _engine_stats(llm)
        if after:  # the engine's own counters (newer engines), for a cross-check
            row["engine_stats"] = {k: after[k] - before.get(k, 0) for k in
                                   ("verify_steps", "rows", "proposed", "accepted") if k in after}
    return row


def _engine_stats(llm) -> dict[str, float]:
    stats = getattr(llm.engine, "speculative_stats", None)
    return dict(stats()) if stats is not None else {}


def _mean(values: Sequence[float | None]) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def missing_weights(method: str, eagle_path: str = "") -> str | None:
    """The weights file a method needs and lacks (None when it has what it needs);
    `eagle_path` in place of the default head's."""
    from infer.spec.config import SpeculativeConfig

    field = WEIGHT_PATHS.get(method)
    if field is None:
        return None
    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    if field not in fields:
        return f"(this engine's SpeculativeConfig has no {field})"
    path = eagle_path if method == "eagle" and eagle_path else fields[field].default
    return None if os.path.isfile(path) else path


def spec_row(base: dict[str, Any], spec: dict[str, Any], k: int, depth: int | None = None
             ) -> dict[str, Any]:
    """The measured and predicted columns of one speculative run against its baseline; `depth`:
    a tree's (its k candidates are verified, at most `depth` of them accepted)."""
    probe = spec.pop("probe")
    proposed, accepted = probe["proposed"], probe["accepted"]
    rows = probe["verify_rows"]
    alpha = accepted / proposed if proposed else float("nan")
    reaches = probe.get("reach_counts")
    mle = alpha_mle(probe["accepted_counts"], probe["proposed_counts"], depth, reaches)
    k_mean = proposed / rows if rows else float(k)
    # The longest path a step can accept, on average: the drafts of a chain, the depth of the
    # prefix of its tree a row verified (the tree's depth unless its limit or confidence cut it).
    if reaches:
        reach = sum(reaches) / len(reaches)
    else:
        reach = k_mean if depth is None else min(k_mean, depth)
    base_step = base["decode_step_s"]
    # A verify step holds the call that drafted for it: c and v split that step's time between
    # the two. Calls that drafted nothing (n-gram found no match, a confidence stop) ran in
    # plain steps; their time, in an average here, lowered c and raised v ...
    propose = probe["drafting_propose_s"] / probe["drafting_calls"] if rows else float("nan")
    c = propose / k_mean / base_step
    v = (spec["verify_step_s"] - propose) / base_step
    # ... and a plain step pays for them: 1 + their time per plain step, in baseline steps.
    plain_steps = spec["decode_steps"] - probe["verify_steps"]
    plain = 1.0 + ((probe["propose_s"] - probe["drafting_propose_s"]) / plain_steps / base_step
                   if plain_steps > 0 else 0.0)
    # Row-steps that verified, among all decode row-steps (n-gram may find nothing to offer),
    # and steps that verified, among all decode steps: a step verifies when any of its rows
    # has drafts, and the rows without ride in it at its cost.
    f = rows / spec["decode_row_steps"] if spec["decode_row_steps"] else float("nan")
    fs = (probe["verify_steps"] / spec["decode_steps"] if spec["decode_steps"]
          else float("nan"))
    row = {**spec, "k": k, "verify_steps": probe["verify_steps"], "verify_rows": rows,
           "proposed": proposed, "accepted": accepted, "acceptance_rate": alpha,
           "alpha_mle": mle, "drafts_per_verify": k_mean, "reach_per_verify": reach,
           "verify_fraction": f, "verify_step_fraction": fs,
           "mean_accepted_per_verify": accepted / rows if rows else float("nan"),
           "tokens_per_verify": (accepted + rows) / rows if rows else float("nan"),
           "baseline_decode_tok_s": base["decode_tok_s"],
           "speedup": spec["decode_tok_s"] / base["decode_tok_s"],
           "draft_cost_ratio": c, "verify_cost_ratio": v, "plain_step_cost": plain,
           "pred_tokens_per_verify": expected_tokens(alpha, reach) if proposed else float("nan"),
           "pred_tokens_per_verify_mle": expected_tokens(mle, reach) if proposed else float("nan"),
           "pred_speedup": (predicted_speedup(alpha, k_mean, c, v, f, reach, fs, plain)
                            if proposed else float("nan")),
           "pred_speedup_mle": (predicted_speedup(mle, k_mean, c, v, f, reach, fs, plain)
                                if proposed else float("nan")),
           "pred_speedup_v1": (predicted_speedup(alpha, k_mean, c, 1.0, f, reach, fs, plain)
                               if proposed else float("nan"))}
    return row


def run_engine(*, methods: list[str], ks: list[int], temperatures: list[float],
               batch_sizes: list[int], num_prompts: int, max_tokens: int, snippet_chars: int,
               warmup: str, seed: int, loaded, log,
               prompts: dict[str, list[list[int]]] | None = None, draft_vocab_size: int = 0,
               prompt_kind: str = "", draft_confidence: float = 0.0, eagle_path: str = "",
               engine_trees: Sequence[str] = ()) -> None:
    """Baselines per batch size, prompt kind and temperature, then every runnable method x k
    against them, each row written to `log` as it is measured. `prompts` (kind -> token ids)
    replaces the held-out SmolLM2 prompts; `eagle_path` the EAGLE head."""
    import functools

    from tqdm import tqdm

    from infer.llm import LLM
    from infer.platform import CompileCounter
    from infer.spec.config import DRAFT_VOCAB_METHODS

    config, model, tokenizer = loaded
    runnable = []
    for m in methods:
        missing = missing_weights(m, eagle_path)
        if missing:
            print(f"[speculation] skipping method {m!r}: weights file {missing} is missing")
        else:
            runnable.append(m)
    kinds = sorted({prompt_kind_of(m, prompt_kind) for m in runnable})
    count = max(num_prompts, max(batch_sizes))
    if prompts is None:
        prompts = {kind: build_prompts(tokenizer, kind, count, snippet_chars) for kind in kinds}
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)
    # Room for the longest prompt, its tokens and a full verify step, in few window buckets.
    from infer.spec.tree_draft import TreeShape
    trees = [TreeShape.parse(text) for text in engine_trees] if "eagle" in runnable else []
    reach = max([max(ks)] + [tree.reserved_slots for tree in trees])
    max_model_len = 128 * -(-(longest + max_tokens + reach + 2) // 128)
    engine_args = dict(max_model_len=max_model_len, max_prefill_tokens=256)

    def timed(llm, kind: str, batch: int, temperature: float,
              probe: ProposerProbe | None) -> dict:
        """A pass over max(num_prompts, batch) prompts, repeated while the pass built a new
        program (compiled or loaded from the persistent cache): the timed pass is the first
        that built none. With warmup=pass the repeats are the warm-up: they cost a pass but
        build only the shapes the workload uses."""
        work = prompts[kind][:max(num_prompts, batch)]
        clear = getattr(llm.engine.runner.proposer, "clear", None)  # suffix decoding's corpus
        for attempt in range(3):
            if clear is not None:
                clear()
            with CompileCounter() as built:
                row = run_workload(llm, work, temperature, max_tokens, seed, probe)
            if built.count == 0:
                break
        row["untimed_passes"], row["programs_built_while_timed"] = attempt, built.count
        return row

    total = len(batch_sizes) * (len(kinds) * len(temperatures)
                                + (len(runnable) * len(ks) + len(trees)) * len(temperatures))
    bar = tqdm(total=total, desc="engine runs")
    # Float32 rows carry no dtype, so that rows measured before the flag keep their keys.
    weights = str(model.embed[...].dtype)
    common = {"experiment": "speculation", "part": "engine", "max_tokens": max_tokens,
              **({} if weights == "float32" else {"dtype": weights}),
              "snippet_chars": snippet_chars, "warmup": warmup, "seed": seed}

    def engine(batch: int, speculative: dict | None):
        llm = LLM.from_loaded(config, model, tokenizer, max_num_seqs=batch,
                              speculative=speculative, **engine_args)
        if warmup == "engine":
            llm.engine.warmup()
        return llm

    for batch in batch_sizes:
        base_llm = functools.cache(lambda batch=batch: engine(batch, None))  # made when needed
        baselines = {}
        for kind in kinds:
            for t in temperatures:
                # A baseline row keeps its token ids: a resumed speculative point compares
                # its own output against them.
                baselines[kind, t] = log.measure(
                    {**common, "method": "none", "k": 0, "temperature": t, "batch": batch,
                     "prompts": kind, "num_prompts": max(num_prompts, batch)},
                    lambda kind=kind, t=t: {"speedup": 1.0,
                                            **timed(base_llm(), kind, batch, t, None)})
                bar.update(1)
        base_llm.cache_clear()  # its KV cache goes before the speculative engines
        for method in runnable:
            kind = prompt_kind_of(method, prompt_kind)
            # In the point only when set: the keys of rows without them stay as they were.
            extras = {}
            if method in DRAFT_VOCAB_METHODS:
                extras = {name: value for name, value in (("draft_vocab_size", draft_vocab_size),
                                                         ("draft_confidence", draft_confidence))
                         if value}
            if method == "eagle" and eagle_path:
                extras["eagle_path"] = eagle_path
            # Chains of k drafts, then (EAGLE) each tree; a tree's row names its shape, and its
            # k is the candidates it verifies at most.
            variants = [(k, {"num_tokens": k}) for k in ks]
            if method == "eagle":
                variants += [(tree.num_nodes - 1, {"tree": str(tree)}) for tree in trees]
            for k, variant in variants:
                @functools.cache
                def spec_llm(method=method, batch=batch, extras=extras, variant=variant):
                    llm = engine(batch, {"method": method, **variant, **extras})
                    return llm, ProposerProbe(llm.engine.runner.proposer)

                depth = TreeShape.parse(variant["tree"]).depth if "tree" in variant else None

                def measure(t: float, kind=kind, k=k, batch=batch, extras=extras,
                            depth=depth) -> dict:
                    llm, probe = spec_llm()
                    base = baselines[kind, t]
                    spec = timed(llm, kind, batch, t, probe)
                    same = (sum(a == b for a, b in zip(spec["token_ids"], base["token_ids"]))
                            / len(base["token_ids"])) if t == 0 else None
                    row = {**spec_row(base, spec, k, depth), "greedy_identical": same,
                           "draft_vocab_size": extras.get("draft_vocab_size", 0),
                           "draft_confidence": extras.get("draft_confidence", 0.0)}
                    row.pop("token_ids")
                    return row

                tree_key = {"tree": variant["tree"]} if "tree" in variant else {}
                for t in temperatures:
                    log.measure({**common, **extras, **tree_key, "method": method, "k": k,
                                 "temperature": t, "batch": batch, "prompts": kind,
                                 "num_prompts": max(num_prompts, batch)},
                                lambda t=t, measure=measure: measure(t))
                    bar.update(1)
                spec_llm.cache_clear()
    bar.close()


# -- tree part -------------------------------------------------------------------------------

def time_tree_pieces(spec, prompt: list[int], temperature: float, repeats: int = 9
                     ) -> dict[str, float]:
    """Median seconds of one draft (head catch-up + tree expansion) and of one verify (target
    pass over the tree, the rule of `temperature`, compaction), each timed alone on a fresh
    state after `prompt`."""
    import dataclasses as dc

    import jax
    import numpy as np

    from infer.sampling_params import SamplingParams

    draft_s, verify_s = [], []
    for _ in range(repeats + 1):  # the first round compiles
        state = spec.prefill(prompt, SamplingParams(temperature=temperature, seed=0))
        jax.block_until_ready(state)
        start = time.perf_counter()
        tokens, parents, head_cache = spec.draft(state)
        jax.block_until_ready(tokens)
        draft_s.append(time.perf_counter() - start)
        state = dc.replace(state, head_cache=head_cache)
        start = time.perf_counter()
        jax.block_until_ready(spec.verify(state, tokens, parents))
        verify_s.append(time.perf_counter() - start)
    return {"draft_s": float(np.median(draft_s[1:])), "verify_s": float(np.median(verify_s[1:]))}


def run_tree(*, branches: int, depth: int, temperatures: list[float], num_prompts: int,
             max_tokens: int, snippet_chars: int, random_head: bool, seed: int, loaded, log,
             prompts: list[list[int]] | None = None, eagle_path: str = "",
             dynamic_trees: Sequence[str] = (), draft_vocab_size: int = 0) -> None:
    """Plain decoding, the EAGLE tree, the chain of its depth and the `dynamic_trees`, per
    temperature, on chat prompts (or `prompts`), with the head at `eagle_path` (default: the
    engine's), drafting from the `draft_vocab_size` most frequent ids when > 0; each row written
    to `log` as it is measured."""
    import functools

    import jax.numpy as jnp
    from flax import nnx
    from tqdm import tqdm

    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import generate
    from infer.platform import CompileCounter
    from infer.sampling_params import SamplingParams
    from infer.spec.config import DRAFT_VOCAB_PATH, SpeculativeConfig
    from infer.spec.eagle_head import EagleHead, load_eagle
    from infer.spec.draft_vocab import load_draft_vocab
    from infer.spec.tree import TreeSpeculator, tree_generate
    from infer.spec.tree_draft import TreeShape

    config, model, tokenizer = loaded
    path = eagle_path or next((f.default for f in dataclasses.fields(SpeculativeConfig)
                               if f.name == "eagle_path"),
                              os.path.join("weights", "eagle_smollm2.safetensors"))
    if os.path.isfile(path):
        head, head_kind = load_eagle(config, path), "trained"
    elif random_head:
        head, head_kind = EagleHead(config, jnp.float32, nnx.Rngs(seed)), "random"
    else:
        print(f"[speculation] skipping the tree part: EAGLE weights {path} are missing "
              f"(--random_head runs it with an untrained head)")
        return
    if prompts is None:
        prompts = build_prompts(tokenizer, "chat", num_prompts, snippet_chars)
    prompts = prompts[:num_prompts]
    shapes = ([TreeShape(branches, depth), TreeShape(1, depth)]
              + [TreeShape.parse(text) for text in dynamic_trees])
    # A step writes its nodes, or the head's rows where a wide dynamic tree has more.
    slots = max(max(shape.num_nodes, shape.head_rows) for shape in shapes)
    max_len = 128 * -(-(max(map(len, prompts)) + max_tokens + slots + 2) // 128)
    # Built when a point needs them; each holds its compiled programs for the whole sweep.
    # The baseline and the speculators run the target on one DeviceSteps: bound once.
    plain = functools.cache(lambda: DeviceSteps(model, feature_layers=head.feature_layers))
    vocab = (load_draft_vocab(DRAFT_VOCAB_PATH, draft_vocab_size,
                              config.vocab_size) if draft_vocab_size else None)
    specs = functools.cache(lambda s: TreeSpeculator(plain(), head, s.branches, s.depth, max_len,
                                                     s.budget, s.width, vocab))
    eos = tokenizer.eos_ids if tokenizer is not None else ()
    bar = tqdm(total=len(temperatures) * (len(shapes) + 1), desc="tree runs")

    def run_all(fn) -> tuple[list[list[int]], dict[str, float]]:
        """fn(prompt, seed) over every prompt, after an untimed pass over every prompt: the
        plain loop's programs follow each prompt's length (its bucket and cache windows), so
        warming on one prompt left the others' compiles inside the baseline's timed decode.
        Returns the outputs and the sums of the count and time stats, with the programs built
        while timed (0 expected)."""
        for i, p in enumerate(prompts):
            fn(p, seed + i)
        outs, totals = [], {}
        with CompileCounter() as built:
            for i, p in enumerate(prompts):
                ids, stats = fn(p, seed + i)
                outs.append([int(x) for x in ids])
                for key in ("decode_s", "verify_steps", "accepted", "full_steps"):
                    totals[key] = totals.get(key, 0) + stats.get(key, 0)
        totals["programs_built_while_timed"] = built.count
        return outs, totals

    def measure_plain(t: float) -> dict:
        base_out, base = run_all(lambda p, s: generate(
            plain(), p, max_tokens, SamplingParams(temperature=t, seed=s), eos_ids=eos))
        base_tokens = sum(len(o) - 1 for o in base_out)
        # The token ids stay in the row: a resumed tree point compares its output against them.
        return {"decode_tokens": base_tokens, "decode_tok_s": base_tokens / base["decode_s"],
                "decode_step_s": base["decode_s"] / base_tokens, "speedup": 1.0,
                "programs_built_while_timed": base["programs_built_while_timed"],
                "token_ids": base_out}

    def measure_tree(shape: TreeShape, t: float, base: dict) -> dict:
        spec, d = specs(shape), shape.depth
        base_tok_s, step_s = base["decode_tok_s"], base["decode_step_s"]
        outs, tot = run_all(lambda p, s: tree_generate(
            spec, p, max_tokens, SamplingParams(temperature=t, seed=s), eos_ids=eos))
        pieces = time_tree_pieces(spec, prompts[0], t)
        tokens = sum(len(o) - 1 for o in outs)
        steps, accepted = tot["verify_steps"], tot["accepted"]
        # Levels the verifier judged: accepted ones plus a rejection, except in steps that
        # accepted the whole depth. The acceptance rate counts `depth` proposed per step.
        judged = accepted + steps - tot["full_steps"]
        alpha = accepted / (steps * d) if steps else float("nan")
        mle = accepted / judged if judged else float("nan")
        c = pieces["draft_s"] / d / step_s
        v = pieces["verify_s"] / step_s
        tok_s = tokens / tot["decode_s"]
        return {"nodes": spec.num_nodes, "decode_tokens": tokens, "decode_tok_s": tok_s,
                "programs_built_while_timed": tot["programs_built_while_timed"],
                "verify_steps": steps, "accepted": accepted, "acceptance_rate": alpha,
                "alpha_mle": mle,
                "mean_accepted_per_verify": accepted / steps if steps else float("nan"),
                "tokens_per_verify": (accepted + steps) / steps if steps else float("nan"),
                "baseline_decode_tok_s": base_tok_s, "speedup": tok_s / base_tok_s,
                "draft_step_s": pieces["draft_s"], "verify_step_s": pieces["verify_s"],
                "draft_cost_ratio": c, "verify_cost_ratio": v,
                "pred_tokens_per_verify": expected_tokens(alpha, d),
                "pred_tokens_per_verify_mle": expected_tokens(mle, d),
                "pred_speedup": predicted_speedup(alpha, d, c, v),
                "pred_speedup_mle": predicted_speedup(mle, d, c, v),
                "pred_speedup_v1": predicted_speedup(alpha, d, c, 1.0),
                "greedy_identical": (sum(a == b_ for a, b_ in zip(outs, base["token_ids"]))
                                     / len(outs)) if t == 0 else None}

    common = {"experiment": "speculation", "part": "tree", "head": head_kind, "batch": 1,
              "num_prompts": num_prompts, "max_tokens": max_tokens,
              "snippet_chars": snippet_chars, "seed": seed,
              **({"eagle_path": eagle_path} if eagle_path else {})}
    # The baselines' rows never name it: the tree rows of every vocabulary share them.
    vocab_key = {"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}
    for t in temperatures:
        base = log.measure({**common, "method": "none", "tree": "none", "temperature": t},
                           lambda t=t: measure_plain(t))
        bar.update(1)
        for shape in shapes:
            # A dynamic tree's row names its budget; the fixed trees' rows keep their old keys.
            budget = {} if shape.budget is None else {"budget": shape.budget,
                                                      "width": shape.expand_width}
            log.measure({**common, "method": "eagle_tree", "tree": str(shape),
                         "branches": shape.branches, "depth": shape.depth, **budget, **vocab_key,
                         "k": shape.depth, "temperature": t},
                        lambda shape=shape, t=t, base=base: measure_tree(shape, t, base))
            bar.update(1)
    bar.close()


# -- output ----------------------------------------------------------------------------------

COLUMNS = [("method", "method"), ("prompts", "prompts"), ("k", "k"),
           ("draft_confidence", "stop"), ("temperature", "T"),
           ("batch", "B"),
           ("decode_tok_s", "tok/s"), ("baseline_decode_tok_s", "base tok/s"),
           ("speedup", "speedup"), ("acceptance_rate", "accept"), ("alpha_mle", "alpha mle"),
           ("tokens_per_verify", "tok/verify"), ("pred_tokens_per_verify_mle", "pred tok/verify"),
           ("draft_cost_ratio", "c"), ("verify_cost_ratio", "v"),
           ("pred_speedup", "pred speedup"), ("pred_speedup_mle", "pred (mle)"),
           ("greedy_identical", "greedy same")]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib
    import numpy as np

    from experiments.common import new_figure, save_figure

    engine = [r for r in rows if r["part"] == "engine" and r["method"] != "none"]
    tree = [r for r in rows if r["part"] == "tree" and r["method"] != "none"]
    batches = sorted({r["batch"] for r in engine}) or [1]
    fig, axes = new_figure(len(batches) + 1, figsize=(5.5 * (len(batches) + 1), 4.5))
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = sorted({r["method"] for r in engine})
    color = {m: colors[i % len(colors)] for i, m in enumerate(methods + ["eagle_tree"])}
    styles = {}
    all_ks = sorted({r["k"] for r in engine + tree})
    for ax, batch in zip(axes, batches):
        for m in methods:
            for j, t in enumerate(sorted({r["temperature"] for r in engine})):
                pts = sorted((r for r in engine if r["method"] == m and r["batch"] == batch
                              and r["temperature"] == t), key=lambda r: r["k"])
                if not pts:
                    continue
                ks = [r["k"] for r in pts]
                styles[t] = ["-", ":", "-."][j % 3]
                ax.plot(ks, [r["speedup"] for r in pts], styles[t], marker="o", color=color[m],
                        label=f"{m} T={t:g}")
                ax.plot(ks, [r["pred_speedup_mle"] for r in pts], styles[t], marker="x",
                        color=color[m], alpha=0.35)
        if batch == 1:
            for r in tree:
                ax.scatter([r["k"]], [r["speedup"]], marker="*" if r["branches"] > 1 else "s",
                           s=90, color=color["eagle_tree"],
                           label=f"eagle_generate {r['tree']} T={r['temperature']:g}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.set_xlabel("drafts per step k")
        ax.set_ylabel("decode speedup over no speculation")
        ax.set_title(f"batch {batch}: measured (o), cost model (x, faint)")
        ax.legend(fontsize=7)
    ax = axes[-1]
    grid = np.linspace(1, max(all_ks or [1]), 50)
    for m in methods:
        pts = sorted((r for r in engine if r["method"] == m and r["temperature"] == 0
                      and r["batch"] == batches[0]), key=lambda r: r["k"])
        if not pts:
            continue
        ax.plot([r["k"] for r in pts], [r["tokens_per_verify"] for r in pts], "o-",
                color=color[m], label=f"{m} (T=0, B={batches[0]})")
        alphas = [r["alpha_mle"] for r in pts if r["alpha_mle"] == r["alpha_mle"]]
        if alphas:
            a = float(np.mean(alphas))
            ax.plot(grid, [expected_tokens(a, k) for k in grid], "--", color=color[m],
                    alpha=0.6, label=f"cost model (1-a^(k+1))/(1-a), a={a:.2f} (mean mle)")
    for r in tree:
        if r["temperature"] == 0:
            ax.scatter([r["k"]], [r["tokens_per_verify"]], s=90, color=color["eagle_tree"],
                       marker="*" if r["branches"] > 1 else "s",
                       label=f"eagle_generate {r['tree']}")
    ax.set_xlabel("drafts per step k (tree: depth)")
    ax.set_ylabel("tokens emitted per verify step")
    ax.set_title("accepted + 1 per verify step vs the cost model")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def run(*, parts: list[str], methods: list[str], ks: list[int], temperatures: list[float],
        batch_sizes: list[int], num_prompts: int, max_tokens: int, snippet_chars: int,
        warmup: str, tree_branches: int, tree_depth: int, tree_prompts: int, random_head: bool,
        seed: int, out: str, dynamic_trees: Sequence[str] = (), loaded=None, prompts: dict[str, list[list[int]]] | None = None,
        eagle_path: str = "", resume: bool = False, tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, draft_vocab_size: int = 0, prompt_kind: str = "",
        draft_confidence: float = 0.0, engine_trees: Sequence[str] = (),
        dtype: str = "float32") -> list[dict[str, Any]]:
    """Runs the parts; returns this run's rows as `out` holds them (each appended the moment
    it is measured; with `resume`, points already there are not measured again). `loaded` is
    (config, model, tokenizer), SmolLM2 in `dtype` when None; `prompts` ({"grounded": ...,
    "chat": ...} token ids) and `eagle_path` replace the defaults (tests run a tiny model
    this way)."""
    from experiments.common import ResultLog, markdown_table, one_engine, plot_path
    from infer.io.loader import load

    if tensor_parallel_size != 1:
        raise ValueError(f"speculation: tensor_parallel_size={tensor_parallel_size}, but "
                         f"speculative decoding runs on one device (its proposers are not "
                         f"placed on a mesh)")
    # Before the model loads: these failed only once the engine part's baselines (or the whole
    # engine part) were measured, or left the trees out without a word.
    if "engine" in parts and engine_trees and "eagle" not in methods:
        raise ValueError(f"--engine_trees={','.join(engine_trees)} are method eagle's: add eagle "
                         f"to --methods={','.join(methods)}")
    if prompts is None:
        if "engine" in parts:
            count = max(num_prompts, max(batch_sizes))
            runnable = [m for m in methods if missing_weights(m, eagle_path) is None]
            for kind in sorted({prompt_kind_of(m, prompt_kind) for m in runnable}):
                check_prompt_count(kind, count, snippet_chars,
                                   "num_prompts" if count == num_prompts else "batch_sizes")
        if "tree" in parts:
            check_prompt_count("chat", tree_prompts, snippet_chars, "tree_prompts")
    one_engine("speculation", data_parallel_size=data_parallel_size)
    loaded = loaded or load("smollm2-135m", dtype)
    log = ResultLog(out, resume=resume)
    if "engine" in parts:
        run_engine(methods=methods, ks=ks, temperatures=temperatures, batch_sizes=batch_sizes,
                   num_prompts=num_prompts, max_tokens=max_tokens, snippet_chars=snippet_chars,
                   warmup=warmup, seed=seed, loaded=loaded, log=log, prompts=prompts,
                   draft_vocab_size=draft_vocab_size, prompt_kind=prompt_kind,
                   draft_confidence=draft_confidence, eagle_path=eagle_path or "",
                   engine_trees=engine_trees)
    if "tree" in parts:
        run_tree(branches=tree_branches, depth=tree_depth, temperatures=temperatures,
                 num_prompts=tree_prompts, max_tokens=max_tokens, snippet_chars=snippet_chars,
                 random_head=random_head, seed=seed, loaded=loaded, log=log,
                 prompts=(prompts or {}).get("chat"), eagle_path=eagle_path,
                 dynamic_trees=dynamic_trees, draft_vocab_size=draft_vocab_size)
    rows = log.rows()
    engine_rows = [r for r in rows if r["part"] == "engine"]
    if engine_rows:
        print("\nEngine speculation (chains; EAGLE trees where the tree column names one); "
              "baselines are method none:")
        print(markdown_table(engine_rows, [("tree", "tree")] + COLUMNS))
    tree_rows = [r for r in rows if r["part"] == "tree"]
    if tree_rows:
        print("\neagle_generate at batch 1 (tree vs chain of the same depth, dynamic trees "
              "B x D / budget):")
        print(markdown_table(tree_rows, [("tree", "tree"), ("head", "head")] + COLUMNS[2:]))
    if rows:
        plot(rows, plot_path(out))
    return rows


def quick_args(f) -> dict[str, Any]:
    """--quick: the smoke run's settings in place of the flags'."""
    return dict(ks=[1, 2], temperatures=[0.0], batch_sizes=[1, 2], num_prompts=2, max_tokens=16,
                snippet_chars=200, tree_prompts=1, random_head=True) if f.quick else {}


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True, args=quick_args)
