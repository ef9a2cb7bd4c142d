"""Which 4-bit KV scheme keeps SmolLM2's next tokens, and at what size: schemes simulated by
quantizing keys and values and reading them back before they enter a float32 paged cache
(fake quantization), scored as `experiments.kv_dtypes` scores the real formats.

  python -m experiments.int4_keys --eval_tokens=2048

Keys and values are quantized apart, each by one of:
  token:G     per token, asymmetric int4 in groups of G channels (the int4 format: G = 32), after
              the Hadamard rotation the int4 format applies
  channel:W   per channel over windows of W consecutive tokens (KIVI), asymmetric int4
  none        kept in float32
A key scheme may subtract, first, each (layer, kv head)'s mean key over calibration text
(+mean): exact for attention, since q . (k - m) shifts every score of a query by the same q . m.
Bytes per token count int4 data and bfloat16 scale and low values, for D = 64, against
bfloat16's 128 bytes per head for K and for V. Windows follow the chunks: 256-token chunks, so
every window of W <= 256 is whole when it is quantized (a real cache would also have to hold the
tokens of a window still filling).
"""

from __future__ import annotations

import dataclasses

from absl import flags

from experiments.common import define_resume_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("schemes", ["token:32/token:32", "token:16/token:32", "token:8/token:32",
                              "token:32+mean/token:32", "channel:16/token:32",
                              "channel:64/token:64", "channel:16/none", "none/token:32"],
                  "key scheme/value scheme pairs", flag_values=FLAGS)
flags.DEFINE_integer("eval_tokens", 2048, "tokens of held-out text scored", flag_values=FLAGS)
flags.DEFINE_integer("calibration_tokens", 1024, "tokens of training-side text for +mean",
                     flag_values=FLAGS)
flags.DEFINE_string("out", "results/int4_keys.jsonl", "JSONL output", flag_values=FLAGS)
define_resume_flag(FLAGS)

CHUNK, PAGE = 256, 16


@dataclasses.dataclass(frozen=True)
class Scheme:
    kind: str  # "token", "channel" or "none"
    size: int = 0  # group of channels (token) or window of tokens (channel)
    mean: bool = False

    @staticmethod
    def parse(text: str) -> "Scheme":
        mean = text.endswith("+mean")
        kind, _, size = text.removesuffix("+mean").partition(":")
        if kind not in ("token", "channel", "none") or (kind != "none") != size.isdigit():
            raise ValueError(f"scheme {text!r}: want token:G, channel:W or none (keys: +mean)")
        return Scheme(kind, int(size) if size else 0, mean)

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes one token costs in one kv head: int4 data, bfloat16 scale and low values."""
        if self.kind == "none":
            return 4.0 * head_dim
        # A (scale, low) pair per group of `size` channels of a token, or per channel of a
        # window of `size` tokens: either way 4 / size bytes per value.
        return head_dim / 2 + 4 * head_dim / self.size


def fake_quantize(x, scheme: Scheme):
    """x [B, T, K, D] float32 through `scheme` and back (T a multiple of a channel window)."""
    import jax.numpy as jnp

    from infer.cache.paged import hadamard_rotate

    if scheme.kind == "none":
        return x
    b, t, k, d = x.shape
    rotate = scheme.kind == "token"
    if rotate:
        x = hadamard_rotate(x)
    if scheme.kind == "token":
        groups = x.reshape(b, t, k, d // scheme.size, scheme.size)
        axis = -1
    else:
        groups = x.reshape(b, t // scheme.size, scheme.size, k, d)
        axis = 2
    bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    low = bf16(jnp.min(groups, axis=axis, keepdims=True))
    step = bf16((jnp.max(groups, axis=axis, keepdims=True) - low) / 15)
    q = jnp.clip(jnp.round((groups - low) / jnp.where(step > 0, step, 1.0)), 0, 15)
    out = (q * step + low).reshape(x.shape)
    return hadamard_rotate(out, inverse=True) if rotate else out


def _register():
    import jax

    from infer.cache.paged import PagedKVCache

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class FakeQuantCache:
        """A float32 paged cache whose writes pass keys and values through their schemes."""
        inner: PagedKVCache
        key_means: tuple  # per layer [K, D], or () without +mean
        keys: Scheme = dataclasses.field(metadata=dict(static=True))
        values: Scheme = dataclasses.field(metadata=dict(static=True))

        def write(self, layer, k, v, meta):
            if self.key_means:
                k = k - self.key_means[layer]
            inner = self.inner.write(layer, fake_quantize(k, self.keys),
                                     fake_quantize(v, self.values), meta)
            return dataclasses.replace(self, inner=inner)

        def attend(self, layer, q, meta):
            return self.inner.attend(layer, q, meta)

    return FakeQuantCache


def score(steps, ids: list[int], make_cache):
    """Log-probabilities [N-1, V] of each next token of ids, read in chunks through the cache
    `make_cache(pages)` returns."""
    from experiments.kv_dtypes import score_through

    pages = -(-len(ids) // PAGE)
    return score_through(steps, ids, make_cache(pages), pages, CHUNK)


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

    pairs = []
    for text in schemes:
        key, _, value = text.partition("/")
        pairs.append((text, Scheme.parse(key), Scheme.parse(value)))
        if pairs[-1][2].mean:
            raise ValueError(f"{text!r}: +mean is a key scheme")
        for s in pairs[-1][1:]:
            if s.kind == "channel" and CHUNK % s.size:
                raise ValueError(f"{text!r}: a channel window must divide the {CHUNK}-token chunk")
    config, model, tokenizer = load("smollm2-135m", "float32")
    k_heads, d = config.num_kv_heads, config.head_dim
    float32 = lambda pages: PagedKVCache.create(config.num_layers, pages, PAGE, k_heads, d)
    ids = text_ids(tokenizer, 60_000, HELD_OUT + 20_000)[:eval_tokens + 1]
    reference = score(DeviceSteps(model), ids, float32)
    # Mean keys of training-side text, read back from a float32 cache after one forward.
    calib = text_ids(tokenizer, 20_000, 0)[:calibration_tokens]
    calib_cache = score_cache(DeviceSteps(model), calib, float32)
    means = tuple(jnp.asarray(np.asarray(k).transpose(0, 2, 1, 3).reshape(-1, k_heads, d)
                              [:len(calib)].mean(0)) for k in calib_cache.k)
    fake_cache = _register()
    log = ResultLog(out, resume=resume)
    p_ref = np.exp(reference)
    bf16_bytes = 2 * d

    for text, keys, values in tqdm(pairs, desc="schemes"):
        def measure(keys=keys, values=values) -> dict:
            make = lambda pages: fake_cache(float32(pages), means if keys.mean else (), keys,
                                            values)
            # A fresh DeviceSteps: its programs are traced for this scheme alone.
            logp = score(DeviceSteps(model), ids, make)
            per_token = (keys.bytes_per_token(d) + values.bytes_per_token(d)) / 2
            return {"top1_agreement": float(np.mean(logp.argmax(-1) == reference.argmax(-1))),
                    "kl_vs_float32": float(np.mean(np.sum(p_ref * (reference - logp), -1))),
                    "key_bytes": keys.bytes_per_token(d), "value_bytes": values.bytes_per_token(d),
                    "bf16_over_bytes": bf16_bytes / per_token}
        log.measure({"experiment": "int4_keys", "scheme": text, "eval_tokens": eval_tokens,
                     "calibration_tokens": calibration_tokens}, measure)
    rows = log.rows()
    print(markdown_table(rows, [("scheme", "keys/values"), ("key_bytes", "K bytes/token/head"),
                                ("value_bytes", "V bytes/token/head"),
                                ("bf16_over_bytes", "bf16 / this"),
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
