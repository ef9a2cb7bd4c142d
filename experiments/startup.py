"""Start-up cost of `LLM(...)`: what a user waits for before the first token, compiling lazily
(each program at its first use, announced) or ahead (`warmup=True`), with JAX's persistent
compilation cache cold (a fresh directory) and warm (a second process on the same directory).
Each process then builds a second `LLM` over the same weights twice: with the programs the first
traced dropped ("rebuilt": re-traced, loaded from the caches) and with them kept ("shared",
`infer.model.programs`).

  python -m experiments.startup --max_num_seqs=32 --max_model_len=2048

Each measurement runs in a fresh process, so nothing compiled by an earlier one is in memory.
"""

from __future__ import annotations

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag
from infer.parallel.flags import define_parallel_flags

MODES = ("lazy", "warmup")  # the child compiles ahead for "warmup", lazily for anything else

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("modes", ["lazy", "warmup"], "lazy: compile at first use; warmup: in LLM()",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "modes", choices=MODES)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights", flag_values=FLAGS)
flags.DEFINE_integer("max_num_seqs", 32, "batch slots (LLM's default)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_model_len", 2048, "longest sequence (LLM's default)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 16, "tokens of each timed generate call", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_string("out", "results/startup.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)
define_parallel_flags(FLAGS)

# What one measurement runs, in its own process; it prints one JSON line.
_CHILD = """
import json, sys, time
from infer.platform import CompileCounter, configure_xla_cpu, enable_compilation_cache
configure_xla_cpu()
enable_compilation_cache(sys.argv[1])
from infer import LLM, SamplingParams
mode, dtype, seqs, model_len, tokens = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
parallel = json.loads(sys.argv[7])
params = SamplingParams(max_tokens=tokens, seed=0, ignore_eos=True)
with CompileCounter() as compiled:
    start = time.perf_counter()
    llm = LLM(model="smollm2-135m", dtype=dtype, max_num_seqs=seqs, max_model_len=model_len,
              warmup=mode == "warmup", **parallel)
    built = time.perf_counter()
    llm.generate(["The capital of France is"], params)
    first = time.perf_counter()
    llm.generate(["The capital of France is"], params)
    second = time.perf_counter()
row = {"llm_s": built - start, "first_generate_s": first - built,
       "second_generate_s": second - first, "programs": compiled.count}
# A second LLM over the same weights in this process: first without the programs the first one
# traced (cleared: how every engine started before they were shared), then with them.
import gc
from infer.model.programs import PROGRAMS
for name in ("rebuilt", "shared"):
    del llm
    gc.collect()
    if name == "rebuilt":
        PROGRAMS.clear()
    with CompileCounter() as compiled:
        start = time.perf_counter()
        llm = LLM(model="smollm2-135m", dtype=dtype, max_num_seqs=seqs,
                  max_model_len=model_len, warmup=mode == "warmup", **parallel)
        built = time.perf_counter()
        llm.generate(["The capital of France is"], params)
    row |= {f"{name}_llm_s": built - start, f"{name}_first_generate_s": time.perf_counter() - built,
            f"{name}_programs": compiled.count}
print(json.dumps(row))
"""


def run(*, modes: list[str], dtype: str, max_num_seqs: int, max_model_len: int,
        max_tokens: int, out: str, resume: bool = False, tensor_parallel_size: int = 1,
        data_parallel_size: int = 1, pad_heads: bool = False,
        dp_routing: str = "least_loaded") -> list[dict]:
    """Rows per (mode, cache): seconds in LLM(), in the first generate call and in a second one,
    and the programs made executable; then the same for a second LLM in the process, rebuilt and
    shared; the table from the file."""
    import json
    import subprocess
    import sys
    import tempfile

    from experiments.common import ResultLog, markdown_table

    parallel = dict(tensor_parallel_size=tensor_parallel_size,
                    data_parallel_size=data_parallel_size, pad_heads=pad_heads,
                    dp_routing=dp_routing)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; want {', '.join(MODES)}")
    # One-device points keep the keys they had before the parallel flags (and --resume).
    point_parallel = {} if tensor_parallel_size == data_parallel_size == 1 else parallel
    log = ResultLog(out, resume=resume)
    for mode in modes:
        with tempfile.TemporaryDirectory() as cache_dir:
            for cache in ("cold", "warm"):  # the second process finds the first one's programs
                def measure() -> dict:
                    done = subprocess.run(
                        [sys.executable, "-c", _CHILD, cache_dir, mode, dtype, str(max_num_seqs),
                         str(max_model_len), str(max_tokens), json.dumps(parallel)],
                        capture_output=True, text=True)
                    if done.returncode:  # the child's own error, not its script's text
                        raise RuntimeError(
                            f"the {mode} measurement ({cache} cache) failed with exit status "
                            f"{done.returncode}:\n" + "\n".join(done.stderr.splitlines()[-20:]))
                    return json.loads(done.stdout.strip().splitlines()[-1])
                log.measure({"experiment": "startup", "mode": mode, "cache": cache,
                             "dtype": dtype, "max_num_seqs": max_num_seqs,
                             "max_model_len": max_model_len, "max_tokens": max_tokens,
                             **point_parallel}, measure)
    rows = log.rows()
    print(markdown_table(rows, [("mode", "mode"), ("cache", "compilation cache"),
                                ("llm_s", "LLM() s"), ("first_generate_s", "first generate s"),
                                ("second_generate_s", "second generate s"),
                                ("programs", "programs"),
                                ("rebuilt_llm_s", "2nd LLM() s, rebuilt"),
                                ("rebuilt_first_generate_s", "its first generate s"),
                                ("shared_llm_s", "2nd LLM() s, shared"),
                                ("shared_first_generate_s", "its first generate s"),
                                ("shared_programs", "programs (shared)")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
