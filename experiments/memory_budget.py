"""How many users fit: KV bytes per token, GQA saving, weights and the KV budget left beside them,
per model and KV-cache format, on a set of GPUs (the lesson's exercises 1 and 3). Arithmetic
only: no model is loaded.

  python -m experiments.memory_budget --gpus=4 --gpu_memory_gb=80 --contexts=2048,4096,32768

Quantized formats carry bfloat16 scales of 2 bytes (fp8: one per head and token; int4: a scale
and a low value per group of 32), so their real cost is above the ideal bits; both are
reported. int4_kivi (pages of 32 tokens) carries one-byte codes and a bfloat16 window per
sequence, which max users count. A user holds whole pages (the engine's 16 tokens; int4_kivi's
32), so a context that is not a multiple of the page costs its last page whole.
"""

from __future__ import annotations

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from infer.model.config import PRESETS

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("models", ["llama-3-8b", "llama-3-70b", "llama-3-405b", "mistral-7b"],
                  "model presets", flag_values=FLAGS)
validate_list_flag(FLAGS, "models", choices=sorted(PRESETS))
flags.DEFINE_list("kv_formats", ["float16", "float8_e4m3fn", "int4", "int4_kivi"],
                  "KV-cache formats", flag_values=FLAGS)
validate_list_flag(FLAGS, "kv_formats", parse=lambda name: parse_kv_format(name))
flags.DEFINE_integer("gpus", 4, "GPUs one replica spans by tensor parallelism (heads laid out as "
                     "the engine places them)", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("gpu_memory_gb", 80.0, "memory per GPU in decimal GB (A100-80GB: 80)",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_string("weight_dtype", "bfloat16", "weight dtype", flag_values=FLAGS)
flags.register_validator("weight_dtype", lambda name: known_dtype(name),
                         message="--weight_dtype must name a dtype (bfloat16, float16, "
                                 "float8_e4m3fn, int8, int4, ...)", flag_values=FLAGS)
flags.DEFINE_float("overhead_fraction", 0.1,
                   "fraction of GPU memory kept for activations and workspace", flag_values=FLAGS)
flags.register_validator("overhead_fraction", lambda f: 0 <= f < 1,
                         message="--overhead_fraction must be in [0, 1)", flag_values=FLAGS)
flags.DEFINE_list("contexts", ["2048", "4096", "32768"], "context lengths for max users", flag_values=FLAGS)
validate_list_flag(FLAGS, "contexts", lower_bound=1)
flags.DEFINE_string("out", "results/memory_budget.jsonl", "JSONL output (a PNG plot beside it)",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)

FORMAT_LABELS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16",
                 "float8_e4m3fn": "FP8", "float8_e5m2": "FP8-e5m2", "int8": "INT8", "int4": "INT4",
                 "int4_kivi": "INT4-KIVI"}
PLOT_CONTEXT = 4096
# The lesson's worked figure: 2 (K and V) * 80 layers * 8 KV heads * 128 dims * 2 bytes.
LLAMA3_70B_BF16_BYTES = 327_680


def parse_kv_format(name: str) -> str:
    """The canonical name of KV format `name` (aliases too); ValueError for an unknown one."""
    from infer.cache.budget import kv_format_name

    return kv_format_name(name)


def known_dtype(name: str) -> bool:
    """Whether the byte counts know dtype `name` (or its alias: bf16, fp8, ...)."""
    from infer.cache.budget import dtype_bits

    try:
        dtype_bits(name)
    except (TypeError, ValueError):
        return False
    return True


def budget_row(model: str, kv_format: str, *, gpus: int, gpu_memory_gb: float,
               weight_dtype: str, overhead_fraction: float, contexts: list[int]) -> dict:
    """One model × format point; a model whose weights leave no room, or that does not split
    over the GPUs (its reason in `status`, layout None), gets fits=False, 0 users."""
    import dataclasses

    from infer.cache.budget import (GB, gqa_saving, kv_bytes_per_sequence_per_device,
                                    kv_bytes_per_token_per_device, kv_format_name,
                                    memory_budget)
    from infer.model.config import get_config

    config = get_config(model)
    name = kv_format_name(kv_format)
    point = {"experiment": "memory_budget", "model": model, "kv_format": name,
             "format": FORMAT_LABELS.get(name, name), "gpus": gpus,
             "gpu_memory_gb": gpu_memory_gb, "weight_dtype": weight_dtype,
             "overhead_fraction": overhead_fraction}
    try:
        budget = memory_budget(config, gpu_memory_gb=gpu_memory_gb, num_gpus=gpus,
                               weight_dtype=weight_dtype, kv_format=name,
                               overhead_fraction=overhead_fraction)
    except ValueError as e:  # the model does not split over this many GPUs
        return {**point, "fits": False, "layout": None, "status": f"cannot lay out: {e}",
                **{f"max_users_{ctx}": 0 for ctx in contexts}}
    # Per device, as the budget counts: each GPU must hold its share of every sequence.
    ideal = kv_bytes_per_token_per_device(config, gpus, name, include_scales=False)
    ideal_tokens = max(0, int(budget.device_kv_bytes_available // ideal))
    # Full multi-head attention would keep one KV head per query head (and, for int4_kivi, one
    # window per head per sequence): the same budget's arithmetic with those sizes.
    wide = config.replace(num_kv_heads=config.num_heads)
    mha_budget = dataclasses.replace(
        budget, device_kv_bytes_per_token=kv_bytes_per_token_per_device(wide, gpus, name),
        device_kv_bytes_per_sequence=kv_bytes_per_sequence_per_device(wide, gpus, name))
    usable = budget.gpu_memory_bytes - budget.overhead_bytes
    row = {
        **point, "layout": budget.layout,
        "kv_bytes_per_token": budget.kv_bytes_per_token,
        "kv_bytes_per_token_ideal": ideal * gpus,
        "kv_bytes_per_sequence": budget.kv_bytes_per_sequence,
        "mha_kv_bytes_per_token": mha_budget.kv_bytes_per_token,
        "gqa_saving": gqa_saving(config),
        "weight_gb": budget.weight_bytes / GB, "usable_gb": usable / GB,
        "kv_gb_available": max(0.0, budget.kv_bytes_available) / GB,
        "fits": budget.fits, "max_cached_tokens": budget.max_cached_tokens,
        "status": "ok" if budget.fits else (
            f"does not fit: {budget.weight_bytes / GB:.0f} GB of {weight_dtype} weights > "
            f"{usable / GB:.0f} GB usable"),
    }
    for ctx in contexts:
        row[f"max_users_{ctx}"] = budget.max_users(ctx)
        row[f"max_users_ideal_{ctx}"] = ideal_tokens // budget.tokens_held(ctx)
        row[f"max_users_mha_{ctx}"] = mha_budget.max_users(ctx)
    return row


def run(*, models: list[str], kv_formats: list[str], gpus: int, gpu_memory_gb: float,
        weight_dtype: str, overhead_fraction: float, contexts: list[int], out: str,
        resume: bool = False) -> list[dict]:
    """One row per model and format, each appended to `out` as it is computed (with `resume`,
    points already there are kept); table and plot from the file."""
    from experiments.common import ResultLog, markdown_table, plot_path

    common = dict(gpus=gpus, gpu_memory_gb=gpu_memory_gb, weight_dtype=weight_dtype,
                  overhead_fraction=overhead_fraction, contexts=contexts)
    log = ResultLog(out, resume=resume)
    for model in models:
        for fmt in kv_formats:
            log.measure({"experiment": "memory_budget", "model": model, "kv_format": fmt,
                         **common},
                        lambda model=model, fmt=fmt: budget_row(model, fmt, **common))
    rows = log.rows()
    print(f"\n{gpus}×{gpu_memory_gb:g} GB, one replica tensor-parallel over all, {weight_dtype} "
          f"weights, {overhead_fraction:.0%} reserved for activations\n")
    columns = [("model", "model"), ("format", "KV"), ("layout", "heads"),
               ("kv_bytes_per_token", "B/token"),
               ("kv_bytes_per_token_ideal", "ideal B/token"), ("gqa_saving", "GQA ×"),
               ("weight_gb", "weights GB"), ("kv_gb_available", "KV GB"),
               ("max_cached_tokens", "max tokens")]
    columns += [(f"max_users_{c}", f"users@{c}") for c in contexts]
    columns += [("status", "status")]
    print(markdown_table(rows, columns))
    print(exercise_answers(common))
    plot_users(rows, plot_path(out), PLOT_CONTEXT if PLOT_CONTEXT in contexts else contexts[0])
    return rows


def exercise_answers(common: dict) -> str:
    """The lesson's exercises 1 (FP16 vs FP8 vs INT4 users for Llama-3-70B at 4k) and 3 (GQA)."""
    from infer.cache.budget import kv_bytes_per_token
    from infer.model.config import get_config

    ctx = PLOT_CONTEXT
    common = {**common, "contexts": [ctx]}
    by_fmt = {f: budget_row("llama-3-70b", f, **common)
              for f in ("float16", "float8_e4m3fn", "int4")}
    fp16, int4 = by_fmt["float16"], by_fmt["int4"]
    if fp16["layout"] is None:
        return f"\nExercise 1: Llama-3-70B on {common['gpus']} GPUs: {fp16['status']}"
    lines = [f"\nExercise 1: Llama-3-70B, {common['gpus']}×{common['gpu_memory_gb']:g} GB, "
             f"context {ctx}, {fp16['kv_gb_available']:.1f} GB for KV"]
    for row in by_fmt.values():
        lines.append(f"  {row['format']:5s} {row['kv_bytes_per_token']:>9,} B/token "
                     f"(ideal {row['kv_bytes_per_token_ideal']:,})  ->  "
                     f"{row[f'max_users_{ctx}']} users (ideal {row[f'max_users_ideal_{ctx}']})")
    if fp16[f"max_users_{ctx}"]:
        u16 = fp16[f"max_users_{ctx}"]
        lines.append(
            f"  INT4/FP16 users: {int4[f'max_users_{ctx}'] / u16:.2f}× with scale overhead "
            f"(bytes {fp16['kv_bytes_per_token'] / int4['kv_bytes_per_token']:.2f}×), "
            f"{int4[f'max_users_ideal_{ctx}'] / u16:.2f}× ideal 4-bit "
            f"(bytes {fp16['kv_bytes_per_token'] / int4['kv_bytes_per_token_ideal']:.2f}×)")
    config = get_config("llama-3-70b")
    lines.append(
        f"Exercise 3: GQA, {config.num_heads} query heads / {config.num_kv_heads} KV heads = "
        f"{fp16['gqa_saving']:g}× smaller KV: {fp16['mha_kv_bytes_per_token']:,} B/token with full "
        f"MHA -> {fp16['kv_bytes_per_token']:,}; FP16 users at {ctx}: "
        f"{fp16[f'max_users_mha_{ctx}']} (MHA) -> {fp16[f'max_users_{ctx}']} (GQA)")
    bf16 = kv_bytes_per_token(config, "bfloat16")
    ok = "OK" if bf16 == LLAMA3_70B_BF16_BYTES else f"MISMATCH (expected {LLAMA3_70B_BF16_BYTES:,})"
    lines.append(f"Check: Llama-3-70B bf16 KV = {bf16:,} B/token "
                 f"(2 × 80 layers × 8 heads × 128 × 2 B): {ok}")
    return "\n".join(lines)


def plot_users(rows: list[dict], path: str, ctx: int) -> None:
    """Grouped bars: max users at `ctx` per model, one bar per KV format."""
    import numpy as np

    from experiments.common import new_figure, save_figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    width = 0.8 / len(formats)
    fig, ax = new_figure(figsize=(8, 4.5))
    x = np.arange(len(models))
    for i, fmt in enumerate(formats):
        users = [next((r[f"max_users_{ctx}"] for r in rows
                       if r["model"] == m and r["format"] == fmt), 0) for m in models]
        bars = ax.bar(x + (i - (len(formats) - 1) / 2) * width, users, width, label=fmt)
        ax.bar_label(bars, fontsize=7)
    for j, m in enumerate(models):
        mine = [r for r in rows if r["model"] == m]
        if not any(r["fits"] for r in mine):
            no_layout = all(r.get("layout") is None for r in mine)
            why = "no layout" if no_layout else "weights do not fit"
            ax.annotate(why, (j, 0), xytext=(0, 12), textcoords="offset points",
                        ha="center", fontsize=8, color="red")
    r0 = rows[0]
    ax.set_xticks(x, models)
    ax.set_ylabel(f"max concurrent users at {ctx} tokens")
    ax.set_title(f"KV-cache capacity on {r0['gpus']}×{r0['gpu_memory_gb']:g} GB "
                 f"({r0['weight_dtype']} weights, {r0['overhead_fraction']:.0%} reserve)")
    ax.legend(title="KV format")
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
