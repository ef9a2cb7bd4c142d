"""What structured output costs per decode step: the engine decoding the same prompts with no
constraint, under a JSON schema and under a regex, same batch, lengths and run, on SmolLM2.

  python -m experiments.structured_cost --batch_sizes=1,8 --tokens=48

Each constraint is made so that it cannot complete within `--tokens` tokens (a string longer
than that many of the vocabulary's longest token spell), so every run decodes the same number of
steps. A step's time is
the median over the full-batch decode steps of every repeat (`StepRecord.end_s - start_s`);
its phases are means, as in `experiments.engine_overhead`. The mask's two costs show apart:
the host fills the constrained rows' bitmask while building the step's inputs (`inputs_ms`;
`fill_ms` times llguidance's fill of a step's rows alone, replayed along the tokens the run
produced), and the device applies it in the step (`device_ms`). A constrained step is also
never planned ahead (its mask needs the token in flight), so what async scheduling hid comes
back into the step: `planned_ahead` is the share of steps that were, and the unconstrained
run is timed a second time without async scheduling (the same runner), the baseline that
leaves the mask's own cost (`× none, no async`).

--tensor_parallel_size=T runs the engine on a mesh of T devices (--pad_heads as in `LLM`);
--data_parallel_size is refused: the experiment times one engine's steps.
"""

from __future__ import annotations

from typing import Any

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from infer.parallel.flags import define_parallel_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("batch_sizes", ["1", "8"], "decode batch sizes", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1)
flags.DEFINE_list("constraints", ["none", "json", "regex"], "constraints to time",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "constraints", choices=["none", "json", "regex"])
# At least 4: steps to time after the first (run checks it too).
flags.DEFINE_integer("tokens", 48, "tokens generated per request", lower_bound=4,
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per request", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "timed runs per point", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "run on the model's first N layers only (0: all); for quick "
                     "checks, the figures are the full model's", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("out", "results/structured_cost.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)

PHASES = ("schedule", "inputs", "device", "output")


def constraint_for(kind: str, tokens: int, longest_token: int = 16):
    """A constraint of `kind` that `tokens` tokens of at most `longest_token` characters each
    (`longest_token_chars`) cannot complete; None for "none"."""
    from infer.sampling_params import StructuredOutput

    least = longest_token * tokens + 1  # characters: more than `tokens` tokens can spell
    if kind == "none":
        return None
    if kind == "json":
        return StructuredOutput(json={
            "type": "object", "required": ["title", "body"],
            "properties": {"title": {"type": "string", "maxLength": 40},
                           "body": {"type": "string", "minLength": least}}})
    if kind == "regex":
        return StructuredOutput(regex=f"[A-Za-z ,.]{{{least},}}")
    raise ValueError(f"unknown constraint {kind!r}: none, json or regex")


def longest_token_chars(tokenizer: Any, vocab_size: int) -> int:
    """The most characters one token of the vocabulary decodes to (SmolLM2: 81, a run of 64
    spaces among them), what bounds the text `tokens` tokens can spell."""
    return max(len(tokenizer.decode([i])) for i in range(vocab_size))


def run(*, batch_sizes: list[int], constraints: list[str], tokens: int, prompt_len: int,
        repeats: int, layers: int, out: str, resume: bool = False,
        tensor_parallel_size: int = 1, data_parallel_size: int = 1,
        pad_heads: bool = False) -> list[dict]:
    """One row per (batch, constraint), and one for no constraint without async scheduling,
    appended to `out` as each is measured."""
    import dataclasses
    import time

    import numpy as np
    from tqdm import tqdm

    from experiments.common import (ResultLog, check_repeats, engine_devices, markdown_table,
                                    one_engine)
    from experiments.workloads import consecutive_prompts, text_ids
    from infer.engine.engine import Engine, EngineConfig
    from infer.io.loader import load_on_host
    from infer.sampling_params import SamplingParams
    from infer.spec.draft_model import self_draft
    from infer.structured import fill_bitmask, mask_words

    specs = {kind: constraint_for(kind, tokens) for kind in constraints}  # checks them first
    if tokens < 4:
        raise ValueError(f"--tokens must be >= 4 (steps to time after the first), got {tokens}")
    check_repeats(repeats)  # 0 would write rows of NaN medians
    devices = one_engine("structured_cost", tensor_parallel_size=tensor_parallel_size,
                         data_parallel_size=data_parallel_size, pad_heads=pad_heads)
    log = ResultLog(out, resume=resume)
    config, host_model, tokenizer = load_on_host(devices.model, "float32")
    # Sized by the vocabulary's longest token: "16 characters a token" let a JSON body of
    # 64-space tokens close within 21 of SmolLM2's tokens.
    longest = longest_token_chars(tokenizer, config.vocab_size)
    specs = {kind: constraint_for(kind, tokens, longest) for kind in constraints}
    # Sliced before placement: only the layers kept go to (and split over) the mesh.
    model, mesh = devices.place(self_draft(host_model, layers) if layers else host_model)
    ids = text_ids(tokenizer, 200_000)

    def engine_run(engine: Engine, prompts: list[list[int]], spec) -> tuple[list, list]:
        # The engine prefills one request per step first: decode past that ramp.
        params = SamplingParams(max_tokens=tokens + 2 * len(prompts), ignore_eos=True,
                                structured=spec)
        rids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
        since = engine.num_steps
        outputs = {o.request_id: o for o in engine.stream() if o.finished}
        records = [r for r in engine.step_records(since)
                   if r.kind == "decode" and r.decode_rows == len(prompts)]
        return records, [outputs[r] for r in rids]

    def fill_times(engine: Engine, spec, outputs: list) -> list[float]:
        """llguidance's fill of a step's constrained rows (one call, as the runner makes it),
        replayed along the outputs' tokens: one time per step, for the outputs of one run."""
        times = []
        for start in range(0, len(outputs), b):
            run_outputs = outputs[start:start + b]
            constraints = [engine.make_request(prompt_token_ids=[0], params=SamplingParams(
                structured=spec, max_tokens=1)).constraint for _ in run_outputs]
            mask = np.zeros((len(run_outputs), mask_words(config.vocab_size)), np.int32)
            for step in range(min(len(o.token_ids) for o in run_outputs)):
                begin = time.perf_counter()
                fill_bitmask(list(enumerate(constraints)), mask)
                times.append(time.perf_counter() - begin)
                for constraint, o in zip(constraints, run_outputs):
                    constraint.consume(o.token_ids[step])
        return times

    for b in tqdm(batch_sizes, desc="batch sizes"):
        prompts = consecutive_prompts(ids, b, prompt_len)
        engine_config = EngineConfig(max_num_seqs=b, max_prefill_tokens=prompt_len,
                                     max_model_len=prompt_len + tokens + 2 * b)
        engine = Engine(model, tokenizer, engine_config, mesh=mesh)
        # A constrained step is never planned ahead: the same runner without async scheduling
        # is the baseline that isolates the mask's own cost.
        sync = Engine(model, tokenizer, dataclasses.replace(engine_config,
                                                            async_scheduling=False),
                      runner=engine.runner, mesh=mesh)
        runs = [(kind, spec, engine, True) for kind, spec in specs.items()]
        if "none" in specs:
            runs.append(("none", None, sync, False))
        for _, spec, eng, _ in runs:
            engine_run(eng, prompts, spec)  # compiles every program the point uses
        timed = [([], []) for _ in runs]
        for _ in range(repeats):  # interleaved, so drift in the machine's speed hits all
            for (kind, spec, eng, _), (records, outputs) in zip(runs, timed):
                got_records, got_outputs = engine_run(eng, prompts, spec)
                records.extend(got_records)
                outputs.extend(got_outputs)
        for (kind, spec, eng, planned), (records, outputs) in zip(runs, timed):

            def measure(records=records, outputs=outputs, spec=spec, eng=eng) -> dict:
                step_ms = float(np.median([r.end_s - r.start_s for r in records])) * 1e3
                row = {"step_ms": step_ms, "steps_timed": len(records),
                       "planned_ahead": float(np.mean([r.planned_ahead for r in records])),
                       "tok_s": b / step_ms * 1e3, "engine_devices": engine_devices(eng)}
                for phase in PHASES:
                    row[f"{phase}_ms"] = float(np.mean([getattr(r, f"{phase}_s")
                                                        for r in records])) * 1e3
                if spec is not None:
                    fills = fill_times(eng, spec, outputs)
                    row |= {"fill_ms": float(np.median(fills)) * 1e3,
                            "fill_ms_p99": float(np.percentile(fills, 99)) * 1e3,
                            "finished_by_length": all(o.finish_reason.value == "length"
                                                      for o in outputs)}
                return row

            point = {"experiment": "structured_cost", "model": config.name,
                     "layers": layers or config.num_layers, "batch": b, "constraint": kind,
                     "tokens": tokens, "prompt_len": prompt_len, "repeats": repeats,
                     **devices.point}
            if not planned:
                point["async_scheduling"] = False
            log.measure(point, measure)
    rows = log.rows()
    for r in rows:
        r["async"] = r.get("async_scheduling", True)
    bases = {(r["batch"], r["async"]): r["step_ms"] for r in rows if r["constraint"] == "none"}
    for r in rows:
        if (r["batch"], True) in bases:
            r["over_unconstrained"] = r["step_ms"] / bases[r["batch"], True]
        if (r["batch"], False) in bases:
            r["over_unconstrained_sync"] = r["step_ms"] / bases[r["batch"], False]
    print(markdown_table(rows, [("batch", "batch"), ("constraint", "constraint"),
                                ("async", "async"), ("step_ms", "step ms"),
                                ("over_unconstrained", "× none"),
                                ("over_unconstrained_sync", "× none, no async"),
                                ("schedule_ms", "schedule ms"), ("inputs_ms", "inputs ms"),
                                ("device_ms", "device ms"), ("output_ms", "output ms"),
                                ("fill_ms", "fill ms/step"), ("fill_ms_p99", "fill p99 ms"),
                                ("planned_ahead", "planned ahead")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
