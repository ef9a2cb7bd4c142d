"""What drawing a sampled token costs: the sampler's inverse-CDF draw against Gumbel-max.

  python -m experiments.sampler_cost --batch_sizes=1,8,32,64

Times, per batch size, one jitted call that draws a token per row from softmax(logits / T) over
SmolLM2's vocabulary (49,152 ids): `infer.sampling.inverse_cdf_draw` (one uniform per row
against the running sum of the probabilities, the sampler's draw) and `jax.random.categorical`
(Gumbel-max: a uniform per id, the draw it replaced), in the same run, median of `--repeats`
timings of `--calls` calls each. Also the greedy argmax, the floor of any sampler. Writes one
JSON line per batch size to results/sampler_cost.jsonl.
"""

from __future__ import annotations

import time

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "rows drawn per call", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1)
flags.DEFINE_integer("vocab_size", 49152, "ids per row (SmolLM2's vocabulary)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.7, "temperature of the logits", flag_values=FLAGS)
# The logits are divided by it: 0 would time draws over infinite logits.
flags.register_validator("temperature", lambda t: t > 0, "--temperature must be > 0",
                         flag_values=FLAGS)
flags.DEFINE_integer("calls", 20, "calls per timing", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timings per point (the median is reported)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_string("out", "results/sampler_cost.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")


def run(*, batch_sizes: list[int], vocab_size: int, temperature: float, calls: int,
        repeats: int, out: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.common import ResultLog, markdown_table
    from infer.sampling import argmax, inverse_cdf_draw, token_keys

    draws = {"inverse_cdf": jax.jit(inverse_cdf_draw),
             "gumbel_max": jax.jit(jax.vmap(jax.random.categorical)),
             "greedy_argmax": jax.jit(lambda keys, logits: argmax(logits))}
    log = ResultLog(out)
    rows = []
    for batch in map(int, batch_sizes):
        logits = jnp.asarray(np.random.default_rng(batch).standard_normal(
            (batch, vocab_size)).astype(np.float32) * 3 / temperature)
        keys = token_keys(jnp.arange(batch, dtype=jnp.uint32), jnp.zeros(batch, jnp.int32))
        row = {"experiment": "sampler_cost", "batch": batch, "vocab_size": vocab_size,
               "temperature": temperature, "calls": calls, "repeats": repeats}
        for name, fn in draws.items():
            fn(keys, logits).block_until_ready()  # compile
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    out_tokens = fn(keys, logits)
                out_tokens.block_until_ready()
                times.append((time.perf_counter() - start) / calls)
            row[f"{name}_ms"] = 1e3 * float(np.median(times))
        row["gumbel_over_inverse_cdf"] = row["gumbel_max_ms"] / row["inverse_cdf_ms"]
        log.append(row)
        rows.append(row)
    print(markdown_table(rows, [("batch", "B"), ("inverse_cdf_ms", "inverse CDF ms"),
                                ("gumbel_max_ms", "Gumbel-max ms"),
                                ("gumbel_over_inverse_cdf", "ratio"),
                                ("greedy_argmax_ms", "argmax ms")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
