"""The CPU dense kernel (`kernels_cpu/dense.py`) against XLA:CPU's product, on SmolLM2's weights'
shapes, per layout, dtype and row count.

  python -m experiments.dense_cpu --rows=1,2,3,4,5,8

Two workloads, each one jitted program timed whole (median of --repeats timings of --calls
calls), so that weights stream from memory as in a decode step rather than sit in cache:
- "kn": a chain of --layers MLP-sized products, x [M, 576] x [576, 1536], then [M, 1536] x
  [1536, 576], with a tanh between and a residual add (the model's projections, stored
  [in, out]);
- "nk": the tied vocabulary projection, [M, 576] x [49152, 576]^T.
XLA's side is what `infer.model.llama.dense` does without the kernel (`xla_dense`: `jnp.einsum`
with float32 accumulation, one-row 16-bit products padded to two rows, float32 [N, K] products
of 2-8 rows as a multiply-and-reduce). Prints ms per call and the weight
bytes read per second; writes one JSON line per point to results/dense_cpu.jsonl.
`kernels_cpu.dense.ROWS`, the row counts `dense` hands the kernel, comes from this table.
"""

from __future__ import annotations

import time

from absl import flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("rows", ["1", "2", "3", "4", "5", "8"], "activation rows M", flag_values=FLAGS)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes", flag_values=FLAGS)
flags.DEFINE_list("layouts", ["kn", "nk"], "weight layouts", flag_values=FLAGS)
flags.DEFINE_integer("layers", 30, "MLP layers in the kn chain (SmolLM2 has 30)",
                     flag_values=FLAGS)
flags.DEFINE_integer("calls", 10, "calls per timing", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timings per point (the median is reported)",
                     flag_values=FLAGS)
flags.DEFINE_string("out", "results/dense_cpu.jsonl", "JSONL output", flag_values=FLAGS)

EMBED, FFN, VOCAB = 576, 1536, 49152


def run(*, rows: list[int], dtypes: list[str], layouts: list[str], layers: int, calls: int,
        repeats: int, out: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.common import ResultLog, markdown_table
    from infer.model.llama import xla_dense
    from kernels_cpu import dense as dense_cpu

    if not dense_cpu.available():
        raise SystemExit("the CPU dense kernel is not available on this machine (see above)")

    def xla(x, w, layout):
        return xla_dense(x, w, "mk,nk->mn" if layout == "nk" else "mk,kn->mn")

    def kernel(x, w, layout):
        return dense_cpu.multiply(x, w, layout)

    def chain(product):
        def fn(x, weights):
            for up, down in weights:
                hidden = jnp.tanh(product(x.astype(up.dtype), up, "kn"))
                x = x + product(hidden.astype(down.dtype), down, "kn")
            return x
        return jax.jit(fn)

    def vocab(product):
        return jax.jit(lambda x, w: product(x.astype(w.dtype), w, "nk"))

    def timed(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                result = fn(*args)
            jax.block_until_ready(result)
            times.append((time.perf_counter() - start) / calls)
        return 1e3 * float(np.median(times))

    rng = np.random.default_rng(0)
    log = ResultLog(out)
    table = []
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)

        def weight(shape, scale):
            return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dtype)

        for layout in layouts:
            if layout == "kn":
                weights = [(weight((EMBED, FFN), EMBED ** -0.5), weight((FFN, EMBED), FFN ** -0.5))
                           for _ in range(layers)]
                programs = {"kernel": chain(kernel), "xla": chain(xla)}
                args = (weights,)
                nbytes = layers * 2 * EMBED * FFN * dtype.itemsize
            else:
                weights = weight((VOCAB, EMBED), EMBED ** -0.5)
                programs = {"kernel": vocab(kernel), "xla": vocab(xla)}
                args = (weights,)
                nbytes = VOCAB * EMBED * dtype.itemsize
            for m in map(int, rows):
                x = jnp.asarray(rng.standard_normal((m, EMBED), np.float32))
                row = {"experiment": "dense_cpu", "layout": layout, "dtype": dtype_name,
                       "rows": m, "layers": layers if layout == "kn" else 1,
                       "weight_mb": nbytes / 1e6, "calls": calls, "repeats": repeats}
                for name, fn in programs.items():
                    ms = timed(fn, x, *args)
                    row[f"{name}_ms"] = ms
                    row[f"{name}_gb_s"] = nbytes / ms / 1e6
                row["kernel_speedup"] = row["xla_ms"] / row["kernel_ms"]
                row["dense_takes_kernel"] = m in dense_cpu.ROWS.get((layout, dtype), ())
                log.append(row)
                table.append(row)
            del weights
    print(markdown_table(table, [("layout", "layout"), ("dtype", "dtype"), ("rows", "M"),
                                 ("kernel_ms", "kernel ms"), ("kernel_gb_s", "kernel GB/s"),
                                 ("xla_ms", "XLA ms"), ("xla_gb_s", "XLA GB/s"),
                                 ("kernel_speedup", "XLA / kernel"),
                                 ("dense_takes_kernel", "dense uses the kernel")]))
    return table


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
