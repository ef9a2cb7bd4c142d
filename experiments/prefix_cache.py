"""Prefix caching: how often the radix-tree prefix cache hits, and what it buys.

  python -m experiments.prefix_cache --parts=alone --alone_max_pages=500

Part 1, `alone` (no model, the lesson's exercise): 1,000 requests, 60% of which start with one of
5 common prefixes (a system prompt, few-shot examples) and the rest share nothing, run through
the real PageAllocator and PrefixCache: each request matches its prompt, takes the matched pages,
"prefills" the rest (allocates pages for it), inserts its full pages and releases its sequence,
leaving the pages to the cache. A cache capped at 500 pages under LRU eviction is compared with
an unlimited one; hit rates are by requests (>= 1 page matched) and by prompt tokens.
Prefix lengths are not page multiples, so a hit reuses the prefix rounded down to whole pages.

Parts 2 and 3 (`system`, `chat`) serve SmolLM2 through the engine with the cache off and on;
--tensor_parallel_size=T runs that engine on a mesh of T devices (--pad_heads as in `LLM`), and
--data_parallel_size is refused: the parts count one engine's prefill steps.
"""

from __future__ import annotations

import os

from typing import Any, Callable

import numpy as np
from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from infer.cache.page_allocator import PageAllocator
from infer.cache.prefix_cache import PrefixCache
from infer.parallel.flags import define_parallel_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("parts", ["alone", "system", "chat"], "parts to run: alone (cache only, no "
                  "model), system (SmolLM2 behind a shared system prompt), chat (multi-turn)",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "parts", choices=["alone", "system", "chat"])
flags.DEFINE_integer("system_requests", 64, "requests behind the shared system prompt",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("system_prompt_tokens", 1000, "length of the shared system prompt",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("system_rate", 1.0, "arrivals per second (Poisson)", flag_values=FLAGS)
flags.register_validator("system_rate", lambda rate: rate > 0,
                         message="--system_rate must be > 0", flag_values=FLAGS)
flags.DEFINE_integer("chat_conversations", 8, "conversations in the multi-turn part",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("chat_turns", 4, "turns per conversation", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 16, "output tokens per request (parts system and chat)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("alone_requests", 1000, "requests in the run", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("alone_shared_fraction", 0.6, "fraction of requests starting with a common "
                   "prefix", lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_integer("alone_prefixes", 5, "number of distinct common prefixes", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_list("alone_prefix_tokens", ["64", "128"], "min,max length of a common prefix (tokens)", flag_values=FLAGS)
validate_list_flag(FLAGS, "alone_prefix_tokens", length=2, lower_bound=1)
# A request may be its prefix alone (a suffix of 0): the prefix keeps every prompt non-empty.
flags.DEFINE_list("alone_suffix_tokens", ["16", "256"], "min,max length of a request's own tokens", flag_values=FLAGS)
validate_list_flag(FLAGS, "alone_suffix_tokens", length=2, lower_bound=0)
for _name in ("alone_prefix_tokens", "alone_suffix_tokens"):
    flags.register_validator(_name, lambda pair: int(pair[0]) <= int(pair[1]),
                             message=f"--{_name} is min,max: min must be <= max",
                             flag_values=FLAGS)
flags.DEFINE_integer("alone_page_size", 16, "tokens per page G", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_list("alone_max_pages", ["500"], "LRU cache caps (pages) swept; an unlimited cache always runs too", flag_values=FLAGS)
validate_list_flag(FLAGS, "alone_max_pages", lower_bound=0, allow_empty=True)
flags.DEFINE_integer("seed", 0, "workload seed", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("out", "results/prefix_cache.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)

VOCAB = 49152  # SmolLM2's: random token ids never collide by accident
MAX_MODEL_LEN = 2048  # of the engines of parts 2 and 3


# -- part 1: the cache alone ----------------------------------------------------------------------

def make_workload(*, num_requests: int, shared_fraction: float, num_prefixes: int,
                  prefix_tokens: tuple[int, int], suffix_tokens: tuple[int, int],
                  seed: int) -> list[tuple[int | None, list[int]]]:
    """(prefix index or None, prompt token ids) per request, in arrival order. Exactly
    round(shared_fraction * num_requests) requests are shared, each with a prefix drawn uniformly;
    a unique request is random tokens of the same length distribution."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(VOCAB, size=rng.integers(prefix_tokens[0], prefix_tokens[1] + 1))
                for _ in range(num_prefixes)]
    shared = np.zeros(num_requests, dtype=bool)
    shared[rng.permutation(num_requests)[:round(shared_fraction * num_requests)]] = True
    requests = []
    for is_shared in shared:
        suffix = rng.integers(VOCAB, size=rng.integers(suffix_tokens[0], suffix_tokens[1] + 1))
        if is_shared:
            k = int(rng.integers(num_prefixes))
            requests.append((k, np.concatenate([prefixes[k], suffix]).tolist()))
        else:
            head = rng.integers(VOCAB, size=rng.integers(prefix_tokens[0], prefix_tokens[1] + 1))
            requests.append((None, np.concatenate([head, suffix]).tolist()))
    return requests


def simulate(prompts: list[list[int]], *, page_size: int, max_pages: int | None) -> dict:
    """Run the prompts one after another through a PageAllocator + PrefixCache; returns the
    cache's stats plus the prompt tokens that had to be computed."""
    longest = max(-(-len(p) // page_size) for p in prompts)
    # Capped: room for the cache plus one request, so the cap (not the pool) decides evictions.
    # Unlimited: room for every page of every request, so nothing is ever evicted.
    num_pages = (max_pages + longest if max_pages is not None
                 else sum(-(-len(p) // page_size) for p in prompts))
    alloc = PageAllocator(num_pages, page_size)
    cache = PrefixCache(alloc, max_pages=max_pages)
    alloc.set_reclaimer(cache.evict)
    computed = peak_used = 0
    for prompt in prompts:
        pages = cache.lookup(prompt)
        alloc.incref(pages)  # ours now: before reserve, whose reclaimer could evict them
        seq = alloc.new_sequence()
        seq.pages, seq.num_tokens = list(pages), len(pages) * page_size
        alloc.reserve(seq, len(prompt))
        # A fully cached prompt still computes its last token (for the logits), in a private
        # copy of the last page: prepare_write does the copy-on-write.
        start = min(seq.num_tokens, len(prompt) - 1)
        alloc.prepare_write(seq, start, len(prompt))
        computed += len(prompt) - start  # "prefill": the device would write these slots
        seq.num_tokens = len(prompt)
        cache.insert(prompt, seq.pages)
        peak_used = max(peak_used, alloc.num_used())
        alloc.release(seq)
    cache.check_invariants()
    alloc.check_invariants()
    return {**cache.stats(), "prefill_tokens": computed, "pool_pages": num_pages,
            "peak_used_pages": peak_used}


def cache_alone_points(*, num_requests: int, shared_fraction: float, num_prefixes: int,
                       prefix_tokens: tuple[int, int], suffix_tokens: tuple[int, int],
                       page_size: int, max_pages: list[int], seed: int
                       ) -> list[tuple[dict, Callable[[], dict]]]:
    """(point, measure) per cache: LRU capped at each of `max_pages`, then unlimited."""
    workload = make_workload(num_requests=num_requests, shared_fraction=shared_fraction,
                             num_prefixes=num_prefixes, prefix_tokens=prefix_tokens,
                             suffix_tokens=suffix_tokens, seed=seed)
    prompts = [p for _, p in workload]
    config = {"experiment": "prefix_cache", "part": "alone", "requests": num_requests,
              "shared_fraction": shared_fraction, "num_prefixes": num_prefixes,
              "prefix_tokens": list(prefix_tokens), "suffix_tokens": list(suffix_tokens),
              "page_size": page_size, "seed": seed,
              "shared_requests": sum(k is not None for k, _ in workload),
              "prompt_tokens": sum(map(len, prompts))}
    return [({**config, "cache": "unlimited" if cap is None else f"lru_{cap}", "max_pages": cap},
             lambda cap=cap: simulate(prompts, page_size=page_size, max_pages=cap))
            for cap in [*max_pages, None]]


def run_cache_alone(**kwargs: Any) -> list[dict]:
    """One row per cache (see cache_alone_points), measured now, written nowhere."""
    return [{**point, **measure()} for point, measure in cache_alone_points(**kwargs)]


# -- parts 2 and 3: the real model through the engine ---------------------------------------------


def _engine(model, tokenizer, mesh, caching: bool, max_model_len: int):
    from infer.engine.engine import Engine, EngineConfig
    return Engine(model, tokenizer, EngineConfig(
        max_num_seqs=8, max_prefill_tokens=256, max_model_len=max_model_len,
        enable_prefix_caching=caching), mesh=mesh)


def system_prompt_workload(tokenizer, *, num_requests: int, system_tokens: int, rate: float,
                           max_tokens: int, seed: int) -> list:
    """Requests that share one long system prompt (real text), each with its own question,
    arriving as a Poisson stream."""
    from experiments.serve import WorkItem
    from experiments.workloads import poisson_arrivals, text_ids

    text = text_ids(tokenizer, 40_000, 200_000)
    system = tokenizer.decode(text[:system_tokens])
    rng = np.random.default_rng(seed)
    questions = [tokenizer.decode(text[o:o + n]) for o, n in
                 zip(rng.integers(system_tokens, len(text) - 64, num_requests),
                     rng.integers(8, 48, num_requests))]
    # The first request opens the run; the others follow a Poisson stream.
    arrivals = np.concatenate([[0.0], poisson_arrivals(rng, num_requests - 1, rate)])
    return [WorkItem(float(a), tuple(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}]))), max_tokens)
        for a, q in zip(arrivals, questions)]


def run_system_prompt(model, tokenizer, mesh, work: list, caching: bool) -> dict:
    """The system-prompt workload served with the prefix cache on or off (the engine on `mesh`,
    or on one device without): one row."""
    from experiments.common import engine_devices
    from experiments.serve import serve_infer
    from infer.engine.metrics import summarize

    engine = _engine(model, tokenizer, mesh, caching, MAX_MODEL_LEN)
    engine.warmup(progress=True)
    metrics, records, _, wall = serve_infer(engine, work, f"system prompt, cache {caching}")
    # What every request's prompt shares: the system prompt inside its chat template (request
    # 0's length less a guess at its question moved with the seed).
    shared = os.path.commonprefix([list(w.prompt_ids) for w in work])
    return {"system_prompt_tokens": len(shared),
            "engine_devices": engine_devices(engine),
            **engine.prefix_cache_stats(), **summarize(metrics, wall, records)}


def run_multi_turn(model, tokenizer, mesh, *, caching: bool, conversations: int, turns: int,
                   max_tokens: int, seed: int) -> dict:
    """Chats where each turn sends the whole conversation so far plus a new question: every
    turn's prompt extends the previous one's, answer included. One row; the questions depend
    only on `seed`, so runs with the cache on and off ask the same."""
    from experiments.common import engine_devices
    from experiments.workloads import text_ids
    from infer.sampling_params import SamplingParams

    text = text_ids(tokenizer, 40_000, 250_000)
    rng = np.random.default_rng(seed)
    engine = _engine(model, tokenizer, mesh, caching, MAX_MODEL_LEN)
    engine.warmup(progress=True)
    chats = [[{"role": "system", "content": "You are a helpful assistant."}]
             for _ in range(conversations)]
    ttft, computed = [], 0
    for turn in range(turns):
        ids = []
        for chat in chats:
            o, n = rng.integers(0, len(text) - 100), rng.integers(20, 80)
            chat.append({"role": "user", "content": tokenizer.decode(text[o:o + n])})
            ids.append(engine.add_request(
                prompt=tokenizer.apply_chat_template(chat),
                params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        first = engine.num_steps
        # The engine forgets a finished request: its output is kept as it finishes.
        done = {out.request_id: out for out in engine.stream() if out.finished}
        computed += sum(r.prefill_tokens for r in engine.step_records(first))
        for chat, i in zip(chats, ids):
            chat.append({"role": "assistant", "content": done[i].text})
            ttft.append(done[i].metrics.ttft_s)
    return {"prefill_tokens_computed": computed,
            "ttft_s_p50": float(np.percentile(ttft, 50)),
            "ttft_s_p99": float(np.percentile(ttft, 99)), "engine_devices": engine_devices(engine),
            **engine.prefix_cache_stats()}


def plot(rows: list[dict], path: str) -> None:
    from experiments.common import new_figure, save_figure

    fig, axes = new_figure(3, figsize=(15, 4.2))
    alone = [r for r in rows if r.get("part", "alone") == "alone"]
    if alone:
        axes[0].bar([r["cache"] for r in alone], [100 * r["request_hit_rate"] for r in alone])
        axes[0].axhline(55, ls="--", c="gray", label="lesson's 55% bar")
        axes[0].set_ylabel("hit rate by requests (%)")
        axes[0].set_title("cache alone: 1,000 requests, 60% share 5 prefixes")
        axes[0].legend()
    for ax, part, title in ((axes[1], "system", "shared ~1,000-token system prompt"),
                            (axes[2], "chat", "multi-turn chat")):
        pts = [r for r in rows if r.get("part") == part]
        if not pts:
            continue
        labels = ["cache off", "cache on"]
        x = range(len(pts))
        ax.bar([i - 0.2 for i in x], [r["ttft_s_p50"] for r in pts], 0.4, label="TTFT p50 (s)")
        ax2 = ax.twinx()
        ax2.bar([i + 0.2 for i in x], [r["prefill_tokens_computed"] / 1000 for r in pts], 0.4,
                color="tab:orange", label="prefill tokens computed (k)")
        ax.set_xticks(list(x), labels[:len(pts)])
        ax.set_ylabel("TTFT p50 (s)")
        ax2.set_ylabel("prefill tokens computed (thousands)")
        ax.set_title(title)
        for axis in (ax, ax2):  # headroom: one legend above both bars
            axis.set_ylim(0, axis.get_ylim()[1] * 1.35)
        (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
        ax2.legend(h1 + h2, l1 + l2, loc="upper right")
    save_figure(fig, path)


def run(*, parts: list[str], alone_requests: int, alone_shared_fraction: float,
        alone_prefixes: int, alone_prefix_tokens: tuple[int, int],
        alone_suffix_tokens: tuple[int, int], alone_page_size: int, alone_max_pages: list[int],
        system_requests: int, system_prompt_tokens: int, system_rate: float,
        chat_conversations: int, chat_turns: int, max_tokens: int, seed: int,
        out: str, resume: bool = False, tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, pad_heads: bool = False) -> list[dict]:
    """The parts' rows, each appended to `out` as it is measured (with `resume`, points already
    there are not measured again); tables and plot from the file."""
    import functools

    from experiments.common import ResultLog, markdown_table, one_engine, plot_path

    unknown = set(parts) - {"alone", "system", "chat"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}")
    # The engine would refuse such requests only once the model is loaded and warmed up (its
    # chat template and the question add tokens beyond these).
    if "system" in parts and system_prompt_tokens + max_tokens > MAX_MODEL_LEN:
        raise ValueError(f"--system_prompt_tokens + --max_tokens must be <= {MAX_MODEL_LEN} "
                         f"(the engine's max_model_len), got {system_prompt_tokens} + "
                         f"{max_tokens}")
    devices = one_engine("prefix_cache", tensor_parallel_size=tensor_parallel_size,
                         data_parallel_size=data_parallel_size, pad_heads=pad_heads)
    log = ResultLog(out, resume=resume)
    rows = []
    if "alone" in parts:
        for point, measure in cache_alone_points(
                num_requests=alone_requests, shared_fraction=alone_shared_fraction,
                num_prefixes=alone_prefixes, prefix_tokens=alone_prefix_tokens,
                suffix_tokens=alone_suffix_tokens, page_size=alone_page_size,
                max_pages=alone_max_pages, seed=seed):
            log.measure(point, measure)
        alone = [r for r in log.rows() if r["part"] == "alone"]
        print(f"\npart 1, cache alone: {alone_requests} requests, "
              f"{alone[0]['shared_requests']} sharing one of {alone_prefixes} prefixes, "
              f"G={alone_page_size}")
        print(markdown_table(alone, [
            ("cache", "cache"), ("request_hit_rate", "hit rate (requests)"),
            ("token_hit_rate", "hit rate (tokens)"), ("hits", "hits"),
            ("hit_tokens", "hit tokens"), ("prefill_tokens", "prefill tokens"),
            ("evicted_pages", "evicted pages"), ("cached_pages", "cached pages")]))
    if {"system", "chat"} & set(parts):
        @functools.cache
        def loaded():
            _, model, tokenizer, mesh = devices.load("float32")
            return model, tokenizer, mesh

        @functools.cache
        def system_work():
            return system_prompt_workload(
                loaded()[1], num_requests=system_requests, system_tokens=system_prompt_tokens,
                rate=system_rate, max_tokens=max_tokens, seed=seed)

        base = {"experiment": "prefix_cache", "max_tokens": max_tokens, "seed": seed,
                **devices.point}
        for caching in (False, True):
            if "system" in parts:
                log.measure({**base, "part": "system", "caching": caching,
                             "requests": system_requests, "system_tokens": system_prompt_tokens,
                             "rate": system_rate},
                            lambda caching=caching: run_system_prompt(*loaded(), system_work(),
                                                                caching))
        for caching in (False, True):
            if "chat" in parts:
                log.measure({**base, "part": "chat", "caching": caching,
                             "conversations": chat_conversations, "turns": chat_turns},
                            lambda caching=caching: run_multi_turn(
                                *loaded(), caching=caching,
                                                   conversations=chat_conversations,
                                                   turns=chat_turns, max_tokens=max_tokens,
                                                   seed=seed))
        model_rows = [dict(r) for r in log.rows() if r["part"] != "alone"]
        for r in model_rows:
            r["ttft_p50_ms"], r["ttft_p99_ms"] = 1e3 * r["ttft_s_p50"], 1e3 * r["ttft_s_p99"]
        print("\nparts 2 and 3, SmolLM2 through the engine:")
        print(markdown_table(model_rows, [
            ("part", "part"), ("caching", "prefix cache"), ("ttft_p50_ms", "TTFT p50 ms"),
            ("ttft_p99_ms", "TTFT p99 ms"), ("prefill_tokens_computed", "prefill tokens computed"),
            ("request_hit_rate", "hit rate (requests)"), ("token_hit_rate", "hit rate (tokens)"),
            ("evicted_pages", "evictions")]))
        for part in ("system", "chat"):
            pair = [r for r in model_rows if r["part"] == part]
            if len(pair) == 2:
                print(f"{part}: TTFT p50 {pair[0]['ttft_s_p50'] / pair[1]['ttft_s_p50']:.1f}x "
                      f"lower with the cache; prefill tokens "
                      f"{pair[0]['prefill_tokens_computed'] / max(1, pair[1]['prefill_tokens_computed']):.1f}x fewer")
    rows = log.rows()
    plot(rows, plot_path(out))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
