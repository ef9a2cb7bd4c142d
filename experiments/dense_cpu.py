"""The CPU dense kernel (`kernels_cpu/dense.py`) against XLA:CPU's product, on SmolLM2's weights'
shapes, per layout, dtype and row count.

  python -m experiments.dense_cpu --rows=1,2,3,4,5,8

Three workloads, each one jitted program timed whole (median of --repeats timings of --calls
calls, the kernel, XLA and any --variants taking turns), so that weights stream from memory as
in a decode step rather than sit in cache:
- "kn": a chain of --layers MLP-sized products, x [M, 576] x [576, 1536], then [M, 1536] x
  [1536, 576], with a tanh between and a residual add (the model's projections, stored
  [in, out]);
- "nk": the tied vocabulary projection, [M, 576] x [49152, 576]^T;
- "layer": --layers decoder layers' seven [in, out] products (query, key, value, output, gate,
  up, down; attention left out), the query/key/value and gate/up products grouped in one
  kernel call each as the model's `dense_group` does them; also timed as seven separate
  kernel calls ("kernel_ungrouped"), for what grouping is worth.
Where the kernel multiplies on AMX tiles (`kernels_cpu.dense.packs`), the kn and layer chains
are also timed with their weights stored in the tiles' layout ("kernel_packed": the weights as
the engine holds them there).
XLA's side is what `infer.model.llama.dense` does without the kernel (`xla_dense`: `jnp.einsum`
with float32 accumulation, one-row 16-bit products padded to two rows, float32 [N, K] products
of 2-8 rows as a multiply-and-reduce). Prints ms per call and the weight
bytes read per second; writes one JSON line per point to results/dense_cpu.jsonl.
`kernels_cpu.dense.ROWS`, the row counts `dense` hands the kernel, comes from this table.
"""

from __future__ import annotations

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
# Builds of the kernel with a part turned off, for what that part is worth (`--variants`).
VARIANTS = {"no_line_walk": ("-DINFER_DENSE_NO_LINE_WALK",),
            "no_amx": ("-DINFER_DENSE_NO_AMX",),
            "no_pack_ahead": ("-DINFER_DENSE_NO_PACK_AHEAD",)}
flags.DEFINE_list("rows", ["1", "2", "3", "4", "5", "8"], "activation rows M", flag_values=FLAGS)
validate_list_flag(FLAGS, "rows", lower_bound=1)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes", flag_values=FLAGS)
flags.DEFINE_list("layouts", ["kn", "nk"], "workloads: weight layouts kn and nk, or layer",
                  flag_values=FLAGS)
flags.DEFINE_integer("layers", 30, "layers in the kn and layer chains (SmolLM2 has 30)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("calls", 10, "calls per timing", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timings per point (the median is reported)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("variants", [], "builds of the kernel timed beside it, by name: "
                  + ", ".join(f"{k} ({' '.join(v)})" for k, v in VARIANTS.items()),
                  flag_values=FLAGS)
flags.DEFINE_string("out", "results/dense_cpu.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")

EMBED, FFN, VOCAB, KV = 576, 1536, 49152, 192


def run(*, rows: list[int], dtypes: list[str], layouts: list[str], layers: int, calls: int,
        repeats: int, out: str, variants: list[str] = ()) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.common import ResultLog, interleaved_medians, markdown_table
    from infer.model.llama import xla_dense
    from kernels_cpu import dense as dense_cpu

    if not dense_cpu.available():
        raise SystemExit("the CPU dense kernel is not available on this machine (see above)")

    # Every side as products of x with a group of weights, -> one output per weight.
    def xla(x, ws, layout):
        return tuple(xla_dense(x, w, "mk,nk->mn" if layout == "nk" else "mk,kn->mn") for w in ws)

    def kernel(x, ws, layout):
        return dense_cpu.multiply_group(x, ws, layout)

    def ungrouped(x, ws, layout):
        return tuple(dense_cpu.multiply(x, w, layout) for w in ws)

    def build(flags_):
        target = dense_cpu.KERNEL.register(flags_)
        return lambda x, ws, layout: dense_cpu._call(x, ws, layout, target)

    if set(layouts) - {"kn", "nk", "layer"}:
        raise SystemExit(f"--layouts are kn, nk and layer, got {layouts}")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    builds = {"kernel": kernel, "xla": xla, **{v: build(VARIANTS[v]) for v in variants}}

    # Each program takes the weights as stored and packed (None where nothing is packed), and
    # multiplies by those it is for.
    def chain(product, use_packed=False):
        def fn(x, weights, packed):
            for up, down in packed if use_packed else weights:
                (hidden,) = product(x.astype(up.dtype), (up,), "kn")
                (out,) = product(jnp.tanh(hidden).astype(down.dtype), (down,), "kn")
                x = x + out
            return x
        return jax.jit(fn)

    def layer_chain(product, use_packed=False):
        def fn(x, weights, packed):
            for q, k, v, o, gate, up, down in packed if use_packed else weights:
                qo, ko, vo = product(x.astype(q.dtype), (q, k, v), "kn")
                # A stand-in for attention that needs all three: no product may be skipped.
                mixed = qo + 1e-3 * (ko.sum(-1, keepdims=True) + vo.sum(-1, keepdims=True))
                (attn,) = product(jnp.tanh(mixed).astype(o.dtype), (o,), "kn")
                x = x + attn
                g, u = product(x.astype(gate.dtype), (gate, up), "kn")
                (mlp,) = product((jax.nn.silu(g) * u).astype(down.dtype), (down,), "kn")
                x = x + mlp
            return x
        return jax.jit(fn)

    def vocab(product):
        return jax.jit(lambda x, w: product(x.astype(w.dtype), (w,), "nk")[0])

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
                programs = {name: chain(product) for name, product in builds.items()}
                nbytes = layers * 2 * EMBED * FFN * dtype.itemsize
            elif layout == "layer":
                shapes = [(EMBED, EMBED), (EMBED, KV), (EMBED, KV), (EMBED, EMBED), (EMBED, FFN),
                          (EMBED, FFN), (FFN, EMBED)]
                weights = [tuple(weight(shape, shape[0] ** -0.5) for shape in shapes)
                           for _ in range(layers)]
                programs = {name: layer_chain(product) for name, product in
                            {**builds, "kernel_ungrouped": ungrouped}.items()}
                nbytes = layers * sum(a * b for a, b in shapes) * dtype.itemsize
            else:
                weights = weight((VOCAB, EMBED), EMBED ** -0.5)
                programs = {name: vocab(product) for name, product in builds.items()}
                nbytes = VOCAB * EMBED * dtype.itemsize
            args = (weights,)
            extra = []  # sides beside the builds this workload has
            if layout == "layer":
                extra.append("kernel_ungrouped")
            if layout != "nk" and all(dense_cpu.packs(w) for group in weights for w in group):
                for name in ["kernel", *variants]:  # each build on the packed weights too
                    programs[f"{name}_packed"] = (chain if layout == "kn" else layer_chain)(
                        builds[name], use_packed=True)
                    extra.append(f"{name}_packed")
                args = (weights, [tuple(dense_cpu.pack(w) for w in group) for group in weights])
            elif layout != "nk":
                args = (weights, None)
            for m in map(int, rows):
                x = jnp.asarray(rng.standard_normal((m, EMBED), np.float32))
                row = {"experiment": "dense_cpu", "layout": layout, "dtype": dtype_name,
                       "rows": m, "layers": 1 if layout == "nk" else layers,
                       "weight_mb": nbytes / 1e6, "calls": calls, "repeats": repeats}
                for name, s in interleaved_medians(programs, (x, *args), repeats, calls).items():
                    ms = 1e3 * s
                    row[f"{name}_ms"] = ms
                    row[f"{name}_gb_s"] = nbytes / ms / 1e6
                row["kernel_speedup"] = row["xla_ms"] / row["kernel_ms"]
                for v in [*variants, *extra]:
                    # > 1: what the part that build leaves out is worth (on packed weights:
                    # against the kernel on them)
                    base = "kernel_packed" if v.endswith("_packed") and v != "kernel_packed" \
                        else "kernel"
                    row[f"{v}_over_{base}"] = row[f"{v}_ms"] / row[f"{base}_ms"]
                row["dense_takes_kernel"] = m in dense_cpu.ROWS.get(
                    ("kn" if layout == "layer" else layout, dtype), ())
                log.append(row)
                table.append(row)
            del weights
    print(markdown_table(table, [("layout", "layout"), ("dtype", "dtype"), ("rows", "M"),
                                 ("kernel_ms", "kernel ms"), ("kernel_gb_s", "kernel GB/s"),
                                 ("xla_ms", "XLA ms"), ("xla_gb_s", "XLA GB/s"),
                                 ("kernel_speedup", "XLA / kernel"),
                                 *[(key, key.replace("_over_", " / ")) for key in dict.fromkeys(
                                     k for r in table for k in r if "_over_kernel" in k)],
                                 ("dense_takes_kernel", "dense uses the kernel")]))
    return table


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
