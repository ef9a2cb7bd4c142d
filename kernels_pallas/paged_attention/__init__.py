"""Pallas paged attention: decode (one query token per sequence) and prefill (several: chunked
prefill, speculative verification) against a paged, optionally quantized KV cache.

Files:
  api.py        the public entry points `paged_attention`, `paged_prefill_attention` and
                `ragged_paged_attention` (a mixed batch of decode rows and prefill chunks, by
                cumulative query lengths), side by side: argument validation, backend choice
                ("tpu" / "gpu" / "auto"), the layout of queries as kernel rows, and the jit
                wrappers that call one of the two kernels.
  common.py     the block math both kernels share (visibility mask, scores, online-softmax step,
                finalize) and its constants; plain jnp on already-loaded blocks.
  tpu.py        the TPU-style kernel and its pallas_call: scalar-prefetched page table, grid
                (batch, kv head, page block), index maps that fetch exactly the sequence's pages.
  gpu.py        the GPU-style (Triton) kernel and its pallas_call: no scalar prefetch, grid
                (batch, kv head, query-row block), a loop over pages read by dynamic index.
  reference.py  pure-jnp references of both entry points (and the gather / masked-softmax /
                prefill-visibility helpers they are built from), the kernels' ground truth.
  lowering.py   both entry points lowered for a real TPU or GPU from any host (CPU included):
                the lowering matrix over formats, step kinds and model geometries.

Why split this way: the two kernels differ only in how they walk the pages (grid and index maps
vs. an in-kernel loop), so each backend's kernel sits in its own file next to its pallas_call and
can change without touching the other, while the math they must agree on lives once in
common.py. Decode and prefill share one implementation (decode is the T = 1 case), so their
entry points and validation live together in api.py. The references import no Pallas at all.
Every name one file takes from another is public: nothing here imports a leading-underscore name
across files.

Quantized storage formats are `kernels_pallas.kv_quant`'s.
"""

from kernels_pallas.paged_attention.api import (paged_attention, paged_prefill_attention,
                                                ragged_paged_attention)
from kernels_pallas.paged_attention.reference import (paged_attention_reference,
                                                      paged_prefill_attention_reference,
                                                      ragged_paged_attention_reference)

__all__ = ["paged_attention", "paged_prefill_attention", "ragged_paged_attention",
           "paged_attention_reference", "paged_prefill_attention_reference",
           "ragged_paged_attention_reference"]
