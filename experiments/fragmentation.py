"""KV memory wasted by contiguous max-length reservations against a paged cache, on a simulated
serving run (token level, no model).

  python -m experiments.fragmentation --rate=4 --kv_tokens=65536 --page_sizes=8,16,32,64,128

Requests arrive as a Poisson process; prompt lengths are uniform or lognormal, output lengths
Pareto (capped). Time advances in engine steps: a request admitted in a step has its prompt
cached by the end of it, then gains one token per step until prompt + output tokens are cached,
and is freed at the end of that step.

- contiguous: each admitted request reserves max_model_len slots up front, as serving systems
  did before vLLM. That is paging with G = max_model_len (one page per request), so both
  policies run on the real PageAllocator. All reservations are the same size, so there is no
  external fragmentation: the waste is the reserved slots a request has not filled.
- paged: pages of G slots allocated on demand; when a step runs out of pages the newest running
  request is preempted (freed, requeued at the front, recomputed on readmission), as vLLM does.

Waste at a step = allocated slots not holding a token, split into slots the request will still
fill (reserved) and slots it never fills (never used). Fractions are time averages weighted by
allocation (sum of wasted / sum of allocated over all steps), the measure behind PagedAttention's
60-80% (contiguous) and under 4% (paged).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from experiments.workloads import poisson_pareto
from infer.cache.page_allocator import PageAllocator, SequencePages

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_integer("num_requests", 1000, "requests in the run", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("rate", 4.0, "mean arrivals per engine step (Poisson)", flag_values=FLAGS)
flags.DEFINE_enum("prompt_dist", "uniform", ["uniform", "lognormal"], "prompt length distribution", flag_values=FLAGS)
flags.DEFINE_integer("prompt_min", 16, "shortest prompt", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("prompt_max", 1024, "longest prompt", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("prompt_median", 256, "lognormal prompt: median", flag_values=FLAGS)
flags.DEFINE_float("prompt_sigma", 1.0, "lognormal prompt: sigma of log length", lower_bound=0.0,
                   flag_values=FLAGS)
flags.DEFINE_float("output_shape", 1.5, "Pareto shape of output lengths", flag_values=FLAGS)
flags.DEFINE_float("output_scale", 20, "Pareto scale (minimum) of output lengths", flag_values=FLAGS)
flags.DEFINE_integer("output_cap", 1024, "longest output (also capped by max_model_len)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("max_model_len", 2048, "longest sequence: the contiguous reservation",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("kv_tokens", 65536, "KV memory in token slots, the same for both policies",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("page_sizes", ["8", "16", "32", "64", "128"], "page sizes G swept", flag_values=FLAGS)
validate_list_flag(FLAGS, "page_sizes", lower_bound=1, allow_empty=True)  # empty: contiguous only
flags.DEFINE_integer("seed", 0, "workload seed", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("out", "results/fragmentation.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
# Zero is no bound here: no arrivals, a log of 0, a Pareto numpy refuses or outputs of 0 tokens
# that the workload would clamp to one each.
for _name in ("rate", "prompt_median", "output_shape", "output_scale"):
    flags.register_validator(_name, lambda x: x > 0, message=f"--{_name} must be > 0",
                             flag_values=FLAGS)


@dataclasses.dataclass(frozen=True)
class Request:
    arrival: int  # engine step
    prompt_len: int
    output_len: int

    @property
    def length(self) -> int:
        return self.prompt_len + self.output_len


def make_workload(*, num_requests: int, rate: float, prompt_dist: str, prompt_min: int,
                  prompt_max: int, prompt_median: float, prompt_sigma: float,
                  output_shape: float, output_scale: float, output_cap: int,
                  max_model_len: int, seed: int) -> list[Request]:
    """Requests sorted by arrival, each at most max_model_len tokens with at least one output."""
    if not 1 <= prompt_min <= prompt_max:
        raise ValueError(f"need 1 <= prompt_min ({prompt_min}) <= prompt_max ({prompt_max})")
    if prompt_min >= max_model_len:
        raise ValueError(f"prompt_min {prompt_min} leaves no room to generate in "
                         f"max_model_len {max_model_len}")
    arrivals, prompts, outputs = poisson_pareto(
        np.random.default_rng(seed), num_requests=num_requests, rate=rate,
        prompt_min=prompt_min, prompt_max=prompt_max, output_shape=output_shape,
        output_scale=output_scale, output_cap=output_cap, prompt_dist=prompt_dist,
        prompt_median=prompt_median, prompt_sigma=prompt_sigma, max_model_len=max_model_len,
        round_up=True)
    arrivals = np.floor(arrivals).astype(int)  # engine steps
    return [Request(int(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


@dataclasses.dataclass
class _Seq:
    request: Request
    pages: SequencePages
    tokens: int  # cached tokens: the prompt, then one more per step (kept across preemption)
    admitted_at: int = -1


def simulate(requests: list[Request], *, kv_tokens: int, max_model_len: int, policy: str,
             page_size: int = 16) -> dict:
    """Serve `requests` with `kv_tokens` slots of KV memory; returns the run's waste and batch
    statistics. Pure: the same inputs give the same numbers."""
    if policy == "contiguous":
        page_size = max_model_len
    elif policy != "paged":
        raise ValueError(f"unknown policy {policy!r}: contiguous or paged")
    num_pages = kv_tokens // page_size
    if num_pages * page_size < max_model_len:
        # A lone max-length request must fit, or the run could stall forever.
        raise ValueError(f"kv_tokens {kv_tokens} hold {num_pages} pages of {page_size}, fewer "
                         f"slots than max_model_len {max_model_len}")
    if not requests:
        raise ValueError("no requests to simulate")
    for r in requests:
        if r.prompt_len < 1 or r.output_len < 1 or r.length > max_model_len:
            raise ValueError(f"request {r} must have prompt and output >= 1 and length <= "
                             f"max_model_len {max_model_len}")
    alloc = PageAllocator(num_pages, page_size)
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
    waiting: collections.deque[_Seq] = collections.deque()
    running: list[_Seq] = []  # admission order: the newest is preempted first
    allocated = held = to_fill = batch = busy = 0  # sums over steps
    # DeviceSteps where an arrived request waits: memory, not traffic, limits the batch there.
    full_steps = full_batch = full_held = 0
    max_batch = preemptions = wait_steps = done = 0
    step = 0
    while done < len(requests):
        if not running and not waiting:
            step = max(step, pending[0].arrival)  # idle: skip to the next arrival
        while pending and pending[0].arrival <= step:
            r = pending.popleft()
            waiting.append(_Seq(r, alloc.new_sequence(), r.prompt_len))

        # Running requests grow first, oldest first; a shortage evicts the newest.
        preempted = False
        i = 0
        while i < len(running):
            s = running[i]
            while s.pages.pages_needed(s.tokens + 1) > alloc.num_free():
                victim = running.pop()
                alloc.release(victim.pages)
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is s:
                    break
            else:  # no break: s kept its place and now has room for one more token
                alloc.reserve(s.pages, s.tokens + 1)
                s.tokens += 1
                s.pages.num_tokens = s.tokens
                i += 1

        # Admit in arrival order (no overtaking) while pages allow; not after a preemption,
        # which would only evict again.
        while waiting and not preempted:
            s = waiting[0]
            if s.pages.pages_needed(s.tokens) > alloc.num_free():
                break
            waiting.popleft()
            alloc.reserve(s.pages, s.tokens)
            s.pages.num_tokens = s.tokens
            if s.admitted_at < 0:
                s.admitted_at = step
                wait_steps += step - s.request.arrival
            running.append(s)

        if running:
            busy += 1
            batch += len(running)
            max_batch = max(max_batch, len(running))
            allocated += alloc.num_used() * page_size
            held += sum(s.tokens for s in running)
            to_fill += sum(min(s.pages.capacity, s.request.length) for s in running)
            if waiting:
                full_steps += 1
                full_batch += len(running)
                full_held += sum(s.tokens for s in running)
        finished = [s for s in running if s.tokens == s.request.length]
        for s in finished:
            alloc.release(s.pages)
            done += 1
        if finished:
            running = [s for s in running if s.tokens < s.request.length]
        step += 1

    alloc.check_invariants()
    return {
        "policy": policy, "page_size": page_size, "num_pages": num_pages, "kv_tokens": kv_tokens,
        "max_model_len": max_model_len, "num_requests": len(requests), "steps": step,
        # Empty slots now = slots awaiting this request's later tokens + slots it never fills.
        "waste_fraction": (allocated - held) / allocated,
        "reserved_fraction": (to_fill - held) / allocated,
        "never_used_fraction": (allocated - to_fill) / allocated,
        "waste_slots_per_request": (allocated - held) / batch,
        "kv_utilization": held / (busy * kv_tokens),  # share of all KV memory holding tokens
        "mean_batch": batch / busy, "max_batch": max_batch, "preemptions": preemptions,
        "saturated_steps": full_steps,
        "saturated_batch": full_batch / full_steps if full_steps else None,
        "saturated_kv_utilization": full_held / (full_steps * kv_tokens) if full_steps else None,
        "mean_wait_steps": wait_steps / len(requests),
        "output_tokens_per_step": sum(r.output_len for r in requests) / step,
    }


def run(*, num_requests: int, rate: float, prompt_dist: str, prompt_min: int, prompt_max: int,
        prompt_median: float, prompt_sigma: float, output_shape: float, output_scale: float,
        output_cap: int, max_model_len: int, kv_tokens: int, page_sizes: list[int], seed: int,
        out: str, resume: bool = False) -> list[dict]:
    """One row per policy and page size, each appended to `out` as it is simulated (with
    `resume`, points already there are not simulated again); table and plot from the file."""
    from experiments.common import ResultLog, markdown_table, plot_path

    # simulate() refuses such a pool too, but only on reaching its page size, rows later.
    for g in [max_model_len, *page_sizes]:
        if kv_tokens // g * g < max_model_len:
            raise ValueError(f"--kv_tokens {kv_tokens} in pages of {g} (--max_model_len for "
                             f"the contiguous policy, else --page_sizes) hold fewer slots than "
                             f"one request of --max_model_len {max_model_len}")
    workload = dict(num_requests=num_requests, rate=rate, prompt_dist=prompt_dist,
                    prompt_min=prompt_min, prompt_max=prompt_max, prompt_median=prompt_median,
                    prompt_sigma=prompt_sigma, output_shape=output_shape,
                    output_scale=output_scale, output_cap=output_cap, seed=seed)
    requests = make_workload(max_model_len=max_model_len, **workload)
    lengths = np.array([r.length for r in requests])
    print(f"{len(requests)} requests: length mean {lengths.mean():.0f}, median "
          f"{np.median(lengths):.0f}, max {lengths.max()} (max_model_len {max_model_len}); "
          f"KV memory {kv_tokens} token slots")
    points = [("contiguous", max_model_len)] + [("paged", g) for g in page_sizes]
    log = ResultLog(out, resume=resume)
    for policy, g in points:
        point = {"experiment": "fragmentation", **workload, "policy": policy, "page_size": g,
                 "kv_tokens": kv_tokens, "max_model_len": max_model_len}
        log.measure(point, lambda policy=policy, g=g: simulate(
            requests, kv_tokens=kv_tokens, max_model_len=max_model_len, policy=policy,
            page_size=g))
    rows = [dict(r) for r in log.rows()]
    for row in rows:
        for key in ("waste_fraction", "reserved_fraction", "never_used_fraction",
                    "saturated_kv_utilization"):
            if row[key] is not None:
                row[key.replace("fraction", "pct").replace("utilization", "pct")] = 100 * row[key]
    print(markdown_table(rows, [
        ("policy", "policy"), ("page_size", "G"), ("waste_pct", "waste %"),
        ("reserved_pct", "reserved %"), ("never_used_pct", "never used %"),
        ("waste_slots_per_request", "empty slots/req"), ("saturated_batch", "batch (saturated)"),
        ("saturated_kv_pct", "KV holding tokens % (saturated)"), ("mean_batch", "mean batch"),
        ("max_batch", "max batch"), ("preemptions", "preempt"),
        ("output_tokens_per_step", "out tok/step"), ("mean_wait_steps", "mean wait steps"),
        ("steps", "steps")]))
    plot_waste(rows, plot_path(out))
    return rows


def plot_waste(rows: list[dict], path: str) -> None:
    """Waste and batch size against page size, the contiguous policy as a reference line."""
    from experiments.common import new_figure, save_figure

    paged = [r for r in rows if r["policy"] == "paged"]
    contig = next(r for r in rows if r["policy"] == "contiguous")
    g = [r["page_size"] for r in paged]
    fig, (ax1, ax2) = new_figure(2, figsize=(10, 4))
    ax1.plot(g, [100 * r["waste_fraction"] for r in paged], "o-", label="paged")
    ax1.axhline(100 * contig["waste_fraction"], color="red", ls="--",
                label=f"contiguous ({contig['max_model_len']} reserved): "
                      f"{100 * contig['waste_fraction']:.0f}%")
    ax1.set_yscale("log")
    ax1.set_ylabel("KV slots allocated but empty (%)")
    ax2.plot(g, [r["saturated_batch"] or 0 for r in paged], "o-", label="paged")
    ax2.axhline(contig["saturated_batch"] or 0, color="red", ls="--",
                label=f"contiguous: {contig['saturated_batch'] or 0:.0f}")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("concurrent requests while a request waits")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(g, [str(x) for x in g])
        ax.set_xlabel("page size G (tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{contig['num_requests']} requests, {contig['kv_tokens']} KV slots, "
                 f"rate {contig['rate']:g}/step, prompts {contig['prompt_dist']}, "
                 f"outputs Pareto({contig['output_shape']:g}, {contig['output_scale']:g})")
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
