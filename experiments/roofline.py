"""Roofline of SmolLM2-135M: decode steps over batch size and prefill over prompt length, each
point's achieved FLOP/s against its arithmetic intensity, under this machine's ceilings (dense
matmul FLOP/s, copy bandwidth) measured in the same run. Runs unchanged on CPU, GPU and TPU.

  python -m experiments.roofline --batch_sizes=1,8,64 --prefill_lengths=32,128 --context=128

Every step is timed through `DeviceSteps.prefill_step`, what serving runs: decode is a prefill step of
one new token per row after `context` cached tokens (the same slot rewritten each time), prefill
is `prefill_batch` rows of T new tokens into an empty cache. Each timing sample runs
`steps_per_sample` steps back to back (the donated cache threaded through) and blocks once; the
step time is the median sample over that count.

Counting, per step of B rows, each with T new tokens after S cached ones (decode: T = 1, S =
context; prefill: S = 0). L layers, H query heads, K KV heads, D head dim, E hidden, F MLP width,
V vocabulary:

  FLOPs = B * [ 2 * P_mm * T                      every new token through every projection
              + 2 * V * E                         the logit row (prefill_step computes logits at
                                                  each row's last token only; a tied embedding is
                                                  multiplied here, its lookup costs nothing)
              + 4 * L * H * D * sum_{t=1..T} (S + t) ]   QK^T and PV over the keys each new
                                                  token attends (S cached + the new ones up to it)
  P_mm  = L * (E * D * (2H + 2K) + 3 * E * F)     the matmul weights of the decoder layers; RMSNorm
                                                  scales (one multiply each, ~0.03% of SmolLM2's
                                                  FLOPs) are not counted
  bytes = W                                       every weight read once (sum of the arrays' bytes)
        + B * (S + T) * kv_bytes_per_token        the KV each row attends, read once
        + B * T * kv_bytes_per_token              the new tokens' KV written
  intensity = FLOPs / bytes;  attainable = min(peak_flops, intensity * bandwidth)
  ridge intensity = peak_flops / bandwidth        (decode turns compute-bound past it)

These are the model's necessary FLOPs and bytes, the usual roofline convention; activations are
not counted. What XLA executes is larger: the contiguous cache's masked attention runs over all
`cache_len` slots (a power of two >= S + T, at least 128), not only the S + T filled ones.

Decode intensity grows with B towards the KV-only limit (per-row FLOPs / per-row KV bytes), so
decode can stay memory-bound at every batch when that limit is below the ridge; the closed-form
batch where the counted intensity first exceeds the ridge ("ridge_batch_exact") is reported
beside the first swept batch that exceeds it ("ridge_batch").
Also reported: the first batch whose measured step time exceeds `knee_factor` times the
smallest batch's (batch 1 by default), where the step stops being free to widen.

Rows: one JSON line per sweep point (phase "decode" or "prefill"; failures such as running out
of memory as rows with an "error" field), then one row with phase "summary". The PNG goes beside
the JSONL (same name, .png).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
# Either sweep may be empty (run refuses both).
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32", "64", "128", "256"],
                  "decode batch sizes", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1, allow_empty=True)
flags.DEFINE_list("prefill_lengths", ["16", "32", "64", "128", "256", "512"],
                  "prefill lengths (new tokens per row)", flag_values=FLAGS)
validate_list_flag(FLAGS, "prefill_lengths", lower_bound=1, allow_empty=True)
flags.DEFINE_integer("prefill_batch", 1, "rows per prefill step", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("context", 128, "cached tokens per row before each decode step",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "weight dtype (the matmul ceiling is measured in it too)", flag_values=FLAGS)
flags.DEFINE_enum("kv_dtype", "float32", ["float32", "bfloat16"], "KV cache dtype", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timing samples per point (the median is reported)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("steps_per_sample", 4, "steps run back to back per timing sample",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("knee_factor", 1.5,
                   "report the first decode batch whose step time exceeds this times the "
                   "smallest batch's", flag_values=FLAGS)
flags.DEFINE_string("out", "results/roofline.jsonl", "JSONL output; the PNG goes beside it",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)

MIN_CACHE_LEN = 128


# ---------------------------------------------------------------------------------------------
# Counting (pure Python: no JAX, exact integers)


def matmul_weights(config: Any) -> int:
    """Weights every new token is multiplied by: the decoder layers' projections (Q, K, V, O,
    gate, up, down). Excludes the embedding (a lookup), the vocabulary projection (counted per
    logit row) and the RMSNorm scales."""
    e, d = config.hidden_size, config.head_dim
    attn = e * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    return config.num_layers * (attn + 3 * e * config.intermediate_size)


def step_flops(config: Any, batch: int, new_tokens: int, cached: int) -> int:
    """FLOPs of one prefill_step: `batch` rows of `new_tokens` after `cached` tokens, logits at
    each row's last token (see the module docstring)."""
    attended = new_tokens * cached + new_tokens * (new_tokens + 1) // 2  # sum_{t=1..T} (S + t)
    per_row = (2 * matmul_weights(config) * new_tokens
               + 2 * config.vocab_size * config.hidden_size
               + 4 * config.num_layers * config.num_heads * config.head_dim * attended)
    return batch * per_row


def step_bytes(batch: int, new_tokens: int, cached: int, *, weight_bytes: int,
               kv_bytes_per_token: int) -> int:
    """Bytes one step must move: weights once, the attended KV read once, the new KV written."""
    kv_tokens = batch * (cached + new_tokens) + batch * new_tokens
    return weight_bytes + kv_tokens * kv_bytes_per_token


def cache_len(tokens: int, minimum: int = MIN_CACHE_LEN) -> int:
    """Cache slots for `tokens` tokens: the next power of two, at least `minimum`."""
    n = max(int(tokens), minimum, 1)
    return 1 << (n - 1).bit_length()


def ridge_intensity(peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte above which the roof is compute, not bandwidth."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    return min(peak_flops, intensity * bandwidth)


def first_above(xs: Sequence[Any], values: Sequence[float | None], threshold: float) -> Any | None:
    """The first x (in the given order) whose value exceeds threshold; None values are skipped;
    None if none does."""
    for x, v in zip(xs, values):
        if v is not None and v > threshold:
            return x
    return None


def step_time_knee(batches: Sequence[int], step_times: Sequence[float | None],
                   factor: float = 1.5) -> int | None:
    """The first batch (in increasing batch order) whose step time exceeds `factor` times the
    step time of the smallest measured batch; None if none does or nothing was measured."""
    measured = sorted((b, t) for b, t in zip(batches, step_times) if t is not None)
    if not measured:
        return None
    base = measured[0][1]
    return first_above([b for b, _ in measured], [t for _, t in measured], factor * base)


def decode_intensity_limit(config: Any, cached: int, kv_bytes_per_token: int) -> float:
    """Decode intensity as the batch grows without bound: per-row FLOPs / per-row KV bytes."""
    return step_flops(config, 1, 1, cached) / step_bytes(1, 1, cached, weight_bytes=0,
                                                          kv_bytes_per_token=kv_bytes_per_token)


def exact_ridge_batch(config: Any, cached: int, *, weight_bytes: int, kv_bytes_per_token: int,
                          ridge: float) -> int | None:
    """Smallest integer decode batch whose counted intensity exceeds `ridge`; None if decode
    never gets there (the KV-only limit is at or below the ridge).

    FLOPs = a * B and bytes = W + c * B, so a * B / (W + c * B) > r  <=>  B * (a - r * c) > r * W.
    """
    a = step_flops(config, 1, 1, cached)
    c = step_bytes(1, 1, cached, weight_bytes=0, kv_bytes_per_token=kv_bytes_per_token)
    margin = a - ridge * c
    if margin <= 0:
        return None
    return int(ridge * weight_bytes // margin) + 1


# ---------------------------------------------------------------------------------------------
# Measurement


def _time_steps(step: Callable[[], Any], *, repeats: int, steps_per_sample: int
                ) -> tuple[float, float, float]:
    """(first call incl. compile, median step time, median host dispatch time per step), in
    seconds. A sample runs `steps_per_sample` steps and blocks on the last one's outputs."""
    import jax
    import numpy as np

    from experiments.common import check_repeats

    check_repeats(repeats)
    check_repeats(steps_per_sample, "steps_per_sample")
    t0 = time.perf_counter()
    jax.block_until_ready(step())
    first = time.perf_counter() - t0
    jax.block_until_ready(step())  # one more warm-up, after compilation
    times, dispatch = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps_per_sample):
            out = step()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        times.append((t2 - t0) / steps_per_sample)
        dispatch.append((t1 - t0) / steps_per_sample)
    return first, float(np.median(times)), float(np.median(dispatch))


def measure_point(steps: Any, config: Any, *, batch: int, new_tokens: int, cached: int,
                  kv_dtype: Any, repeats: int, steps_per_sample: int, seed: int = 0
                  ) -> dict[str, Any]:
    """Times prefill_step on `batch` rows of `new_tokens` tokens after `cached` (timing only:
    the cached slots hold zeros). Returns step_s, first_call_s, dispatch_s, cache_len."""
    import jax.numpy as jnp
    import numpy as np

    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata
    from infer.sampling import SamplingArrays
    from infer.sampling_params import SamplingParams

    slots = cache_len(cached + new_tokens)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, new_tokens)), jnp.int32)
    if new_tokens == 1:
        meta = AttentionMetadata.for_decode(jnp.full((batch,), cached, jnp.int32))
    else:
        meta = AttentionMetadata.for_prefill(jnp.full((batch,), new_tokens, jnp.int32), new_tokens,
                                             cached=jnp.full((batch,), cached, jnp.int32))
    sampling = SamplingArrays.from_params([SamplingParams(seed=0)] * batch)
    steps_arr = jnp.zeros((batch,), jnp.int32)
    box = [KVCache.create(config.num_layers, batch, slots, config.num_kv_heads, config.head_dim,
                          kv_dtype)]

    def step() -> Any:
        nxt, _, _, box[0] = steps.prefill_step(box[0], tokens, meta, sampling, steps_arr)
        return nxt, box[0]

    try:
        first, step_s, dispatch_s = _time_steps(step, repeats=repeats,
                                                steps_per_sample=steps_per_sample)
    finally:
        box.clear()  # free the cache before the next point allocates its own
    return {"step_s": step_s, "first_call_s": first, "dispatch_s": dispatch_s, "cache_len": slots}


def judged(row: dict, peak: float, bandwidth: float) -> dict:
    """A point's fields that depend on the ceilings (its bound, the roof above it, its fraction
    of that roof, the step time the roof allows), against `peak` FLOP/s and `bandwidth` B/s."""
    flops, nbytes, intensity = row["flops"], row["bytes"], row["intensity"]
    ridge = ridge_intensity(peak, bandwidth)
    attainable = attainable_flops(intensity, peak, bandwidth)
    out = {"ridge_intensity": ridge, "attainable_flops": attainable,
           "bound": "compute" if intensity > ridge else "memory"}
    if "error" not in row:
        out.update(fraction_of_roof=row["achieved_flops"] / attainable,
                   roofline_step_ms=1e3 * max(flops / peak, nbytes / bandwidth))
    return out


def run(*, batch_sizes: list[int], prefill_lengths: list[int], prefill_batch: int, context: int,
        dtype: str, kv_dtype: str, repeats: int, steps_per_sample: int, knee_factor: float,
        out: str, resume: bool = False) -> list[dict]:
    """One row per sweep point, each appended to `out` as it is measured (with `resume`, points
    already there are not measured again), then the summary row; table and plot from the file."""
    if not batch_sizes and not prefill_lengths:
        raise ValueError("--batch_sizes and --prefill_lengths must not both be empty: no point "
                         "to measure")

    import functools

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from experiments.common import (ResultLog, check_repeats, markdown_table,
                                    measure_ceilings, plot_path)
    from infer.cache.budget import kv_bytes_per_token
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load, resolve_dtype

    check_repeats(repeats)  # before any work
    check_repeats(steps_per_sample, "steps_per_sample")
    config, model, _ = load("smollm2-135m", dtype)
    steps = DeviceSteps(model)
    weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(steps.params)))
    kv_bpt = kv_bytes_per_token(config, kv_dtype)
    backend = jax.default_backend()
    log = ResultLog(out, resume=resume)
    # The ceilings are measured in the run that measures points, and travel in each point's row.
    ceilings = functools.cache(lambda: measure_ceilings(dtype=resolve_dtype(dtype)))
    config_fields = {"experiment": "roofline", "model": config.name, "dtype": dtype,
                     "kv_dtype": kv_dtype, "backend": backend, "device": log.env["device"],
                     "repeats": repeats, "steps_per_sample": steps_per_sample}
    counted = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bpt}

    def measure(phase: str, b: int, t: int, s: int) -> dict:
        c = ceilings()
        flops = step_flops(config, b, t, s)
        nbytes = step_bytes(b, t, s, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bpt)
        row = {**counted, **c, "label": f"B={b}" if phase == "decode" else f"T={t}",
               "flops": flops, "bytes": nbytes, "intensity": flops / nbytes}
        try:
            m = measure_point(steps, config, batch=b, new_tokens=t, cached=s,
                              kv_dtype=jnp.dtype(kv_dtype), repeats=repeats,
                              steps_per_sample=steps_per_sample)
        except (jax.errors.JaxRuntimeError, MemoryError) as e:  # out of memory, mostly
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            tqdm.write(f"{phase} B={b} T={t}: {row['error'][:200]}")
        else:
            step_s = m["step_s"]
            row.update(m, step_ms=step_s * 1e3, dispatch_ms=m["dispatch_s"] * 1e3,
                       tokens_per_s=b * t / step_s, achieved_flops=flops / step_s,
                       achieved_Bps=nbytes / step_s)
        return {**row, **judged(row, c["matmul_flops"], c["copy_bandwidth_Bps"])}

    points = ([("decode", b, 1, context) for b in batch_sizes]
              + [("prefill", prefill_batch, t, 0) for t in prefill_lengths])
    for phase, b, t, s in tqdm(points, desc="roofline points"):
        log.measure({**config_fields, "phase": phase, "batch": b, "new_tokens": t, "cached": s},
                    lambda phase=phase, b=b, t=t, s=s: measure(phase, b, t, s))
    rows = [dict(r) for r in log.rows()]

    # The summary is derived from the rows, so it is written anew by every run. Rows of a
    # resumed run may carry another run's ceilings: the first row's stand for the sweep, and
    # every row is judged against them here (bound, % of roof), as the summary and plot are.
    peak, bandwidth = rows[0]["matmul_flops"], rows[0]["copy_bandwidth_Bps"]
    ridge = ridge_intensity(peak, bandwidth)
    runs = {(r["matmul_flops"], r["copy_bandwidth_Bps"]) for r in rows}
    if len(runs) > 1:
        print(f"[roofline] the rows come from {len(runs)} runs with different ceilings (copy "
              f"{min(b for _, b in runs) / 1e9:.1f}-{max(b for _, b in runs) / 1e9:.1f} GB/s, "
              f"matmul {min(f for f, _ in runs) / 1e9:,.0f}-{max(f for f, _ in runs) / 1e9:,.0f}"
              f" GFLOP/s): every row is judged against the first row's")
        for r in rows:
            r.update(judged(r, peak, bandwidth))
    ceiling_fields = {k: rows[0][k] for k in ("copy_bandwidth_Bps", "matmul_flops",
                                              "matmul_dtype")}
    swept = sorted((r for r in rows if r["phase"] == "decode"), key=lambda r: r["batch"])
    decode = [r for r in swept if "error" not in r]
    summary_point = {**config_fields, "phase": "summary", "context": context,
                     "knee_factor": knee_factor, "batch_sizes": batch_sizes,
                     "prefill_lengths": prefill_lengths, "prefill_batch": prefill_batch}
    summary = log.append({
        **summary_point, **counted, **ceiling_fields, "ridge_intensity": ridge,
        # Intensity is counted, not timed: failed points count too.
        "ridge_batch": first_above([r["batch"] for r in swept], [r["intensity"] for r in swept],
                                   ridge),
        "ridge_batch_exact": exact_ridge_batch(config, context, weight_bytes=weight_bytes,
                                                       kv_bytes_per_token=kv_bpt, ridge=ridge),
        "decode_intensity_limit": decode_intensity_limit(config, context, kv_bpt),
        "knee_batch": step_time_knee([r["batch"] for r in decode], [r["step_s"] for r in decode],
                                     knee_factor),
        "knee_base_batch": decode[0]["batch"] if decode else None,
    }, point=summary_point)
    common = {**config_fields, **ceiling_fields}
    for r in rows:
        if "error" in r:
            r["error_short"] = r["error"][:60]
        else:
            r["gflops"], r["gbps"] = r["achieved_flops"] / 1e9, r["achieved_Bps"] / 1e9
            r["roof_pct"] = 100 * r["fraction_of_roof"]
    print(f"\n{backend} ({common['device']}), weights {dtype} {weight_bytes / 1e6:.0f} MB, "
          f"KV {kv_dtype} {kv_bpt} B/token; matmul {peak / 1e9:,.0f} GFLOP/s "
          f"({common['matmul_dtype']}), copy {bandwidth / 1e9:,.1f} GB/s, ridge {ridge:.1f} FLOP/B")
    print(markdown_table(rows, [
        ("phase", "phase"), ("batch", "B"), ("new_tokens", "T"), ("cached", "S"),
        ("step_ms", "step ms"), ("dispatch_ms", "dispatch ms"), ("tokens_per_s", "tok/s"),
        ("gflops", "GFLOP/s"), ("gbps", "GB/s"), ("intensity", "FLOP/B"), ("bound", "bound"),
        ("roof_pct", "% of roof"), ("error_short", "error")]))
    print(f"\ndecode at S={context}: intensity passes the ridge ({ridge:.1f} FLOP/B) first at "
          f"B={summary['ridge_batch']} of those swept (exact: "
          f"B={summary['ridge_batch_exact']}; limit as B grows "
          f"{summary['decode_intensity_limit']:.1f} FLOP/B); step time exceeds {knee_factor:g}x "
          f"B={summary['knee_base_batch']}'s first at B={summary['knee_batch']}")
    plot = plot_path(out)
    plot_roofline(rows, summary, plot)
    print(f"wrote {out} and {plot}")
    return rows + [summary]


def plot_roofline(rows: list[dict], summary: dict, path: str) -> None:
    """Left: the roofline with decode and prefill points at (intensity, achieved FLOP/s).
    Right: decode step time against batch, with the roofline's prediction, the knee and the
    ridge batch."""
    import matplotlib.ticker
    import numpy as np

    from experiments.common import new_figure, save_figure

    peak, bw, ridge = summary["matmul_flops"], summary["copy_bandwidth_Bps"], summary["ridge_intensity"]
    ok = [r for r in rows if "error" not in r]
    decode = sorted((r for r in ok if r["phase"] == "decode"), key=lambda r: r["batch"])
    prefill = sorted((r for r in ok if r["phase"] == "prefill"), key=lambda r: r["new_tokens"])

    fig, (ax1, ax2) = new_figure(2, figsize=(13, 5.2))
    xs = [r["intensity"] for r in ok] + [ridge]
    x = np.geomspace(min(xs) / 3, max(xs) * 3, 200)
    ax1.plot(x, np.minimum(peak, x * bw) / 1e9, "k-", lw=1.5,
             label=f"roof: {peak / 1e9:,.0f} GFLOP/s, {bw / 1e9:,.1f} GB/s")
    ax1.axvline(ridge, color="gray", ls=":", label=f"ridge {ridge:.1f} FLOP/B")
    for series, marker, color, name in ((decode, "o", "tab:blue", f"decode (S={summary['context']})"),
                                        (prefill, "s", "tab:orange", "prefill")):
        if not series:
            continue
        ax1.plot([r["intensity"] for r in series], [r["achieved_flops"] / 1e9 for r in series],
                 marker=marker, color=color, ls="-", lw=0.8, label=name)
        for r in series:
            ax1.annotate(r["label"], (r["intensity"], r["achieved_flops"] / 1e9), fontsize=7,
                         xytext=(4, -9 if series is prefill else 4), textcoords="offset points",
                         color=color)
    crossing = next((r for r in decode if r["batch"] == summary["ridge_batch"]), None)
    if crossing is not None:
        ax1.plot(crossing["intensity"], crossing["achieved_flops"] / 1e9, "*", ms=16, mfc="none",
                 color="red", label=f"decode compute-bound from B={crossing['batch']}")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("arithmetic intensity (FLOPs per byte of weights + KV)")
    ax1.set_ylabel("GFLOP/s")
    ax1.set_title("roofline")

    if decode:
        b = [r["batch"] for r in decode]
        ax2.plot(b, [r["step_ms"] for r in decode], "o-", color="tab:blue", label="measured")
        ax2.plot(b, [r["roofline_step_ms"] for r in decode], "k--", lw=1,
                 label="roofline: max(FLOPs/peak, bytes/bandwidth)")
        base = decode[0]["step_ms"]
        ax2.axhline(summary["knee_factor"] * base, color="tab:green", ls=":",
                    label=f"{summary['knee_factor']:g}x B={decode[0]['batch']} step")
        if summary["knee_batch"] is not None:
            ax2.axvline(summary["knee_batch"], color="tab:green", ls="--", lw=2, alpha=0.6,
                        label=f"step time grows from B={summary['knee_batch']}")
        if summary["ridge_batch"] is not None:
            ax2.axvline(summary["ridge_batch"], color="red", ls=":", lw=2, alpha=0.8,
                        label=f"intensity past ridge from B={summary['ridge_batch']}")
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(b, [str(v) for v in b])
        ax2.set_yscale("log")
    ax2.set_xlabel("decode batch size B")
    ax2.set_ylabel("step time (ms)")
    ax2.set_title(f"decode step time (S={summary['context']})")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.6g}")
    for ax, where in ((ax1, "lower right"), (ax2, "upper left")):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc=where)
        for axis in ((ax.xaxis, ax.yaxis) if ax is ax1 else (ax.yaxis,)):
            axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1, 2, 5)))
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(f"{summary['model']} {summary['dtype']} weights, {summary['kv_dtype']} KV on "
                 f"{summary['backend']} ({summary['device']}); ceilings measured in the same run")
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
