"""The CPU paged-attention kernel (`kernels_cpu/attention.py`) against the attention the paged
cache runs without it (`kernels_cpu.attention.reference`: every row's pages of the window
gathered into a contiguous copy, unseen slots masked, two products), on SmolLM2's attention
shapes (9 query heads over 3 KV heads of 64), per dtype, batch, context and new tokens a row.

  python -m experiments.attention_cpu --batch_sizes=1,8,32 --contexts=64,256,1024 --queries=1,5

Each point is one jitted program per side (median of --repeats timings of --calls calls, the
two taking turns) over --layers layers, each with its own page pool (so keys and
values stream from memory as in a step, not from cache), pages in a random order, every row
holding `context` tokens of which the last `queries` are new (1: decode; k + 1: a verify step;
a whole prompt's count: its prefill chunk, e.g. --batch_sizes=1 --contexts=32,128
--queries=32,128). The window (page-table width) is the context rounded up to a power of two of
at least 128 tokens, as the engine's gathered path has it. Prints ms per layer and the bytes of
visible keys and values read per second; writes one JSON line per point to
results/attention_cpu.jsonl.
"""

from __future__ import annotations

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "rows", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1)
flags.DEFINE_list("contexts", ["64", "256", "1024"], "tokens a row holds after the step",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "contexts", lower_bound=1)
flags.DEFINE_list("queries", ["1", "5"], "new tokens a row (1: decode, k + 1: verify, more: "
                  "a prefill chunk; points with more than the context are skipped)",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "queries", lower_bound=1)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "query and cache dtypes", flag_values=FLAGS)
validate_list_flag(FLAGS, "dtypes", choices=["float32", "bfloat16"])  # the kernel's DTYPES
flags.DEFINE_integer("layers", 30, "layers per program (SmolLM2 has 30)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("page_size", 16, "tokens a page (the engine's default)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("calls", 5, "calls per timing", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timings per point (the median is reported)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("out", "results/attention_cpu.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def run(*, batch_sizes: list[str], contexts: list[str], queries: list[str], dtypes: list[str],
        layers: int, page_size: int, calls: int, repeats: int, out: str) -> list[dict]:
    from infer.engine.buckets import window_bucket

    # A window that is not whole pages gives rows fewer slots than the context the row claims
    # (or none at all).
    for context in map(int, contexts):
        if window_bucket(context) % page_size:
            raise ValueError(f"--page_size must divide every context's window (the context "
                             f"rounded up to a power of two >= 128), got --page_size={page_size} "
                             f"for --contexts={context} (window {window_bucket(context)})")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.common import ResultLog, interleaved_medians, markdown_table
    from kernels_cpu import attention as cpu_attention

    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel is not available on this machine")

    def program(attend):
        def fn(q, pools, lengths, q_lens, tables):
            out = q
            for k_pages, v_pages in pools:
                # Each layer's queries depend on the last layer's output, as in a step: no two
                # layers' attention can run at once.
                out = attend(out, k_pages, v_pages, lengths, q_lens, tables)
            return out
        return jax.jit(fn)

    programs = {"kernel": program(cpu_attention.attend),
                "xla": program(cpu_attention.reference)}

    rng = np.random.default_rng(0)
    log = ResultLog(out)
    table = []
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)
        for b in map(int, batch_sizes):
            for context in map(int, contexts):
                window = window_bucket(context)
                pages_per_row = window // page_size
                num_pages = b * pages_per_row
                # Rows' pages scattered over the pool, as after many admissions and frees.
                tables = jnp.asarray(rng.permutation(num_pages).reshape(b, pages_per_row)
                                     .astype(np.int32))
                shape = (num_pages, KV_HEADS, page_size, HEAD_DIM)
                pools = [tuple(jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
                               for _ in range(2)) for _ in range(layers)]
                lengths = jnp.full((b,), context, jnp.int32)
                # Bytes of the keys and values each layer must read: every visible token's.
                kv_bytes = layers * b * context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
                for t in map(int, queries):
                    if t > context:
                        continue
                    q = jnp.asarray(rng.standard_normal((b, t, HEADS, HEAD_DIM), np.float32)
                                    ).astype(dtype)
                    q_lens = jnp.full((b,), t, jnp.int32)
                    row = {"experiment": "attention_cpu", "dtype": dtype_name, "batch": b,
                           "context": context, "queries": t, "window": window,
                           "page_size": page_size, "layers": layers, "calls": calls,
                           "repeats": repeats}
                    args = (q, pools, lengths, q_lens, tables)
                    # The two must agree, or the table compares different work.
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(
                        programs["kernel"](*args).astype(jnp.float32)
                        - programs["xla"](*args).astype(jnp.float32))))
                    for name, sec in interleaved_medians(programs, args, repeats, calls).items():
                        ms = 1e3 * sec / layers
                        row[f"{name}_ms_per_layer"] = ms
                        row[f"{name}_gb_s"] = kv_bytes / layers / ms / 1e6
                    row["kernel_speedup"] = row["xla_ms_per_layer"] / row["kernel_ms_per_layer"]
                    log.append(row)
                    table.append(row)
                del pools
    print(markdown_table(table, [("dtype", "dtype"), ("batch", "B"), ("context", "context"),
                                 ("queries", "new tokens"),
                                 ("kernel_ms_per_layer", "kernel ms/layer"),
                                 ("kernel_gb_s", "kernel KV GB/s"),
                                 ("xla_ms_per_layer", "XLA ms/layer"), ("xla_gb_s", "XLA KV GB/s"),
                                 ("kernel_speedup", "XLA / kernel")]))
    return table


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
