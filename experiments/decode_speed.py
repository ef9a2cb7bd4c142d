"""Prefill and decode tokens/s per batch size: infer against HF transformers on the same weights,
with this machine's copy bandwidth and matmul FLOP/s measured in the same run.

  python -m experiments.decode_speed --batch_sizes=1,8,32 --dtype=float32 --tokens=32

Decode time per step is measured the way a user sees it, end to end through each library's own
generation loop: (time to generate N+1 tokens - time to generate 1) / N. The bandwidth floor of a
step is the bytes it must move (weights + the KV it reads) over the measured copy bandwidth.
"""

from __future__ import annotations

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "decode batch sizes", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight dtype (both libraries)", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 32, "decode steps timed per measurement", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 64, "prompt tokens per row", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "measurements per point (the median is reported)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("peers", ["hf"], "peers measured in the same run: hf, or none", flag_values=FLAGS)
flags.DEFINE_string("out", "results/decode_speed.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)


def run(*, batch_sizes: list[int], dtype: str, tokens: int, prompt_len: int, repeats: int,
        peers: list[str], out: str, resume: bool = False) -> list[dict]:
    """One row per batch size and implementation, each appended to `out` as it is measured
    (with `resume`, points already there are not measured again); the table from the file."""
    import functools

    import jax
    from tqdm import tqdm

    from experiments.common import (ResultLog, check_repeats, first_and_step_time, hf_greedy,
                                    load_hf_smollm2, markdown_table, measure_ceilings,
                                    usable_peers)
    from experiments.roofline import step_flops
    from experiments.workloads import consecutive_prompts, text_ids
    from infer.cache.budget import kv_bytes_per_token
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import decode_stream
    from infer.io.loader import load
    from infer.model.llama import tile_weights
    from infer.sampling_params import SamplingParams

    check_repeats(repeats)  # before any work
    peers = usable_peers(peers, "decode_speed")
    log = ResultLog(out, resume=resume)
    config, model, tokenizer = load("smollm2-135m", dtype)
    steps = DeviceSteps(tile_weights(model))  # the weights as the engine holds them on one CPU
    ids = text_ids(tokenizer, 200_000)
    prompts = lambda b: consecutive_prompts(ids, b, prompt_len)
    params = SamplingParams(ignore_eos=True)

    def infer_generate(b: int, n: int):
        for tok in decode_stream(steps, prompts(b), [params] * b, n):
            pass
        return tok

    hf = functools.cache(lambda: load_hf_smollm2(dtype))  # loaded when a point needs it

    def hf_generate(b: int, n: int):
        return hf_greedy(hf(), prompts(b), n)

    ceilings = functools.cache(measure_ceilings)  # measured in the run that needs them
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(steps.params))

    def measure(b: int, generate, kv_dtype: str) -> dict:
        mean_context = prompt_len + tokens / 2
        kv_read = b * mean_context * kv_bytes_per_token(config, kv_dtype)
        floor_s = (weight_bytes + kv_read) / ceilings()["copy_bandwidth_Bps"]
        flops = step_flops(config, b, 1, round(mean_context))  # attention's QK and PV included
        t_first, step_s = first_and_step_time(lambda n: generate(b, n), tokens, repeats)
        return {"prefill_tok_s": b * prompt_len / t_first, "decode_step_ms": step_s * 1e3,
                "decode_tok_s": b / step_s, "bandwidth_floor_step_ms": floor_s * 1e3,
                "fraction_of_floor": floor_s / step_s, "achieved_flops": flops / step_s,
                "weight_bytes": weight_bytes, **ceilings()}

    # Each floor counts the KV its implementation reads: decode_stream's cache is float32
    # whatever the weights' dtype, HF's cache takes the model's dtype.
    impls = [("infer", infer_generate, "float32")] + (
        [("hf", hf_generate, dtype)] if "hf" in peers else [])
    for b in tqdm(batch_sizes, desc="batch sizes"):
        for name, generate, kv_dtype in impls:
            log.measure({"experiment": "decode_speed", "impl": name, "model": config.name,
                         "dtype": dtype, "batch": b, "prompt_len": prompt_len, "tokens": tokens,
                         "repeats": repeats},
                        lambda b=b, generate=generate, kv=kv_dtype: measure(b, generate, kv))
    rows = [dict(r) for r in log.rows()]
    for row in rows:
        peer = next((r for r in rows if r["impl"] == "hf" and r["batch"] == row["batch"]), None)
        row["vs_hf"] = row["decode_tok_s"] / peer["decode_tok_s"] if peer else None
    # Each row carries the ceilings of the run that measured it; the first row's are printed.
    print(f"\ncopy bandwidth {rows[0]['copy_bandwidth_Bps'] / 1e9:.1f} GB/s, matmul "
          f"{rows[0]['matmul_flops'] / 1e9:.0f} GFLOP/s ({rows[0]['matmul_dtype']}), "
          f"weights {weight_bytes / 1e6:.0f} MB")
    print(markdown_table(rows, [("impl", "impl"), ("batch", "batch"),
                                ("prefill_tok_s", "prefill tok/s"),
                                ("decode_tok_s", "decode tok/s"), ("decode_step_ms", "step ms"),
                                ("bandwidth_floor_step_ms", "floor ms"),
                                ("fraction_of_floor", "of floor"), ("vs_hf", "× HF")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
