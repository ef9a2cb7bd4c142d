"""KV cache formats: what each costs in quality and what it buys in memory and speed.

  python -m experiments.kv_dtypes --eval_tokens=2048 --batch_sizes=1,8,32

Quality: SmolLM2 reads a fixed real text (CPython's pydoc topics, no download) in chunks through a
paged cache of each format, so every key and value it attends to has gone through that format.
Against the float32 cache: mean KL(p_f32 || p_format) of the next-token distributions, top-1
agreement, and the perplexity of the text. Memory: bytes per token, scales included.
Speed: decode tokens/s per format and batch size (reference attention backend).
"""

from __future__ import annotations

import time

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("formats", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                              "int8", "int4", "int4_kivi"], "KV cache formats", flag_values=FLAGS)
flags.DEFINE_integer("eval_tokens", 2048, "tokens of real text scored per format", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("chunk", 256, "prefill chunk while scoring; 1 scores each token as a "
                     "decode step, as a generated token is (int4_kivi's queries read the pages "
                     "their own chunk wrote exact, and earlier ones quantized but for the "
                     "sequence's two newest)", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "decode batch sizes for the speed sweep", flag_values=FLAGS)
validate_list_flag(FLAGS, "batch_sizes", lower_bound=1, allow_empty=True)  # empty: quality only
flags.DEFINE_integer("decode_tokens", 32, "decode steps timed per speed point", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("page_size", 16, "tokens per page", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("out", "results/kv_dtypes.jsonl", "JSONL output (a PNG plot beside it)", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)


def score_text(steps, config, ids: list[int], kv_format: str, chunk: int, page_size: int):
    """Log-probabilities [N-1, V] of each next token of `ids`, read in chunks through a paged
    cache of `kv_format`."""
    from infer.cache.paged import PagedKVCache

    pages = -(-len(ids) // page_size)
    cache = PagedKVCache.create(config.num_layers, pages, page_size, config.num_kv_heads,
                                config.head_dim, kv_format, num_windows=1)
    return score_through(steps, ids, cache, pages, chunk)


def score_through(steps, ids: list[int], cache, pages: int, chunk: int):
    """Log-probabilities [N-1, V] of each next token of `ids`, read in chunks of `chunk` tokens
    through `cache`, a paged cache (or one that behaves as one) of `pages` pages in one table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from infer.cache.metadata import AttentionMetadata

    tables = jnp.arange(pages, dtype=jnp.int32)[None]
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(piece)] = piece
        meta = AttentionMetadata.for_prefill(jnp.asarray([len(piece)]), chunk,
                                             cached=jnp.asarray([start]), page_tables=tables)
        logits, _, cache = steps.forward_step(cache, jnp.asarray(tokens), meta)
        out.append(np.asarray(jax.nn.log_softmax(logits[0, :len(piece)], axis=-1)))
    return np.concatenate(out)[:-1]


def run(*, formats: list[str], eval_tokens: int, chunk: int, batch_sizes: list[int],
        decode_tokens: int, page_size: int, out: str, resume: bool = False) -> list[dict]:
    """Quality rows per format, then speed rows per format and batch size, each appended to
    `out` as it is measured (with `resume`, points already there are not measured again);
    tables and plot from the file."""
    import functools

    import numpy as np
    from tqdm import tqdm

    from experiments.common import ResultLog, markdown_table, plot_path
    from experiments.workloads import HELD_OUT, consecutive_prompts, text_ids
    from infer.cache.budget import kv_bytes_per_sequence, kv_bytes_per_token
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import PagedLayout, decode_stream
    from infer.io.loader import load
    from infer.sampling_params import SamplingParams

    config, model, tokenizer = load("smollm2-135m", "float32")
    steps = DeviceSteps(model)
    # Held-out text (drafts are trained on the first part, issue 6), past the speed prompts.
    ids = text_ids(tokenizer, 60_000, HELD_OUT + 20_000)[:eval_tokens + 1]
    if len(ids) < eval_tokens + 1:
        raise ValueError(f"only {len(ids)} tokens of evaluation text")
    targets = np.asarray(ids[1:])
    log = ResultLog(out, resume=resume)
    # int4_kivi's size depends on the page size: every row's figure is at the run's.
    bytes_per_token = functools.partial(kv_bytes_per_token, config, page_size=page_size)
    # The float32 scoring every quality point compares against, computed once, when needed.
    reference = functools.cache(lambda: score_text(steps, config, ids, "float32", chunk,
                                                   page_size))

    def quality(kv_format: str) -> dict:
        ref = reference()
        logp = ref if kv_format == "float32" else score_text(steps, config, ids, kv_format,
                                                             chunk, page_size)
        p_ref = np.exp(ref)
        return {
            "eval_tokens": len(targets),
            "kl_vs_float32": float(np.mean(np.sum(p_ref * (ref - logp), axis=-1))),
            "top1_agreement": float(np.mean(logp.argmax(-1) == ref.argmax(-1))),
            "perplexity": float(np.exp(-np.mean(logp[np.arange(len(targets)), targets]))),
            "bytes_per_token": bytes_per_token(kv_format),
            "bytes_per_token_no_scales": bytes_per_token(kv_format, include_scales=False),
            # Held per sequence beside the pages (int4_kivi's bfloat16 window).
            "bytes_per_sequence": kv_bytes_per_sequence(config, kv_format, page_size),
        }

    for kv_format in tqdm(formats, desc="quality"):
        log.measure({"experiment": "kv_dtypes", "kind": "quality", "kv_format": kv_format,
                     "eval_tokens": eval_tokens, "chunk": chunk, "page_size": page_size},
                    lambda kv_format=kv_format: quality(kv_format))

    prompts = text_ids(tokenizer, 20_000, HELD_OUT)

    def speed(kv_format: str, b: int) -> dict:
        batch = consecutive_prompts(prompts, b, 64)
        params = [SamplingParams(ignore_eos=True)] * b
        layout = PagedLayout(page_size=page_size, kv_format=kv_format)

        def generate(n: int) -> None:
            for _ in decode_stream(steps, batch, params, n, paged=layout):
                pass

        generate(decode_tokens + 1)  # compile every shape
        t0 = time.perf_counter(); generate(1); first = time.perf_counter() - t0
        t0 = time.perf_counter(); generate(decode_tokens + 1); full = time.perf_counter() - t0
        step = (full - first) / decode_tokens
        return {"decode_tok_s": b / step, "decode_step_ms": step * 1e3,
                "kv_bytes_per_token": bytes_per_token(kv_format),
                "kv_bytes_at_128_tokens": b * 128 * bytes_per_token(kv_format)}

    for kv_format in tqdm(formats, desc="speed"):
        for b in batch_sizes:
            log.measure({"experiment": "kv_dtypes", "kind": "speed", "kv_format": kv_format,
                         "batch": b, "decode_tokens": decode_tokens, "page_size": page_size},
                        lambda kv_format=kv_format, b=b: speed(kv_format, b))

    stored = log.rows()
    rows = [r for r in stored if r["kind"] == "quality"]
    speed_rows = [r for r in stored if r["kind"] == "speed"]
    print(markdown_table(rows, [("kv_format", "KV format"), ("bytes_per_token", "bytes/token"),
                                ("kl_vs_float32", "KL vs f32"), ("top1_agreement", "top-1 agree"),
                                ("perplexity", "perplexity")]))
    print(markdown_table(speed_rows, [("kv_format", "KV format"), ("batch", "batch"),
                                      ("decode_tok_s", "decode tok/s"),
                                      ("decode_step_ms", "step ms")]))
    plot(rows, speed_rows, plot_path(out))
    return rows + speed_rows


def plot(quality: list[dict], speed: list[dict], path: str) -> None:
    from experiments.common import new_figure, save_figure

    fig, (a, b) = new_figure(2, figsize=(12, 4.5))
    for r in quality:
        a.scatter(r["bytes_per_token"] / 1024, max(r["kl_vs_float32"], 1e-7))
        a.annotate(f"{r['kv_format']}\n{100 * r['top1_agreement']:.1f}% top-1",
                   (r["bytes_per_token"] / 1024, max(r["kl_vs_float32"], 1e-7)), fontsize=8)
    a.set_yscale("log")
    a.set_xlabel("KV bytes per token (KiB, scales included)")
    a.set_ylabel("mean KL(p_f32 || p) per token")
    a.set_title("SmolLM2-135M: quality against cache size")
    for kv_format in dict.fromkeys(r["kv_format"] for r in speed):
        pts = [r for r in speed if r["kv_format"] == kv_format]
        b.plot([r["batch"] for r in pts], [r["decode_tok_s"] for r in pts], marker="o",
               label=kv_format)
    b.set_xscale("log", base=2)
    b.set_xlabel("batch size")
    b.set_ylabel("decode tokens/s")
    b.set_title("decode speed by KV format (CPU, reference backend)")
    b.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
