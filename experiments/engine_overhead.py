"""What the serving engine adds to a decode step: the plain loop's step (`decode_stream`, one
batch on a contiguous cache, the next step dispatched before the last tokens are read back; and
the same loop over a paged cache) against the engine's (scheduler, paged cache, per-request
bookkeeping), same weights, dtype, lengths and batch, in one run; with the engine's step split
into host scheduling, input building, device time and output handling, the bytes a step must
move against the bandwidth floor (those bytes at the copy bandwidth, reads and writes together,
as issue 13 sets it; and at the read bandwidth, which memory serves a read-only stream at and is
what a step can reach), and HF transformers' decode step (`generate`, rows as long as the plain
rows on average) as the peer.

  python -m experiments.engine_overhead --batch_sizes=1,8,32 --dtypes=float32,bfloat16

A step's time is the median over the timed decode steps of every repeat: the interval between
consecutive tokens for the plain loop, `StepRecord.end_s - start_s` for the engine (full-batch
decode steps only). The engine prefills one request per step, between decode steps, so when its
batch first runs whole the earlier requests are ahead; an untimed engine run finds by how much,
and the plain loop's row i then starts from a prompt as long as request i is at that step
(prompt and tokens so far), so that both decode the same contexts, `--tokens - 1` steps (the
first of them, which waited for a prefill, untimed on both sides). Every program is compiled by
an untimed first run. The engine's requests ask for their final outputs only, as `LLM.generate`'s do
(`--output_kind=cumulative`: a streamed output per token, as a server's streamed requests). The
engine is also timed with async scheduling off (the same runner), for what overlapping
the host's work with the device's gains. The breakdown is the means of `StepRecord`'s phases
over the timed steps, which add up to the mean step (`engine_step_mean_ms`); with async
scheduling (the engine's default) a step's inputs are those of the step planned ahead, and its
device time is only what the host waited for, the rest being hidden behind host work.

--tensor_parallel_size=T runs the engine's steps on a mesh of T devices (--pad_heads as in
`LLM`). The plain loop and HF run on one device only, and a ratio of a split engine to a
one-device loop would count the split as overhead, so with T > 1 both comparisons are refused
until turned off (--noplain --peers=none), and the rows leave out the bandwidth floor, a
one-device figure: they hold the engine's steps and breakdown alone. --data_parallel_size is
refused: the experiment times one engine's steps.
"""

from __future__ import annotations

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from infer.parallel.flags import define_parallel_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "decode batch sizes", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight (and KV) dtypes", flag_values=FLAGS)
validate_list_flag(FLAGS, "dtypes", choices=["float32", "bfloat16"])  # infer.io.loader.DTYPES
# At least 4: steps to time after the first (run checks it too).
flags.DEFINE_integer("tokens", 32, "tokens generated per request in a timed run", lower_bound=4,
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per request", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timed runs per point", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("peers", ["hf"], "peers timed in the same run: hf, or none", flag_values=FLAGS)
flags.DEFINE_enum("output_kind", "final", ["final", "cumulative"],
                  "the requests' SamplingParams.output_kind: final (LLM.generate's, outputs of "
                  "finished requests only) or cumulative (a streamed output per token)",
                  flag_values=FLAGS)
flags.DEFINE_bool("plain", True, "time the plain loops (contiguous and paged) beside the engine",
                  flag_values=FLAGS)
flags.DEFINE_string("out", "results/engine_overhead.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)

PHASES = ("schedule", "inputs", "device", "output")


def run(*, batch_sizes: list[int], dtypes: list[str], tokens: int, prompt_len: int,
        repeats: int, peers: list[str], out: str, resume: bool = False, plain: bool = True,
        output_kind: str = "final",
        tensor_parallel_size: int = 1, data_parallel_size: int = 1,
        pad_heads: bool = False) -> list[dict]:
    """One row per (dtype, batch), appended to `out` as it is measured; the table from the
    file."""
    import dataclasses
    import functools
    import time

    import jax
    import numpy as np
    from tqdm import tqdm

    from experiments.common import (ResultLog, check_repeats, engine_devices,
                                    first_and_step_time, hf_greedy, load_hf_smollm2,
                                    markdown_table, measure_ceilings, one_engine, usable_peers)
    from experiments.workloads import consecutive_prompts, text_ids
    from infer.cache.budget import kv_bytes_per_token
    from infer.engine.buckets import window_bucket
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.engine import Engine, EngineConfig
    from infer.engine.simple_loop import PagedLayout, decode_stream
    from infer.sampling_params import SamplingParams

    if tokens < 4:
        raise ValueError(f"--tokens must be >= 4 (steps to time after the first), got {tokens}")
    check_repeats(repeats)
    devices = one_engine("engine_overhead", tensor_parallel_size=tensor_parallel_size,
                         data_parallel_size=data_parallel_size, pad_heads=pad_heads)
    split = not devices.parallel.is_single_device
    asked = [name for name, on in (("--noplain", plain),
                                   ("--peers=none", any(p != "none" for p in peers))) if on]
    if split and asked:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the plain loop and HF "
                         f"run on one device, so their ratios to a split engine would count "
                         f"the split as overhead; pass {' '.join(asked)} to time the engine "
                         f"alone")
    peers = usable_peers(peers, "engine_overhead")  # before any work
    log = ResultLog(out, resume=resume)
    ceilings = functools.cache(measure_ceilings)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=output_kind)

    def plain_steps(steps: DeviceSteps, prompts: list[list[int]], cache_dtype,
                    paged: PagedLayout | None = None) -> list[float]:
        stream = decode_stream(steps, prompts, [params] * len(prompts), tokens,
                               cache_dtype=cache_dtype, paged=paged)
        next(stream)  # the prefill
        last, gaps = time.perf_counter(), []
        for _ in stream:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return gaps[1:]  # the first decode step waited for the prefill too

    def engine_run(engine: Engine, prompts: list[list[int]], max_tokens: list[int]
                   ) -> tuple[list, list[int]]:
        """Runs the requests to the end: the engine's full-batch decode steps, and the tokens
        each request had when the first of them began. The engine prefills one request per
        step, between decode steps, so then the earlier requests are ahead."""
        ids = [engine.add_request(prompt_token_ids=p,
                                  params=dataclasses.replace(params, max_tokens=n))
               for p, n in zip(prompts, max_tokens)]
        since, ahead = engine.num_steps, None
        while engine.has_unfinished():
            engine.step()
            last = engine.records[-1]
            if ahead is None and last.kind == "decode" and last.decode_rows == len(prompts):
                ahead = [len(engine.output(i).token_ids) - 1 for i in ids]
        if ahead is None:
            raise RuntimeError("the engine's batch never ran whole: raise --tokens")
        return [r for r in engine.step_records(since)
                if r.kind == "decode" and r.decode_rows == len(prompts)], ahead

    def engine_steps(engine: Engine, prompts: list[list[int]], ahead: list[int]) -> list:
        # Each request ends `tokens - 1` steps after the batch first runs whole: all together,
        # as the plain loop's rows do.
        full, now_ahead = engine_run(engine, prompts, [n + tokens - 1 for n in ahead])
        if now_ahead != ahead or len(full) != tokens - 1:
            raise RuntimeError(f"the engine's ramp changed between runs ({now_ahead} tokens "
                               f"ahead, not {ahead}; {len(full)} full-batch decode steps)")
        return full[1:]  # the first waited for a prefill step, as the plain loop's first

    def measure(dtype: str, b: int, model, config, tokenizer, mesh,
                steps: DeviceSteps | None) -> dict:
        text = text_ids(tokenizer, 200_000)
        prompts = consecutive_prompts(text, b, prompt_len)
        model_len = prompt_len + tokens + 2 * b
        engine_config = EngineConfig(max_num_seqs=b, max_prefill_tokens=prompt_len,
                                     max_model_len=model_len)
        engine = Engine(model, tokenizer, engine_config, mesh=mesh)
        # The same engine waiting for each step's tokens before planning the next.
        sync = Engine(model, tokenizer,
                      dataclasses.replace(engine_config, async_scheduling=False),
                      runner=engine.runner, mesh=mesh)
        ahead = engine_run(engine, prompts, [tokens + 2 * b] * b)[1]
        if engine_run(sync, prompts, [tokens + 2 * b] * b)[1] != ahead:
            raise RuntimeError("the engine ramps up differently with async scheduling off")
        # The plain loop's row i starts where the engine's request i is when its batch first
        # runs whole (prompt and tokens so far), so each timed step of either reads the same
        # contexts. (Before 2026-12-06 every plain row started at --prompt_len, and the
        # engine's rows read up to 2 x batch tokens more.)
        lengths = [prompt_len + n - 1 for n in ahead]
        starts = np.cumsum([0, *lengths])
        plain_prompts = [text[s:e] for s, e in zip(starts[:-1], starts[1:])]
        if window_bucket(max(lengths) + tokens) != window_bucket(model_len):
            raise ValueError(f"at batch {b} the engine's sequences reach {model_len} tokens, "
                             f"an attention window above the plain loop's: lower --prompt_len "
                             f"or --tokens")
        cache_dtype = jax.numpy.dtype(dtype)
        paged = PagedLayout(kv_format=engine.config.kv_cache_dtype)
        if steps is not None:
            plain_steps(steps, plain_prompts, cache_dtype)  # compiles every shape the point uses
            plain_steps(steps, plain_prompts, cache_dtype, paged)
        engine_steps(engine, prompts, ahead)
        plain, plain_paged, records, sync_records = [], [], [], []
        for _ in range(repeats):  # interleaved, so drift in the machine's speed hits them all
            if steps is not None:
                plain += plain_steps(steps, plain_prompts, cache_dtype)
                plain_paged += plain_steps(steps, plain_prompts, cache_dtype, paged)
            records += engine_steps(engine, prompts, ahead)
            sync_records += engine_steps(sync, prompts, ahead)
        engine_ms = float(np.median([r.end_s - r.start_s for r in records])) * 1e3
        sync_ms = float(np.median([r.end_s - r.start_s for r in sync_records])) * 1e3
        row = {"engine_step_ms": engine_ms, "engine_sync_step_ms": sync_ms,
               "steps_timed": len(records), "engine_tok_s": b / engine_ms * 1e3,
               "engine_devices": engine_devices(engine),
               # Tokens a timed step's row attends to, on average (the same on both loops).
               "mean_context": float(np.mean(lengths)) + tokens / 2}
        if steps is not None:
            plain_ms = float(np.median(plain)) * 1e3
            paged_ms = float(np.median(plain_paged)) * 1e3
            row |= {"plain_step_ms": plain_ms, "plain_paged_step_ms": paged_ms,
                    "engine_over_plain": engine_ms / plain_ms,
                    "engine_sync_over_plain": sync_ms / plain_ms,
                    "engine_over_plain_paged": engine_ms / paged_ms}
        if "hf" in peers:
            # Rows of equal length (HF pads a ragged batch), the plain rows' mean: as many
            # tokens to attend to in a step.
            hf_prompts = consecutive_prompts(text, b, round(float(np.mean(lengths))))
            _, hf_step = first_and_step_time(lambda n: hf_greedy(hf, hf_prompts, n), tokens,
                                             repeats)
            row |= {"hf_step_ms": hf_step * 1e3, "engine_vs_hf": hf_step * 1e3 / engine_ms}
        # Means, not medians: the means of a step's parts add up to the mean step (medians of
        # parts need not add up to anything), so what is left over is the unsplit rest.
        mean_ms = float(np.mean([r.end_s - r.start_s for r in records])) * 1e3
        row["engine_step_mean_ms"] = mean_ms
        for phase in PHASES:
            row[f"{phase}_ms"] = float(np.mean([getattr(r, f"{phase}_s") for r in records])) * 1e3
        row["other_ms"] = mean_ms - sum(row[f"{p}_ms"] for p in PHASES)
        if split:
            # Per device the floor is its shard over its own bandwidth, or all bytes over a
            # shared one (CPU virtual devices): one device's copy does not say which.
            return row
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.device_steps.params))
        kv_read = (sum(lengths) + b * tokens / 2) * kv_bytes_per_token(config, dtype)
        floor_ms = (weight_bytes + kv_read) / ceilings()["copy_bandwidth_Bps"] * 1e3
        # The same bytes at the rate memory serves reads alone: what a step could reach.
        read_floor_ms = (weight_bytes + kv_read) / ceilings()["read_bandwidth_Bps"] * 1e3
        row |= {"bytes_per_step": weight_bytes + kv_read, "floor_step_ms": floor_ms,
                "engine_of_floor": floor_ms / engine_ms, "read_floor_step_ms": read_floor_ms,
                "engine_of_read_floor": read_floor_ms / engine_ms, **ceilings()}
        if steps is not None:
            row["plain_of_floor"] = floor_ms / row["plain_step_ms"]
            row["plain_of_read_floor"] = read_floor_ms / row["plain_step_ms"]
        return row

    # A run without the plain loops is another point: its rows hold fewer numbers.
    point = {**devices.point, **({} if plain else {"plain": False})}
    for dtype in dtypes:
        config, model, tokenizer, mesh = devices.load(dtype)
        steps = DeviceSteps(model) if plain else None
        hf = load_hf_smollm2(dtype) if "hf" in peers else None
        for b in tqdm(batch_sizes, desc=f"{dtype} batch sizes"):
            log.measure({"experiment": "engine_overhead", "model": config.name, "dtype": dtype,
                         "batch": b, "prompt_len": prompt_len, "tokens": tokens,
                         "repeats": repeats, "output_kind": output_kind, **point},
                        lambda b=b: measure(dtype, b, model, config, tokenizer, mesh, steps))
    rows = log.rows()
    if "copy_bandwidth_Bps" in rows[0]:
        print(f"\ncopy bandwidth {rows[0]['copy_bandwidth_Bps'] / 1e9:.1f} GB/s, read bandwidth "
              f"{rows[0].get('read_bandwidth_Bps', float('nan')) / 1e9:.1f} GB/s (this run)")
    print(markdown_table(rows, [("dtype", "dtype"), ("batch", "batch"),
                                ("plain_step_ms", "plain ms"),
                                ("plain_paged_step_ms", "plain paged ms"),
                                ("engine_step_ms", "engine ms"),
                                ("engine_over_plain", "engine / plain"),
                                ("engine_over_plain_paged", "engine / plain paged"),
                                ("engine_sync_over_plain", "no async: engine / plain"),
                                ("schedule_ms", "schedule ms"), ("inputs_ms", "inputs ms"),
                                ("device_ms", "device ms"), ("output_ms", "output ms"),
                                ("floor_step_ms", "floor ms"),
                                ("engine_of_floor", "engine of floor"),
                                ("engine_of_read_floor", "engine of read floor"),
                                ("hf_step_ms", "HF ms"), ("engine_vs_hf", "engine × HF")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
