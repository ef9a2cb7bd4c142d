"""Which 4-bit KV scheme keeps SmolLM2's next tokens, and at what size: schemes simulated by
quantizing keys and values and reading them back before they enter a float32 paged cache
(fake quantization), scored as `experiments.kv_dtypes` scores the real formats.

  python -m experiments.int4_keys --eval_tokens=2048

Keys and values are quantized apart, each by one of:
  token:G     per token, int4 in groups of G channels, after the Hadamard rotation the int4
              format applies (the int4 format: token:32)
  channel:W   per channel over windows of W consecutive tokens (KIVI), int4
  none        kept in float32
and any of these options, appended in any order (`channel:32+rot+clip+log8+z8`):
  +mean   subtract, first, each (layer, kv head)'s mean m over calibration text, and add it
          back to what is read. A real cache would keep m out of its keys, since q . (k - m)
          shifts every score of a query by the same q . m, and add m to attention's output for
          values, since a query's probabilities sum to 1: exact, and no bytes per token.
  +rot    the Hadamard rotation for a channel scheme too (token schemes always rotate)
  +clip   per group, the clipped range of least squared error among CLIP_RATIOS of the full
          one (shrunk about its middle): the group stores its chosen scale and low as usual,
          so the choice costs nothing
  +log8   the step (scale) as a uint8 code c, step = 2^(c/16 - 12) (2^-12 .. 15.3 in steps
          of 4.4%), instead of bfloat16
  +z8     the low (zero point) as an int8 multiple z of the step, low = z * step, instead of
          bfloat16 (z clipped to [-128, 127]: a group so far from 0 then clips)
  +sym    no low at all: 16 levels (q + 1/2) * step, q in [-8, 7], symmetric about 0
  +res    (channel only) a query reads the keys (values) of its own window, the one still
          filling in a real cache, in bfloat16 rather than quantized (KIVI's residual)
  +resN   the same over blocks of N tokens, for any scheme: a cache that quantizes a block of
          N tokens only once it is full, reading the block still filling in bfloat16
  +sink   the first SINK tokens of a sequence (attention sinks) kept, and read, in bfloat16
  +first  (channel only) the first window quantized per token instead, in groups of 32
          channels, unrotated, with the same step and low encodings: the same bytes as a
          window of 32, and no state beyond the page, where +sink needs bfloat16 per sequence.
          The sink tokens' outliers then set only their own groups' ranges, not every
          channel's range over the window they share with 31 ordinary tokens
  +prerope  (keys only) quantize the keys before RoPE (KVQuant), as a cache would that stored
          them so and rotated them as it read them; with +mean, the mean of pre-RoPE keys,
          added back before the rotation
  +smooth  (keys only) divide each channel c of a (layer, kv head) by a static
          s_c = sqrt(rms(k_c) / rms(q_c)) over calibration text, quantize, multiply back. A real
          model folds it into its weights (W_k's rows / s, W_q's rows * s, so q.k is unchanged;
          s is tied across each RoPE pair, so it commutes with RoPE): no bytes, no runtime.
          That s minimizes the expected score error E[(sum_c q_c s_c e_c)^2] when the rotated
          quantization error e is isotropic with variance ~ |k / s|^2 (Cauchy-Schwarz).
Bytes per token per kv head count the int4 data, D / 2 = 32 for D = 64, and each group's step
(2 bytes bfloat16, 1 with +log8) and low (2 bfloat16, 1 with +z8, 0 with +sym), against
bfloat16's 128 bytes per head for K and for V; a group is G channels of one token, or one
channel of W tokens, so it adds (step + low) * D / G or (step + low) * D / W bytes per token.
Windows follow the chunks: 256-token chunks, so every window of W <= 256 is whole when it is
quantized. A real cache would also hold the window still filling, up to W tokens in bfloat16 per
channel-quantized K or V: reported apart as `residual_bytes_per_seq` (per kv head and layer, for
every channel scheme, +res or not: only +res reads it; the N of +resN) with the SINK bfloat16
tokens of +sink, and folded into `bf16_over_bytes_at_L` at a context of L = eval_tokens;
`bf16_over_bytes` leaves both out. (Sink tokens still count in their window's range here; a real
cache would leave them out of it, which can only help.)
"""

from __future__ import annotations

import dataclasses
import functools

from absl import flags

from experiments.common import define_resume_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("schemes", ["token:32/token:32", "token:16/token:32", "token:8/token:32",
                              "token:32+mean/token:32", "channel:16/token:32",
                              "channel:64/token:64", "channel:16/none", "none/token:32"],
                  "key scheme/value scheme pairs", flag_values=FLAGS)
flags.DEFINE_integer("eval_tokens", 2048, "tokens of held-out text scored", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("calibration_tokens", 1024, "tokens of training-side text for +mean",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("out", "results/int4_keys.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)

CHUNK, PAGE = 256, 16
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # +clip's candidate fractions of a group's range
LOG8_OFFSET, LOG8_PER_OCTAVE = 12, 16  # +log8: step = 2^(c / 16 - 12), c a uint8
SINK = 4  # +sink's tokens kept in bfloat16
OPTIONS = ("mean", "rot", "clip", "log8", "z8", "sym", "res", "sink", "prerope", "smooth",
           "first")


@dataclasses.dataclass(frozen=True)
class Scheme:
    kind: str  # "token", "channel" or "none"
    size: int = 0  # group of channels (token) or window of tokens (channel)
    mean: bool = False  # subtract the calibration mean first
    rotate: bool = False  # Hadamard-rotate first (always, for token schemes)
    clip: bool = False  # per group, the clip ratio of least squared error
    step: str = "bf16"  # the step as "bf16" or "log8" (a uint8 exponent code)
    low: str = "bf16"  # the low as "bf16", "z8" (an int8 multiple of the step) or "none" (+sym)
    residual: int = 0  # tokens of the block still filling, read in bfloat16 (0: none)
    sink: bool = False  # the first SINK tokens kept in bfloat16
    prerope: bool = False  # keys quantized before RoPE
    smooth: bool = False  # keys divided by static per-channel scales first
    first: bool = False  # the first window per token (groups of 32, unrotated)

    @staticmethod
    def parse(text: str) -> "Scheme":
        base, *options = text.split("+")
        blocks = [o for o in options if o.startswith("res") and o[3:].isdigit()]
        options = [o for o in options if o not in blocks]
        kind, _, size = base.partition(":")
        if (kind not in ("token", "channel", "none") or (kind != "none") != size.isdigit()
                or (size.isdigit() and int(size) < 1)):
            raise ValueError(f"scheme {text!r}: want token:G, channel:W (G, W >= 1) or none, "
                             f"then options among {', '.join('+' + o for o in OPTIONS)}")
        if unknown := set(options) - set(OPTIONS):
            raise ValueError(f"scheme {text!r}: unknown options {sorted(unknown)}")
        if kind == "none" and set(options) - {"mean"}:
            raise ValueError(f"scheme {text!r}: none takes no options but +mean")
        if kind == "token" and ({"rot", "res"} & set(options)):
            raise ValueError(f"scheme {text!r}: token schemes always rotate; their block of "
                             "tokens read in bfloat16 is +resN")
        if len(blocks) + ("res" in options) > 1 or (blocks and int(blocks[0][3:]) < 1):
            raise ValueError(f"scheme {text!r}: at most one +res or +resN, N >= 1")
        if "first" in options and kind != "channel":
            raise ValueError(f"scheme {text!r}: +first is a channel-scheme option")
        if "sym" in options and "z8" in options:
            raise ValueError(f"scheme {text!r}: +sym stores no low for +z8 to encode")
        return Scheme(kind, int(size) if size else 0, mean="mean" in options,
                      rotate=kind == "token" or "rot" in options, clip="clip" in options,
                      step="log8" if "log8" in options else "bf16",
                      low="none" if "sym" in options else "z8" if "z8" in options else "bf16",
                      residual=(int(blocks[0][3:]) if blocks else
                                int(size) if "res" in options else 0),
                      sink="sink" in options,
                      prerope="prerope" in options, smooth="smooth" in options,
                      first="first" in options)

    @property
    def group_bytes(self) -> int:
        """Bytes of one group's step and low."""
        return (1 if self.step == "log8" else 2) + {"bf16": 2, "z8": 1, "none": 0}[self.low]

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes one token costs in one kv head: int4 data, each group's step and low."""
        if self.kind == "none":
            return 4.0 * head_dim
        # One (step, low) per group of `size` channels of a token, or per channel of a window
        # of `size` tokens: either way group_bytes / size bytes per value.
        return head_dim / 2 + self.group_bytes * head_dim / self.size

    @property
    def exact_tokens(self) -> bool:
        """Whether a query reads some tokens in bfloat16 (+res, +sink)."""
        return self.residual > 0 or self.sink

    def residual_bytes(self, head_dim: int) -> int:
        """Bytes per kv head and sequence held in bfloat16: the window still filling (channel
        schemes, or +resN's block) and the sink tokens (+sink)."""
        return 2 * head_dim * (max(self.size if self.kind == "channel" else 0, self.residual)
                               + (SINK if self.sink else 0))


def _round_trip(groups, axis: int, scheme: Scheme, ratio: float):
    """groups through int4 with the range shrunk to `ratio` of each group's, and back."""
    import jax.numpy as jnp

    bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)

    def encode_step(step):
        if scheme.step == "bf16":
            return bf16(step)
        code = jnp.round((jnp.log2(jnp.maximum(step, 1e-30)) + LOG8_OFFSET) * LOG8_PER_OCTAVE)
        return jnp.exp2(jnp.clip(code, 0, 255) / LOG8_PER_OCTAVE - LOG8_OFFSET)

    hi = jnp.max(groups, axis=axis, keepdims=True)
    lo = jnp.min(groups, axis=axis, keepdims=True)
    if scheme.low == "none":
        step = encode_step(jnp.maximum(hi, -lo) * ratio / 8)
        safe = jnp.where(step > 0, step, 1.0)
        return (jnp.clip(jnp.floor(groups / safe), -8, 7) + 0.5) * step
    if ratio != 1.0:
        middle, half = (hi + lo) / 2, (hi - lo) / 2 * ratio
        lo, hi = middle - half, middle + half
    if scheme.low == "bf16":
        low = bf16(lo)
        step = encode_step((hi - low) / 15)
    else:
        step = encode_step((hi - lo) / 15)
        low = jnp.clip(jnp.round(lo / jnp.where(step > 0, step, 1.0)), -128, 127) * step
    q = jnp.clip(jnp.round((groups - low) / jnp.where(step > 0, step, 1.0)), 0, 15)
    return q * step + low


def fake_quantize(x, scheme: Scheme, positions=None):
    """x [B, T, K, D] float32 through `scheme` and back (T a multiple of a channel window);
    `positions` [B, T] for +first."""
    import jax.numpy as jnp

    from infer.cache.paged import hadamard_rotate

    if scheme.kind == "none":
        return x
    if scheme.first:
        per_token = dataclasses.replace(scheme, kind="token", size=min(32, x.shape[-1]),
                                        rotate=False, first=False)
        rest = fake_quantize(x, dataclasses.replace(scheme, first=False))
        return jnp.where((positions < scheme.size)[:, :, None, None],
                         fake_quantize(x, per_token), rest)
    b, t, k, d = x.shape
    if scheme.rotate:
        x = hadamard_rotate(x)
    if scheme.kind == "token":
        groups = x.reshape(b, t, k, d // scheme.size, scheme.size)
        axis = -1
    else:
        groups = x.reshape(b, t // scheme.size, scheme.size, k, d)
        axis = 2
    best = best_error = None
    for ratio in CLIP_RATIOS if scheme.clip else (1.0,):
        out = _round_trip(groups, axis, scheme, ratio)
        error = jnp.sum(jnp.square(out - groups), axis=axis, keepdims=True)
        if best is None:
            best, best_error = out, error
        else:
            better = error < best_error
            best, best_error = jnp.where(better, out, best), jnp.where(better, error, best_error)
    out = best.reshape(x.shape)
    return hadamard_rotate(out, inverse=True) if scheme.rotate else out


def residual_attention(q, k, k_exact, v, v_exact, mask, k_own, v_own):
    """Attention of q [B, T, H, D] over head-major k, v [B, K, S, D] where mask [B, T, S] is
    true, reading slot s for query t from k_exact (v_exact) where k_own (v_own) [B, T, S] is
    true: scores against both copies, the one each (query, slot) pair reads kept."""
    import jax
    import jax.numpy as jnp

    b, t, h, d = q.shape
    qg = q.reshape(b, t, k.shape[1], h // k.shape[1], d)
    scores = lambda keys: jnp.einsum("btkgd,bksd->bkgts", qg, keys)
    picked = jnp.where(k_own[:, None, None], scores(k_exact), scores(k)) * d ** -0.5
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], picked, -jnp.inf), axis=-1)
    exact = jnp.where(v_own[:, None, None], probs, 0.0)
    out = (jnp.einsum("bkgts,bksd->btkgd", probs - exact, v)
           + jnp.einsum("bkgts,bksd->btkgd", exact, v_exact))
    return out.reshape(b, t, h, d).astype(q.dtype)


def _register():
    import jax
    import jax.numpy as jnp

    from infer.cache.attention import visibility_mask
    from infer.cache.paged import PagedKVCache
    from infer.cache.protocol import WriteThenAttend
    from infer.model.llama import apply_rope

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class FakeQuantCache(WriteThenAttend):
        """A float32 paged cache whose writes pass keys and values through their schemes; with
        +res, a second one holds them in bfloat16 for the windows still filling."""
        inner: PagedKVCache
        exact: PagedKVCache | None  # with +res or +sink: keys and values rounded to bfloat16
        key_means: tuple  # per layer [K, D] (of pre-RoPE keys with +prerope), or () without +mean
        value_means: tuple
        inv_freq: jax.Array  # RoPE's, for +prerope
        key_smooth: tuple  # per layer [K, D] static channel scales (+smooth), or ()
        keys: Scheme = dataclasses.field(metadata=dict(static=True))
        values: Scheme = dataclasses.field(metadata=dict(static=True))

        def write(self, layer, k, v, meta):
            def through(x, scheme, means, smooth=()):  # the mean off, x quantized, the mean back
                mean = means[layer] if means else 0.0
                scale = smooth[layer] if smooth else 1.0
                return fake_quantize((x - mean) / scale, scheme, meta.positions) * scale + mean

            if self.keys.prerope:
                # +smooth's scales are tied across each RoPE pair, so they divide pre-RoPE keys
                # alike (they commute with the rotation).
                pre = apply_rope(k, -meta.positions, self.inv_freq)
                k_read = apply_rope(through(pre, self.keys, self.key_means, self.key_smooth),
                                    meta.positions, self.inv_freq)
            else:
                k_read = through(k, self.keys, self.key_means, self.key_smooth)
            inner = self.inner.write(layer, k_read, through(v, self.values, self.value_means),
                                     meta)
            exact = self.exact
            if exact is not None:
                bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
                exact = exact.write(layer, bf16(k), bf16(v), meta)
            return dataclasses.replace(self, inner=inner, exact=exact)

        def attend(self, layer, q, meta):
            if self.exact is None:
                return self.inner.attend(layer, q, meta)
            b, n = meta.page_tables.shape

            def gather(pool):  # [P, K, G, D] pages -> the row's [B, K, n * G, D]
                _, k, g, d = pool.shape
                return pool[meta.page_tables].transpose(0, 2, 1, 3, 4).reshape(b, k, n * g, d)

            k, v, _, _ = self.inner.pages(layer)
            k_exact, v_exact, _, _ = self.exact.pages(layer)
            slots = n * self.inner.page_size
            # A row's slot s holds its token s; the query at position p reads from the bfloat16
            # copy its own block of N tokens, [p // N * N, p], with +res (N = W) or +resN, and
            # the first SINK with +sink.
            s = jnp.arange(slots, dtype=jnp.int32)[None, None, :]
            p = meta.positions[:, :, None]
            own = lambda sc: jnp.broadcast_to(
                ((s // max(sc.residual, 1) == p // max(sc.residual, 1)) & (sc.residual > 0))
                | ((s < SINK) & sc.sink), (b, p.shape[1], slots))
            return residual_attention(q, gather(k), gather(k_exact), gather(v), gather(v_exact),
                                      visibility_mask(meta, slots), own(self.keys),
                                      own(self.values))

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class QueryRecorder(WriteThenAttend):
        """A cache that hands every query it attends with to `record(layer, q)` on the host
        (calibration only: a callback per layer and step)."""
        inner: PagedKVCache
        record: object = dataclasses.field(metadata=dict(static=True))

        def write(self, layer, k, v, meta):
            return dataclasses.replace(self, inner=self.inner.write(layer, k, v, meta))

        def attend(self, layer, q, meta):
            jax.debug.callback(functools.partial(self.record, layer), q)
            return self.inner.attend(layer, q, meta)

    return FakeQuantCache, QueryRecorder


def smoothing_scales(keys, queries, kv_heads: int):
    """s [K, D] per layer for +smooth from calibration keys [T, K, D] and queries [T, H, D]:
    sqrt(rms(k_c) / rms(q_c)), the query heads of a kv head pooled, each RoPE pair (c, c + D/2)
    sharing its pooled rms, normalized to geometric mean 1."""
    import numpy as np

    d = keys.shape[-1]
    q = queries.reshape(queries.shape[0], kv_heads, -1, d).transpose(0, 2, 1, 3)
    pair = lambda ms: np.tile((ms[..., :d // 2] + ms[..., d // 2:]) / 2, 2)  # mean squares
    rms_k = np.sqrt(pair(np.mean(np.square(keys), axis=0)))
    rms_q = np.sqrt(pair(np.mean(np.square(q), axis=(0, 1))))
    s = np.sqrt(rms_k / np.maximum(rms_q, 1e-12))
    return s / np.exp(np.mean(np.log(s), axis=-1, keepdims=True))


def score(steps, ids: list[int], make_cache):
    """Log-probabilities [N-1, V] of each next token of ids, read in chunks through the cache
    `make_cache(pages)` returns."""
    from experiments.kv_dtypes import score_through

    pages = -(-len(ids) // PAGE)
    return score_through(steps, ids, make_cache(pages), pages, CHUNK)


def parse_pairs(schemes: list[str], head_dim: int) -> list[tuple[str, Scheme, Scheme]]:
    """(text, key scheme, value scheme) of each "keys/values" pair, checked against the
    quantization's shapes: a token scheme's groups must tile the head dim and a channel
    scheme's windows the chunk, or their bytes would be counted for groups that do not exist
    and the run would fail only after scoring the float32 reference."""
    pairs = []
    for text in schemes:
        key, _, value = text.partition("/")
        pairs.append((text, Scheme.parse(key), Scheme.parse(value)))
        if pairs[-1][2].prerope or pairs[-1][2].smooth:
            raise ValueError(f"{text!r}: +prerope and +smooth are key schemes")
        for s in pairs[-1][1:]:
            if s.kind == "channel" and CHUNK % s.size:
                raise ValueError(f"{text!r}: a channel window must divide the {CHUNK}-token chunk")
            if s.kind == "token" and head_dim % s.size:
                raise ValueError(f"{text!r}: a token scheme's group must divide the head dim "
                                 f"{head_dim}")
    return pairs


def run(*, schemes: list[str], eval_tokens: int, calibration_tokens: int, out: str,
        resume: bool = False) -> list[dict]:
    """One row per key/value scheme pair: top-1 agreement and KL against float32, bytes per
    token against bfloat16's."""
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from experiments.common import ResultLog, markdown_table
    from experiments.workloads import HELD_OUT, text_ids
    from infer.cache.paged import PagedKVCache
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load
    from infer.model.config import get_config
    from infer.model.llama import apply_rope, rope_frequencies

    pairs = parse_pairs(schemes, get_config("smollm2-135m").head_dim)  # before any work
    config, model, tokenizer = load("smollm2-135m", "float32")
    k_heads, d = config.num_kv_heads, config.head_dim
    float32 = lambda pages: PagedKVCache.create(config.num_layers, pages, PAGE, k_heads, d)
    ids = text_ids(tokenizer, 60_000, HELD_OUT + 20_000)[:eval_tokens + 1]
    reference = score(DeviceSteps(model), ids, float32)
    # Mean keys and values of training-side text, read back from a float32 cache after one
    # forward.
    calib = text_ids(tokenizer, 20_000, 0)[:calibration_tokens]
    recorded: dict[int, list] = {}
    fake_cache, query_recorder = _register()
    record = lambda layer, q: recorded.setdefault(layer, []).append(np.asarray(q))
    calib_cache = score_cache(DeviceSteps(model), calib,
                              lambda pages: query_recorder(float32(pages), record)).inner
    # Kept on the host: a forward step donates its cache, and with it the arrays it holds, so
    # each cache gets copies of its own.
    inv_freq = rope_frequencies(config)
    tokens = lambda x: jnp.asarray(np.asarray(x).transpose(0, 2, 1, 3).reshape(
        1, -1, k_heads, d)[:, :len(calib)])  # [1, T, K, D]
    unrope = lambda k: apply_rope(k, -jnp.arange(k.shape[1])[None], jnp.asarray(inv_freq))
    key_means = tuple(np.asarray(tokens(k)[0].mean(0)) for k in calib_cache.k)
    prerope_key_means = tuple(np.asarray(unrope(tokens(k))[0].mean(0)) for k in calib_cache.k)
    value_means = tuple(np.asarray(tokens(v)[0].mean(0)) for v in calib_cache.v)
    key_smooth = tuple(smoothing_scales(np.asarray(tokens(k)[0]),
                                        np.concatenate(recorded[layer], axis=1)[0], k_heads)
                       for layer, k in enumerate(calib_cache.k))
    device = lambda arrays: tuple(jnp.asarray(a) for a in arrays)
    log = ResultLog(out, resume=resume)
    p_ref = np.exp(reference)
    bf16_bytes = 2 * d

    for text, keys, values in tqdm(pairs, desc="schemes"):
        def measure(keys=keys, values=values) -> dict:
            exact = keys.exact_tokens or values.exact_tokens
            k_means = prerope_key_means if keys.prerope else key_means
            make = lambda pages: fake_cache(
                float32(pages), float32(pages) if exact else None,
                device(k_means) if keys.mean else (), device(value_means) if values.mean else (),
                jnp.asarray(inv_freq), device(key_smooth) if keys.smooth else (), keys,
                values)
            # A fresh DeviceSteps: its programs are traced for this scheme alone.
            logp = score(DeviceSteps(model), ids, make)
            both = keys.bytes_per_token(d) + values.bytes_per_token(d)
            held = keys.residual_bytes(d) + values.residual_bytes(d)
            return {"top1_agreement": float(np.mean(logp.argmax(-1) == reference.argmax(-1))),
                    "kl_vs_float32": float(np.mean(np.sum(p_ref * (reference - logp), -1))),
                    "key_bytes": keys.bytes_per_token(d), "value_bytes": values.bytes_per_token(d),
                    "bf16_over_bytes": 2 * bf16_bytes / both,
                    "residual_bytes_per_seq": held,
                    "bf16_over_bytes_at_L": 2 * bf16_bytes / (both + held / eval_tokens)}
        log.measure({"experiment": "int4_keys", "scheme": text, "eval_tokens": eval_tokens,
                     "calibration_tokens": calibration_tokens}, measure)
    rows = log.rows()
    print(markdown_table(rows, [("scheme", "keys/values"), ("key_bytes", "K bytes/token/head"),
                                ("value_bytes", "V bytes/token/head"),
                                ("bf16_over_bytes", "bf16 / this"),
                                ("residual_bytes_per_seq", "window bytes/seq/head"),
                                ("bf16_over_bytes_at_L", "bf16 / this, window in"),
                                ("top1_agreement", "top-1 agreement"), ("kl_vs_float32", "KL")]))
    return rows


def score_cache(steps, ids: list[int], make_cache):
    """The cache after one forward over ids (a single chunk)."""
    import jax.numpy as jnp

    from infer.cache.metadata import AttentionMetadata

    pages = -(-len(ids) // PAGE)
    meta = AttentionMetadata.for_prefill(jnp.asarray([len(ids)]), len(ids),
                                         page_tables=jnp.arange(pages, dtype=jnp.int32)[None])
    _, _, cache = steps.forward_step(make_cache(pages), jnp.asarray([ids]), meta)
    return cache


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
