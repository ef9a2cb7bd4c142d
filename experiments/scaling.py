"""Tensor and data parallelism by the numbers: per (model, TP, DP, KV format), the bytes each
device holds, what a decode step communicates, and how many users fit at a context length; then
the same quantities measured on placed models and compiled decode steps, which must agree.

  python -m experiments.scaling
  python -m experiments.scaling --models=llama-3-70b --tensor_parallel=4 --data_parallel=1
  python -m experiments.scaling --measure=none          # the arithmetic alone, no JAX programs

Analytic rows (one per model x TP x DP x KV format, no weights loaded):
  layout     `infer.parallel.heads.head_layout(config, TP, pad_heads=True)`: split, replicate or
             pad; replication and padding widen the KV heads (and padding the query heads), so
             everything below is counted on the laid-out config C'. A TP whose FFN or vocabulary
             does not split is recorded with its reason, not raised.
  weights    per device = (weight_bytes(C') - N) / TP + N, N = (2L + 1) * E * itemsize the RMSNorm
             scales, the only parameters every device holds whole (all others split on heads,
             FFN or vocabulary, evenly once the layout exists).
  KV         per device per token = kv_bytes_per_token(C', format) / TP (pages split on KV heads).
  collectives per decode step of B rows on one replica (TP > 1; none at TP = 1), Megatron's:
               2L + 1 all-reduces of [B, 1, E] float32 (attention out and MLP out of each
               layer, the vocabulary-parallel embedding) and 1 all-gather of the logits
               [B, 1, V] float32, so the result bytes per device are
                 all-reduce (2L + 1) * B * E * 4,   all-gather B * V * 4,
             what `infer.parallel.hlo.collectives` reads from the compiled HLO. Under ring
             algorithms each device sends 2 (TP-1)/TP of an all-reduce's result and (TP-1)/TP of
             an all-gather's: wire = 2 (TP-1)/TP * AR + (TP-1)/TP * AG. Per row and at --batch.
             DP replicas never talk to each other.
  users      per replica: each GPU of --gpu_memory_gb keeps --overhead_fraction for activations
             (budget.py's reserve), holds its weights, and the rest holds its 1/TP of every
             token's KV: `MemoryBudget` on per-device figures, max_users(--context). In all:
             DP times that, on TP * DP GPUs. The arithmetic of weights, KV and users is
             budget.py's (`memory_budget(config, num_gpus=TP)` and the per-device functions).

Measured rows (--measure, points "model:TP:DP:kv_format" on this host's devices; on CPU
--virtual_devices virtual ones): the model with zero weights (the counts do not depend on the
values, and random init of SmolLM2 alone took 13 s), placed by `place_replicas`, a `Runner` on
replica 0, its decode step of --measure_rows rows compiled; collectives from the HLO, bytes per
device from `bytes_per_device` of every replica's weights and of KV pools in each --kv_formats.
A point whose layout the arithmetic refuses must be refused by `place_replicas` too. Any
disagreement exits non-zero after the rows are written and the tables printed.

No tokens/s here: virtual CPU devices share one host's cores and memory, so their step time
says nothing about TP on accelerators, where it must be measured.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from experiments.memory_budget import known_dtype, parse_kv_format
from infer.model.config import PRESETS

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("models", ["smollm2-135m", "llama-3-8b", "llama-3-70b"], "model presets",
                  flag_values=FLAGS)
# Empty: no analytic sweep, the --measure points alone.
validate_list_flag(FLAGS, "models", choices=sorted(PRESETS) + ["tiny-3kv"], allow_empty=True)
flags.DEFINE_list("tensor_parallel", ["1", "2", "3", "4", "8"], "tensor-parallel sizes",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "tensor_parallel", lower_bound=1, allow_empty=True)
flags.DEFINE_list("data_parallel", ["1", "2"], "data-parallel sizes", flag_values=FLAGS)
validate_list_flag(FLAGS, "data_parallel", lower_bound=1, allow_empty=True)
flags.DEFINE_list("kv_formats", ["bfloat16", "int8", "int4"], "KV-cache formats",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "kv_formats", parse=lambda name: parse_kv_format(name))
flags.DEFINE_string("weight_dtype", "bfloat16", "weight dtype", flag_values=FLAGS)
flags.register_validator("weight_dtype", lambda name: known_dtype(name),
                         message="--weight_dtype must name a dtype (bfloat16, float16, "
                                 "float8_e4m3fn, int8, int4, ...)", flag_values=FLAGS)
flags.DEFINE_float("gpu_memory_gb", 80.0, "memory per GPU in decimal GB (A100-80GB: 80)",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_float("overhead_fraction", 0.1, "fraction of each GPU kept for activations and "
                   "workspace", flag_values=FLAGS)
flags.register_validator("overhead_fraction", lambda f: 0 <= f < 1,
                         message="--overhead_fraction must be in [0, 1)", flag_values=FLAGS)
flags.DEFINE_integer("context", 4096, "tokens per user for max users", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("batch", 64, "decode rows for the bytes communicated per step",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("measure", None, "measured points model:TP:DP:kv_format (small models: their "
                  "weights are built on this host; presets or tiny-3kv), or none; default: the "
                  "list MEASURED", flag_values=FLAGS)
validate_list_flag(FLAGS, "measure", parse=lambda p: p == "none" or parse_point(p),
                   allow_empty=True)
flags.DEFINE_integer("measure_rows", 4, "decode rows of the measured steps", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("virtual_devices", 8, "CPU devices to make when JAX has not started yet",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("out", "results/scaling.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)

# The lesson's worked deployment: Llama-3-70B on four A100-80GB, one replica over all four.
LESSON = dict(model="llama-3-70b", tensor_parallel=4, data_parallel=1, gpu_memory_gb=80.0)

# Every layout way, DP > 1, every sweep KV format and one refused layout, in about two minutes
# on two cores; tiny-3kv at TP = 8 pads more zero query heads than it has real ones.
MEASURED = ["tiny:1:1:bfloat16", "tiny:2:1:int8", "tiny:4:1:int4", "tiny:2:2:bfloat16",
            "tiny:3:1:bfloat16", "tiny-3kv:2:1:int4", "tiny-3kv:3:1:bfloat16",
            "tiny-3kv:6:1:int8", "tiny-3kv:8:1:bfloat16", "tiny-3kv:4:2:bfloat16",
            "smollm2-135m:3:1:bfloat16", "smollm2-135m:2:1:int4"]


# Pages of the measured runner's pools: tiny's head dim of 16 takes no larger int4_kivi page.
MEASURED_PAGE_SIZE = 16


def model_config(name: str) -> Any:
    """A preset, or "tiny-3kv": SmolLM2's 3:1 grouping (6 query, 3 KV heads) at tiny's size,
    as in tests/parallel/test_tensor_parallel.py."""
    from infer.model.config import get_config

    if name == "tiny-3kv":
        return dataclasses.replace(get_config("tiny"), name="tiny-3kv", num_heads=6,
                                   num_kv_heads=3, intermediate_size=192, vocab_size=384)
    return get_config(name)


def step_collectives(config: Any, tensor_parallel: int, batch: int) -> dict[str, int]:
    """Counts and result bytes per device of one decode step of `batch` rows (module docstring),
    and the bytes each device sends under ring algorithms."""
    t, e, v, layers = tensor_parallel, config.hidden_size, config.vocab_size, config.num_layers
    if t == 1:
        return {"all_reduces": 0, "all_gathers": 0, "all_reduce_bytes": 0,
                "all_gather_bytes": 0, "wire_bytes": 0}
    ar = (2 * layers + 1) * batch * e * 4
    ag = batch * v * 4
    return {"all_reduces": 2 * layers + 1, "all_gathers": 1, "all_reduce_bytes": ar,
            "all_gather_bytes": ag, "wire_bytes": (2 * (t - 1) * ar + (t - 1) * ag) // t}


def analytic_row(model: str, tensor_parallel: int, data_parallel: int, kv_format: str, *,
                 weight_dtype: str, gpu_memory_gb: float, overhead_fraction: float,
                 context: int, batch: int) -> dict[str, Any]:
    """One analytic point; a TP that cannot be laid out gets its reason in `status` and no
    figures."""
    from infer.cache.budget import GB, kv_format_name, laid_out, memory_budget, norm_bytes

    config = model_config(model)
    fmt = kv_format_name(kv_format)
    t, dp = tensor_parallel, data_parallel
    row: dict[str, Any] = {"kind": "analytic", "gpus": t * dp}
    try:
        layout, wide = laid_out(config, t)
    except ValueError as e:
        return {**row, "layout": None, "status": f"cannot lay out: {e}"}
    device = memory_budget(config, gpu_memory_gb=gpu_memory_gb, num_gpus=t,
                           weight_dtype=weight_dtype, kv_format=fmt,
                           overhead_fraction=overhead_fraction)
    w_dev, kv_dev = device.device_weight_bytes, device.device_kv_bytes_per_token
    per_row, at_batch = step_collectives(config, t, 1), step_collectives(config, t, batch)
    users = device.max_users(context)
    row.update({
        "layout": layout.way, "heads": f"{wide.num_heads}/{wide.num_kv_heads}",
        "kv_heads_extra": wide.num_kv_heads / config.num_kv_heads - 1,
        "weight_bytes_per_device": w_dev, "weight_gb_per_device": w_dev / GB,
        "norm_bytes_per_device": norm_bytes(config, weight_dtype),
        "kv_bytes_per_token_per_device": kv_dev,
        "kv_gb_per_device": max(0.0, device.device_kv_bytes_available) / GB,
        "max_tokens_per_replica": device.max_cached_tokens,
        "max_users_per_replica": users, "max_users": dp * users,
        "all_reduces": per_row["all_reduces"], "all_gathers": per_row["all_gathers"],
        "comm_bytes_per_row": per_row["all_reduce_bytes"] + per_row["all_gather_bytes"],
        "wire_bytes_per_row": per_row["wire_bytes"],
        "comm_bytes_at_batch": at_batch["all_reduce_bytes"] + at_batch["all_gather_bytes"],
        "wire_bytes_at_batch": at_batch["wire_bytes"],
        "comm_mb_at_batch": (at_batch["all_reduce_bytes"] + at_batch["all_gather_bytes"]) / 1e6,
        "status": "ok" if device.fits else (
            f"weights do not fit: {w_dev / GB:.1f} GB per GPU > "
            f"{(1 - overhead_fraction) * gpu_memory_gb:.0f} GB usable"),
    })
    return row


def parse_point(text: str) -> dict[str, Any]:
    """"model:TP:DP:kv_format" -> the measured point's fields."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"a measured point is model:TP:DP:kv_format, got {text!r}")
    model, tp, dp, fmt = parts
    model_config(model)  # a known model and format: checked at parse, before any row
    parse_kv_format(fmt)
    if int(tp) < 1 or int(dp) < 1:
        raise ValueError(f"a measured point's TP and DP must be >= 1, got {text!r}")
    return {"model": model, "tensor_parallel": int(tp), "data_parallel": int(dp),
            "kv_format": fmt}


def disagreements(measured: dict[str, Any], analytic: dict[str, Any]) -> list[str]:
    """"name: measured X != analytic Y" for every quantity both give and they differ on."""
    return [f"{k}: measured {measured[k]} != analytic {analytic[k]}"
            for k in analytic if k in measured and measured[k] != analytic[k]]


def measure_point(model: str, tensor_parallel: int, data_parallel: int, kv_format: str, *,
                  kv_formats: list[str], weight_dtype: str, rows: int) -> dict[str, Any]:
    """The measured and analytic figures of one point on this host's devices, and their
    disagreements (`status`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from infer.cache.budget import (kv_bytes_per_token_per_device, kv_format_name, laid_out,
                                    weight_bytes_per_device)
    from infer.cache.paged import PagedKVCache, window_slots
    from infer.engine.runner import Runner, RunnerConfig, Shape
    from infer.model.llama import Llama
    from infer.parallel.hlo import collectives
    from infer.parallel.mesh import ParallelConfig
    from infer.parallel.placement import bytes_per_device, place_replicas
    from kernels_pallas.kv_quant import KV_FORMAT_ALIASES

    config, t, dp = model_config(model), tensor_parallel, data_parallel
    fmt = kv_format_name(kv_format)
    formats = list(dict.fromkeys([fmt] + [kv_format_name(f) for f in kv_formats]))
    row: dict[str, Any] = {"kind": "measured", "gpus": t * dp, "rows": rows,
                           "backend": jax.default_backend()}
    if jax.device_count() < t * dp:
        return {**row, "status": f"skipped: needs {t * dp} devices, {jax.device_count()} "
                f"visible"}
    try:
        layout, wide = laid_out(config, t)
    except ValueError as e:
        predicted = f"cannot lay out: {e}"
    else:
        predicted = None
    dtype = jnp.dtype(KV_FORMAT_ALIASES.get(weight_dtype, weight_dtype))
    parallel = ParallelConfig(t, dp, pad_heads=True)
    if predicted is not None:
        try:  # on a model of shapes alone: a refusal must come before any weight is needed
            place_replicas(nnx.eval_shape(lambda: Llama(config, dtype, None)), parallel)
        except ValueError as e:
            return {**row, "layout": None, "status": f"refused as predicted: {e}"}
        return {**row, "layout": None,
                "status": f"MISMATCH: place_replicas accepted a layout the arithmetic refuses "
                          f"({predicted})"}
    # Zero weights (rngs=None): placement and compilation see the same arrays as with real ones.
    replicas = place_replicas(Llama(config, dtype, None), parallel)
    # The pools measured below have the runner's pages: an int4_kivi token is counted at them.
    analytic: dict[str, Any] = {
        "weight_bytes_per_device": weight_bytes_per_device(config, t, weight_dtype),
        **{f"kv_bytes_per_token_per_device_{f}": kv_bytes_per_token_per_device(
            config, t, f, page_size=MEASURED_PAGE_SIZE) for f in formats}}
    found: dict[str, Any] = {}
    problems = []
    devices_seen: set = set()
    for i, (placed, _) in enumerate(replicas):
        held = bytes_per_device(jax.tree.leaves(nnx.state(placed)))
        if len(held) != t or devices_seen & set(held):
            problems.append(f"replica {i} holds weights on {len(held)} devices, "
                            f"{len(devices_seen & set(held))} shared with another replica")
        devices_seen |= set(held)
        if len(set(held.values())) != 1:
            problems.append(f"replica {i}'s devices hold unequal weight bytes {held}")
        found.setdefault("weight_bytes_per_device", max(held.values()))
        if max(held.values()) != found["weight_bytes_per_device"]:
            problems.append(f"replica {i} holds {max(held.values())} weight bytes per device")
    placed, mesh = replicas[0]
    runner = Runner(placed, RunnerConfig(num_pages=8, page_size=MEASURED_PAGE_SIZE,
                                         max_num_seqs=rows, max_model_len=64, kv_format=fmt),
                    mesh=mesh)
    slots = runner.config.num_pages * runner.config.page_size
    for f in formats:
        # The runner's windows too (int4_kivi's, one per sequence; none for other formats).
        cache = runner.cache if f == fmt else PagedKVCache.create(
            wide.num_layers, runner.config.num_pages, runner.config.page_size,
            wide.num_kv_heads, wide.head_dim, f, mesh=mesh, num_windows=window_slots(f, rows))
        arrays = list(cache.k + cache.v + (cache.k_scales or ()) + (cache.v_scales or ()))
        held = bytes_per_device(arrays)
        if len(set(held.values())) != 1:
            problems.append(f"{f} KV bytes differ across devices: {held}")
        per_token, rest = divmod(max(held.values()), slots)
        found[f"kv_bytes_per_token_per_device_{f}"] = (per_token + rest / slots if rest
                                                        else per_token)
    shape = Shape("decode", rows, 1, runner.config.window_for(64))
    _, lower = runner._program(shape)
    start = time.perf_counter()
    hlo = lower(runner.cache, *runner._dummy(shape)).compile().as_text()
    compile_s = time.perf_counter() - start
    got = collectives(hlo)
    expected = step_collectives(config, t, rows)
    analytic.update({k: expected[k] for k in ("all_reduces", "all_gathers", "all_reduce_bytes",
                                              "all_gather_bytes")},
                    other_collectives=0)
    found.update({"all_reduces": got.counts["all-reduce"],
                  "all_gathers": got.counts["all-gather"],
                  "all_reduce_bytes": got.bytes["all-reduce"],
                  "all_gather_bytes": got.bytes["all-gather"],
                  "other_collectives": got.total - got.counts["all-reduce"]
                  - got.counts["all-gather"]})
    problems += disagreements(found, analytic)
    return {**row, "layout": layout.way, "heads": f"{wide.num_heads}/{wide.num_kv_heads}",
            "measured": found, "analytic": analytic, "compile_s": compile_s,
            "status": "ok" if not problems else "MISMATCH: " + "; ".join(problems)}


def _set_virtual_devices(n: int) -> None:
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX has started (a test process, a notebook): its devices stand


def run(*, models: list[str], tensor_parallel: list[int], data_parallel: list[int],
        kv_formats: list[str], weight_dtype: str, gpu_memory_gb: float, overhead_fraction: float,
        context: int, batch: int, measure: list[str] | None, measure_rows: int,
        virtual_devices: int, out: str, resume: bool = False) -> list[dict]:
    """Analytic rows for every model x TP x DP x format, then the measured points (`measure`:
    None for MEASURED, ["none"] for none), each appended to `out`; prints both tables and the
    lesson's deployment. SystemExit when a measured point disagrees with the arithmetic."""
    from experiments.common import ResultLog, markdown_table, plot_path

    _set_virtual_devices(virtual_devices)
    log = ResultLog(out, resume=resume)
    common = dict(weight_dtype=weight_dtype, gpu_memory_gb=gpu_memory_gb,
                  overhead_fraction=overhead_fraction, context=context, batch=batch)
    for model in models:
        for t in tensor_parallel:
            for dp in data_parallel:
                for fmt in kv_formats:
                    point = {"experiment": "scaling", "kind": "analytic", "model": model,
                             "tensor_parallel": t, "data_parallel": dp, "kv_format": fmt,
                             **common}
                    log.measure(point, lambda model=model, t=t, dp=dp, fmt=fmt: analytic_row(
                        model, t, dp, fmt, **common))
    analytic = log.rows()
    points = [parse_point(p) for p in (MEASURED if measure is None else measure)
              if p != "none"]
    for p in points:
        point = {"experiment": "scaling", "kind": "measured", **p, "weight_dtype": weight_dtype,
                 "rows": measure_rows, "kv_formats": kv_formats}
        log.measure(point, lambda p=p: measure_point(**p, kv_formats=kv_formats,
                                                     weight_dtype=weight_dtype,
                                                     rows=measure_rows))
    measured = log.rows()[len(analytic):]

    print(f"\nPer device, {gpu_memory_gb:g} GB GPUs, {weight_dtype} weights, "
          f"{overhead_fraction:.0%} reserved; users at {context} tokens; comm per decode step "
          f"at batch {batch} (result bytes per device)\n")
    columns = [("model", "model"), ("tensor_parallel", "TP"), ("data_parallel", "DP"),
               ("gpus", "GPUs"), ("kv_format", "KV"), ("layout", "layout"),
               ("heads", "heads H/K"), ("weight_gb_per_device", "weights GB/GPU"),
               ("kv_bytes_per_token_per_device", "KV B/token/GPU"),
               ("all_reduces", "all-reduces"), ("all_gathers", "all-gathers"),
               ("comm_mb_at_batch", f"comm MB@{batch}"),
               ("max_users_per_replica", f"users@{context}/replica"),
               ("max_users", f"users@{context}"), ("status", "status")]
    print(markdown_table(analytic, columns))
    if measured:
        print(f"\nMeasured on {measured[0]['env']['num_devices']} {measured[0]['env']['backend']}"
              f" devices: placed weights, KV pools, a compiled decode step of {measure_rows} rows"
              f" (measured / analytic)\n")
        print(markdown_table([_measured_line(r) for r in measured], [
            ("model", "model"), ("tensor_parallel", "TP"), ("data_parallel", "DP"),
            ("kv_format", "KV"), ("layout", "layout"), ("heads", "heads H/K"),
            ("weights", "weight B/device"), ("kv", "KV B/token/device"),
            ("collectives", "all-reduce / all-gather"), ("comm", "AR + AG bytes"),
            ("compile_s", "compile s"), ("status", "status")]))
    print(lesson_summary(**common, kv_formats=kv_formats))
    if analytic:
        plot_users(analytic, plot_path(out), context)
    failed = [r for r in measured if r["status"].startswith("MISMATCH")]
    if failed:
        raise SystemExit(f"{len(failed)} measured point(s) disagree with the arithmetic: "
                         + " | ".join(f"{r['model']} TP={r['tensor_parallel']}: {r['status']}"
                                      for r in failed))
    return analytic + measured


def _measured_line(row: dict) -> dict:
    """A measured row's table cells: measured / analytic pairs."""
    m, a = row.get("measured"), row.get("analytic")
    if not m:
        return row
    from infer.cache.budget import kv_format_name

    key = f"kv_bytes_per_token_per_device_{kv_format_name(row['kv_format'])}"
    pair = lambda k: f"{m[k]:,.0f} / {a[k]:,}"
    return {**row, "weights": pair("weight_bytes_per_device"), "kv": pair(key),
            "collectives": f"{m['all_reduces']}/{m['all_gathers']} / "
                           f"{a['all_reduces']}/{a['all_gathers']}",
            "comm": f"{m['all_reduce_bytes'] + m['all_gather_bytes']:,} / "
                    f"{a['all_reduce_bytes'] + a['all_gather_bytes']:,}"}


def lesson_summary(*, weight_dtype: str, gpu_memory_gb: float, overhead_fraction: float,
                   context: int, batch: int, kv_formats: list[str]) -> str:
    """The lesson's deployment (Llama-3-70B, TP = 4 on four 80 GB GPUs) per KV format, and the
    other ways to use the same four GPUs; computed whether or not the sweep holds them."""
    common = dict(weight_dtype=weight_dtype, gpu_memory_gb=LESSON["gpu_memory_gb"],
                  overhead_fraction=overhead_fraction, context=context, batch=batch)
    model, t = LESSON["model"], LESSON["tensor_parallel"]
    formats = list(dict.fromkeys(["bfloat16", "int8", "int4"] + list(kv_formats)))
    lines = [f"\nThe lesson's point: {model} on {t}x A100-{LESSON['gpu_memory_gb']:g}GB, "
             f"TP={t}, DP=1 ({weight_dtype} weights, {overhead_fraction:.0%} reserved, "
             f"{context}-token users)"]
    for fmt in formats:
        r = analytic_row(model, t, 1, fmt, **common)
        lines.append(
            f"  KV {fmt:9s} weights {r['weight_gb_per_device']:.2f} GB/GPU, KV "
            f"{r['kv_bytes_per_token_per_device']:,} B/token/GPU, {r['kv_gb_per_device']:.1f} "
            f"GB/GPU for KV -> {r['max_users_per_replica']} users")
    r = analytic_row(model, t, 1, "bfloat16", **common)
    lines.append(f"  per decode step: {r['all_reduces']} all-reduces + {r['all_gathers']} "
                 f"all-gather, {r['comm_bytes_per_row'] / 1e6:.2f} MB per row per device "
                 f"({r['comm_bytes_at_batch'] / 1e6:.0f} MB at batch {batch}; "
                 f"{r['wire_bytes_at_batch'] / 1e6:.0f} MB sent per device by ring algorithms)")
    others = []
    for tp, dp in ((1, 4), (2, 2), (4, 1)):
        r = analytic_row(model, tp, dp, "bfloat16", **common)
        others.append(f"TP={tp} x DP={dp}: " + (f"{r['max_users']} users" if r["status"] == "ok"
                                                else r["status"]))
    lines.append("  the same 4 GPUs, bf16 KV: " + "; ".join(others))
    return "\n".join(lines)


def plot_users(rows: list[dict], path: str, context: int) -> None:
    """Users per replica at `context` against TP, a panel per model, a line per KV format
    (DP = 1; a TP that cannot be laid out is left out)."""
    from experiments.common import new_figure, save_figure

    rows = [r for r in rows if r["data_parallel"] == 1]
    if not rows:  # matplotlib refuses a figure of no panels
        print(f"no plot {path}: the sweep has no --data_parallel=1 rows")
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = new_figure(len(models), figsize=(4.5 * len(models), 4))
    axes = axes if len(models) > 1 else [axes]
    for ax, model in zip(axes, models):
        for fmt in dict.fromkeys(r["kv_format"] for r in rows):
            pts = [(r["tensor_parallel"], r["max_users_per_replica"]) for r in rows
                   if r["model"] == model and r["kv_format"] == fmt
                   and r.get("max_users_per_replica") is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=fmt)
        refused = sorted({r["tensor_parallel"] for r in rows
                          if r["model"] == model and r["layout"] is None})
        title = model + (f" (TP {', '.join(map(str, refused))}: no layout)" if refused else "")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("tensor-parallel size (GPUs per replica)")
        ax.set_ylabel(f"users at {context} tokens per replica")
        ax.set_yscale("symlog")
        if ax.get_lines():
            ax.legend(title="KV format", fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
