"""Where a plain-loop decode step's time goes, by XLA operation: a `jax.profiler` trace of
`decode_stream` over --tokens steps, its device events summed per kind of operation (an HLO
name without its numeric suffix: dot, ynn_fusion, copy, ...) and per step.

  python -m experiments.profile_step --dtype=bfloat16 --batch=1

Profiling slows the step down, and events on the runtime's worker threads overlap, so the sums
say which operations dominate, not the step's wall time (experiments.engine_overhead times that).
"""

from __future__ import annotations

from absl import flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and KV cache",
                  flag_values=FLAGS)
flags.DEFINE_integer("batch", 1, "decode rows", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per row", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("tokens", 32, "decode steps traced", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("top", 12, "kinds of operation printed", flag_values=FLAGS)

# Events of the runtime and of Python, not of an XLA operation.
_NOT_OPS = ("Thunk", "$", "Pjit", "Common", "Handle", "ParseArguments", "end: ", "DevicePut",
            "shard_args")


def op_kinds(events: list[dict], steps: int) -> list[dict]:
    """Complete trace events ("ph": "X") of XLA operations, summed per kind: [{kind, ms_per_step,
    per_step}], largest first."""
    import collections
    import re

    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith(_NOT_OPS):
            continue
        kind = re.sub(r"[.\d]+$", "", e["name"])
        total[kind] += e["dur"]
        count[kind] += 1
    return [{"kind": k, "ms_per_step": us / steps / 1e3, "per_step": count[k] / steps}
            for k, us in total.most_common()]


def run(*, dtype: str, batch: int, prompt_len: int, tokens: int, top: int) -> list[dict]:
    import glob
    import gzip
    import json
    import tempfile

    import jax
    import jax.numpy as jnp

    from experiments.common import markdown_table
    from experiments.workloads import consecutive_prompts, text_ids
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import decode_stream
    from infer.io.loader import load
    from infer.sampling_params import SamplingParams

    _, model, tokenizer = load("smollm2-135m", dtype)
    steps = DeviceSteps(model)
    prompts = consecutive_prompts(text_ids(tokenizer, 200_000), batch, prompt_len)
    params = [SamplingParams(ignore_eos=True)] * batch

    def stream():
        return decode_stream(steps, prompts, params, tokens + 1, cache_dtype=jnp.dtype(dtype))

    for _ in stream():  # compiles every program the traced run uses
        pass
    decoding = stream()
    next(decoding)  # the prefill, outside the trace: the sums are per decode step
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in decoding:
                pass
        (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    rows = op_kinds(events, tokens)
    print(f"{dtype}, batch {batch}: {sum(r['per_step'] for r in rows):.0f} operations a step")
    print(markdown_table(rows[:top], [("kind", "operation"), ("ms_per_step", "ms per step"),
                                      ("per_step", "per step")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
