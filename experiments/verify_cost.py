"""Where a verify step's time goes against a decode step's: SmolLM2 at batch 1 over the paged
cache, each piece a jitted program of its own, timed on device (median of --repeats calls).

  python -m experiments.verify_cost --dtype=float32 --ks=1,2,3,4

Per k (k drafts: the verify step runs k + 1 positions) it prints the engine's decode program
(`DeviceSteps.prefill_step` on one token: what a plain decode step runs) and verify program
(`verify_step`, greedy), v = verify / decode, and the pieces of both at T = 1 and T = k + 1:

  head     the vocabulary projection (`Llama.logits`) of T final hidden states
  layers   the forward without the head (embedding, every decoder layer, the final norm),
           the cache written as in a step
  attend   every layer's `PagedKVCache.attend` alone (gather of the window, mask, softmax)
  rule     the sampler on [1, V] (decode) or `verify_chain` on [1, T, V] (verify), greedy
  host     with --engine: the engine's own time per verify step and per baseline decode step
           (its step records, `experiments.speculation`'s measure) minus the programs' device
           time here: the runner's Python, transfers and proposer (ngram is ~0.1 ms)

The pieces overlap (attend is inside layers) and the programs run apart, so head + layers +
rule is near, not equal to, the whole step. --hlo prints the optimized HLO's copies and dots of
the verify program, to see a copy or an unfused operation that the decode program lacks.
"""

from __future__ import annotations

from typing import Any

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and KV cache",
                  flag_values=FLAGS)
flags.DEFINE_list("ks", ["1", "2", "3", "4"], "drafts per verify step", flag_values=FLAGS)
validate_list_flag(FLAGS, "ks", lower_bound=1)
flags.DEFINE_integer("context", 200, "tokens in the cache before the step", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("window", 256, "attention window in tokens (a page-table bucket)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("repeats", 30, "timed calls per program (the median is reported)",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_bool("engine", False, "also time the engine's verify and decode steps (ngram, "
                  "grounded prompts) for the host share", flag_values=FLAGS)
flags.DEFINE_bool("hlo", False, "print the verify program's copies and dots", flag_values=FLAGS)
flags.DEFINE_string("out", "results/verify_cost.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")

PAGE = 16


def _timer(repeats: int):
    """time(fn, cache) -> (median seconds, cache): `median_time` of fn(cache), which returns
    (outputs, cache); the cache is donated, so each call takes the one the previous returned."""
    from experiments.common import median_time

    def time_it(fn, cache):
        held = [cache]

        def call():
            out, held[0] = fn(held[0])
            return out

        return median_time(call, repeats, warmup=3), held[0]

    return time_it


def run(*, dtype: str, ks: list[str], context: int, window: int, repeats: int, engine: bool,
        hlo: bool, out: str) -> list[dict[str, Any]]:
    from experiments.common import check_output_path

    # The verify step writes k + 1 tokens after the context: past the window they would not
    # be in the cache the row claims.
    if context + max(map(int, ks)) + 1 > window:
        raise ValueError(f"--context + max(--ks) + 1 must be <= --window, got {context} + "
                         f"{max(map(int, ks))} + 1 > {window}")
    check_output_path(out, flag="out")  # the rows are written at the end, after every timing

    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.common import ResultLog, markdown_table
    from infer.cache.metadata import AttentionMetadata
    from infer.cache.paged import PagedKVCache
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load
    from infer.sampling import SamplingArrays, sample
    from infer.sampling_params import SamplingParams
    from infer.spec.verify import verify_chain

    loaded = load("smollm2-135m", dtype)
    config, model, _ = loaded
    steps = DeviceSteps(model)
    bind, params = steps.binding.bind, steps.params
    width = -(-window // PAGE)
    cache = PagedKVCache.create(config.num_layers, width + 1, PAGE, config.num_kv_heads,
                                config.head_dim, dtype)
    table = jax.device_put(np.arange(1, width + 1, dtype=np.int32)[None])
    sampling = SamplingArrays.from_params([SamplingParams(temperature=0.0, seed=0)], batch=1)
    index = jax.device_put(np.zeros(1, np.int32))
    rng = np.random.default_rng(0)
    time_it = _timer(repeats)

    def meta(t: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=jax.device_put(context + np.arange(t, dtype=np.int32)[None]),
            lengths=jax.device_put(np.array([context + t], np.int32)),
            q_lens=jax.device_put(np.array([t], np.int32)), page_tables=table)

    def tokens(t: int) -> jax.Array:
        return jax.device_put(rng.integers(0, config.vocab_size, (1, t)).astype(np.int32))

    @jax.jit
    def head(params, hidden):
        return bind(params).logits(hidden)

    def layers_only(params, cache, tok, meta):
        _, hidden, cache = bind(params)(tok, cache, meta)  # the unused logits are not computed
        return hidden, cache
    layers = jax.jit(layers_only, donate_argnums=1)

    def attend_all(cache, q, meta):
        return jnp.stack([cache.attend(i, q, meta) for i in range(config.num_layers)]), cache
    attend = jax.jit(attend_all, donate_argnums=0)

    rule_decode = jax.jit(lambda logits, s, i: sample(logits[:, 0], s, i))
    rule_verify = jax.jit(lambda logits, d, n, s, i: verify_chain(logits, d, n, None, s, i))

    def pieces(t: int, cache):
        """(piece -> seconds at T = t, cache)."""
        m, tok = meta(t), tokens(t)
        hidden = jax.device_put(rng.standard_normal((1, t, config.hidden_size), np.float32))
        q = jax.device_put(rng.standard_normal(
            (1, t, config.num_heads, config.head_dim), np.float32))
        logits = jax.device_put(rng.standard_normal((1, t, config.vocab_size), np.float32))
        got = {}
        got["head"], cache = time_it(lambda c: (head(params, hidden), c), cache)
        got["layers"], cache = time_it(lambda c: layers(params, c, tok, m), cache)
        got["attend"], cache = time_it(lambda c: attend(c, q, m), cache)
        if t == 1:
            got["rule"], cache = time_it(
                lambda c: (rule_decode(logits, sampling, index), c), cache)
        else:
            drafts = tok[:, 1:]
            counts = jax.device_put(np.array([t - 1], np.int32))
            got["rule"], cache = time_it(
                lambda c: (rule_verify(logits, drafts, counts, sampling, index), c), cache)
        return got, cache

    # Inputs built before timing, as the verify step's are: v compares the two programs.
    one_token, one_meta = tokens(1)[:, 0], meta(1)

    def decode_step(c):
        *out, c = steps.prefill_step(c, one_token, one_meta, sampling, index)
        return out, c

    decode_s, cache = time_it(decode_step, cache)
    base, cache = pieces(1, cache)
    rows = []
    for k in map(int, ks):
        t = k + 1
        tok, m = tokens(t), meta(t)
        drafts, counts = tok[:, 1:], jax.device_put(np.array([k], np.int32))

        def verify_step(c):
            *out, c = steps.verify_step(c, tok, m, drafts, counts, None, sampling, index)
            return out, c

        verify_s, cache = time_it(verify_step, cache)
        got, cache = pieces(t, cache)
        row = {"experiment": "verify_cost", "dtype": dtype, "k": k, "context": context,
               "window": window, "decode_ms": 1e3 * decode_s, "verify_ms": 1e3 * verify_s,
               "v": verify_s / decode_s}
        for name in ("head", "layers", "attend", "rule"):
            row[f"{name}_1_ms"], row[f"{name}_t_ms"] = 1e3 * base[name], 1e3 * got[name]
            row[f"{name}_extra"] = (got[name] - base[name]) / decode_s  # in decode steps
        rows.append(row)
        if hlo:
            text = steps.lower_verify(cache, tok, m, drafts, counts, None, sampling,
                                      index).compile().as_text()
            print_hlo_summary(f"verify k={k}", text)
    if hlo:
        text = steps.lower_prefill(cache, tokens(1)[:, 0], meta(1), sampling,
                                   index).compile().as_text()
        print_hlo_summary("decode", text)
    if engine:
        engine_rows = engine_host(loaded, [int(k) for k in ks], dtype)
        for row in rows:
            e = engine_rows[row["k"]]
            row.update(e)
            row["host_verify_ms"] = e["engine_verify_ms"] - row["verify_ms"]
            row["host_decode_ms"] = e["engine_decode_ms"] - row["decode_ms"]
            row["host_extra"] = (row["host_verify_ms"] - row["host_decode_ms"]) / row["decode_ms"]
    log = ResultLog(out)
    for row in rows:
        log.append(row)
    env = log.env
    columns = [("k", "k"), ("decode_ms", "decode ms"), ("verify_ms", "verify ms"), ("v", "v")]
    for name in ("head", "layers", "attend", "rule"):
        columns += [(f"{name}_1_ms", f"{name} T=1 ms"), (f"{name}_t_ms", f"{name} T=k+1 ms"),
                    (f"{name}_extra", f"{name} +v")]
    if engine:
        columns += [("engine_decode_ms", "engine decode ms"),
                    ("engine_verify_ms", "engine verify ms"), ("host_extra", "host +v")]
        for part in ("schedule", "inputs", "device", "output"):
            columns += [(f"engine_decode_{part}_ms", f"decode {part}"),
                        (f"engine_verify_{part}_ms", f"verify {part}")]
    print(f"{dtype}, batch 1, {context} cached tokens, {window}-token window "
          f"({env['time']}, git {env['git']})")
    print(markdown_table(rows, columns))
    return rows


def print_hlo_summary(name: str, text: str) -> None:
    """Counts of the optimized HLO's copies, transposes, dots and fusions, and the shapes of
    its copies and dots (the instructions of the entry computation and of fusions alike)."""
    import collections
    import re

    ops: collections.Counter[str] = collections.Counter()
    shapes: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (copy|transpose|dot|fusion|sort|"
                     r"custom-call|scatter|gather)\(", line)
        if m:
            ops[m.group(2)] += 1
            if m.group(2) in ("copy", "dot", "transpose", "sort"):
                shapes[f"{m.group(2)} {m.group(1)}"] += 1
    print(f"{name}: " + ", ".join(f"{v} {k}" for k, v in sorted(ops.items())))
    for s, n in shapes.most_common(12):
        print(f"    {n} x {s}")


def engine_host(loaded, ks: list[int], dtype: str) -> dict[int, dict[str, float]]:
    """Per k, the engine's mean verify step and the baseline's mean decode step (ms): the whole
    step less the proposer (`experiments.speculation`'s measure), and the step records' parts
    (schedule, inputs, device: dispatch to tokens on the host, output), on the speculation
    experiment's grounded prompts (3 prompts, 32 tokens, after a pass that compiles)."""
    import numpy as np

    from experiments.speculation import ProposerProbe, verify_records
    from experiments.workloads import build_prompts
    from infer.llm import LLM
    from infer.sampling_params import SamplingParams

    config, model, tokenizer = loaded
    prompts = build_prompts(tokenizer, "grounded", 3, 500)
    max_model_len = 128 * -(-(max(map(len, prompts)) + 32 + max(ks) + 2) // 128)
    args = dict(max_model_len=max_model_len, max_prefill_tokens=256, max_num_seqs=1)
    params = [SamplingParams(temperature=0.0, max_tokens=32, seed=i) for i in range(len(prompts))]
    parts = ("schedule_s", "inputs_s", "device_s", "output_s")

    def measure(speculative, prefix: str) -> dict[str, float]:
        llm = LLM.from_loaded(config, model, tokenizer, speculative=speculative, **args)
        probe = ProposerProbe(llm.engine.runner.proposer) if speculative else None
        for _ in range(2):  # the first pass compiles
            first = llm.engine.num_steps
            if probe is not None:
                probe.reset()
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        steps = [r for r in llm.engine.step_records(first) if r.kind == "decode"]
        propose = 0.0
        if probe is not None:
            steps = verify_records(steps, probe)
            summary = probe.summary()
            propose = summary["drafting_propose_s"] / max(summary["drafting_calls"], 1)
        out = {f"{prefix}_ms": 1e3 * (np.mean([r.end_s - r.start_s for r in steps]) - propose),
               f"{prefix}_propose_ms": 1e3 * propose}
        for part in parts:
            out[f"{prefix}_{part[:-2]}_ms"] = 1e3 * float(np.mean([getattr(r, part)
                                                                   for r in steps]))
        return out

    base = measure(None, "engine_decode")
    return {k: {**base, **measure({"method": "ngram", "num_tokens": k}, "engine_verify")}
            for k in ks}


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
