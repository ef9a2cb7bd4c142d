"""How a model's attention heads split over T tensor-parallel devices, checked before any weight
moves.

Each device must hold whole query heads and the KV heads they read. Three ways, in order:
  split      T divides the KV heads (and so the query heads): each device holds K/T KV heads
  replicate  T is a multiple of the KV heads and divides the query heads: each KV head is
             duplicated T/K times, so that each device holds one copy next to its H/T query
             heads (exact: a query head reads the same KV head as before)
  pad        opt-in (`pad_heads`): zero KV heads, each with a group of zero query heads and zero
             rows of the output projection, until T divides them. Exact too, since a zero query
             group reads zero values and writes through zero rows, at the cost of KV memory for
             the zero heads (SmolLM2, 9/3 heads, at T = 2 or 4: 12/4 heads, +33%).
The FFN and the vocabulary must split evenly as well: an uneven split would place without error
and only show up as extra all-gathers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from infer.model.config import LlamaConfig
from infer.model.llama import Llama


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    way: str  # "split", "replicate" or "pad"
    num_heads: int  # after the layout
    num_kv_heads: int
    kv_repeat: int = 1  # copies of each KV head (replicate)
    kv_pad: int = 0  # zero KV heads appended (pad)

    def describe(self, config: LlamaConfig) -> str:
        extra = self.num_kv_heads / config.num_kv_heads - 1
        cost = f", +{extra:.0%} KV memory" if extra else ""
        return (f"{self.way}: {self.num_heads} query / {self.num_kv_heads} KV heads (from "
                f"{config.num_heads} / {config.num_kv_heads}){cost}")


def head_layout(config: LlamaConfig, tensor_parallel_size: int, pad_heads: bool = False
                ) -> HeadLayout:
    """The layout that splits `config`'s heads over T devices; ValueError naming the choices when
    none applies."""
    t, h, k = tensor_parallel_size, config.num_heads, config.num_kv_heads
    for name, size in (("intermediate_size", config.intermediate_size),
                       ("vocab_size", config.vocab_size)):
        if size % t:
            raise ValueError(f"tensor_parallel_size={t} does not divide {config.name}'s "
                             f"{name} {size}; sizes that split everything: {_fits(config)}")
    if k % t == 0:
        return HeadLayout("split", h, k)
    if t % k == 0 and h % t == 0:
        return HeadLayout("replicate", h, t, kv_repeat=t // k)
    if pad_heads:
        padded_k = -(-k // t) * t
        return HeadLayout("pad", padded_k * (h // k), padded_k, kv_pad=padded_k - k)
    raise ValueError(f"tensor_parallel_size={t} splits neither {config.name}'s {k} KV heads nor "
                     f"its {h} query heads in whole groups; sizes that do: {_fits(config)}, or "
                     f"pass pad_heads=True to add zero heads")


def _fits(config: LlamaConfig) -> list[int]:
    """The tensor-parallel sizes that need no padding."""
    h, k = config.num_heads, config.num_kv_heads
    return [d for d in range(1, h + 1)
            if h % d == 0 and (k % d == 0 or d % k == 0)
            and config.intermediate_size % d == 0 and config.vocab_size % d == 0]


def apply_head_layout(model: Llama, layout: HeadLayout) -> Llama:
    """The model with its heads laid out as `layout` says, weights on the host (numpy) for
    placement; the model itself when the layout changes nothing."""
    config = model.config
    if (layout.num_heads, layout.num_kv_heads) == (config.num_heads, config.num_kv_heads):
        return model
    d, group = config.head_dim, config.num_heads // config.num_kv_heads
    wide = dataclasses.replace(config, num_heads=layout.num_heads,
                               num_kv_heads=layout.num_kv_heads)
    new = nnx.eval_shape(lambda: Llama(wide, model.embed[...].dtype))

    def heads(w: np.ndarray, axis: int, n: int) -> np.ndarray:
        shape = list(w.shape)
        shape[axis:axis + 1] = [n, d]
        return w.reshape(shape)

    def flat(w: np.ndarray, axis: int) -> np.ndarray:
        shape = list(w.shape)
        shape[axis:axis + 2] = [shape[axis] * shape[axis + 1]]
        return w.reshape(shape)

    def kv(w: np.ndarray) -> np.ndarray:  # [E, K*D]
        w = heads(w, 1, config.num_kv_heads)
        if layout.kv_repeat > 1:
            w = np.repeat(w, layout.kv_repeat, axis=1)
        if layout.kv_pad:  # may exceed the real heads, as the query heads' padding may
            w = np.concatenate([w, np.zeros((w.shape[0], layout.kv_pad, d), w.dtype)], axis=1)
        return flat(w, 1)

    def query_heads(w: np.ndarray, axis: int) -> np.ndarray:
        # Padding appends whole zero groups; repeating KV heads leaves the queries as they are.
        w = heads(w, axis, config.num_heads)
        shape = list(w.shape)
        shape[axis] = layout.kv_pad * group  # more than the real heads at times (SmolLM2, T = 8)
        return flat(np.concatenate([w, np.zeros(shape, w.dtype)], axis=axis), axis)

    old_state, new_state = nnx.state(model), nnx.state(new)
    values = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(old_state)}
    widen = {"q_proj": lambda w: query_heads(w, 1), "k_proj": kv, "v_proj": kv,
             "o_proj": lambda w: query_heads(w, 0)}
    for path, variable in nnx.to_flat_state(new_state):
        value = values[path]
        variable.set_value(widen[path[-1]](value) if path[-1] in widen else value)
    return new
