"""Training losses of the speculative drafters: the EAGLE head's feature and token loss, and the
draft model's distillation from the target."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.model.llama import Llama
from infer.spec.eagle_head import EagleHead, eagle_forward, eagle_logits


def feature_loss(target: Llama, predicted: jax.Array, wanted: jax.Array, mask: jax.Array,
                 cls_weight: float | jax.Array = 0.1, target_logits: jax.Array | None = None,
                 vocab: tuple[jax.Array, jax.Array] | None = None,
                 target_argmax: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SmoothL1(ĥ, h) + cls_weight * CE(softmax(logits(h)), logits(ĥ)), averaged where mask.

    With `vocab` (LM-head rows [N, E], their target ids [N]: a draft vocabulary), both logits
    are over those ids only: the head learns the distribution it will draft from, at N/V of the
    projection's cost. `target_argmax` [B, T], the target's argmax over its whole vocabulary,
    decides `hit` (else the argmax of its logits here, over the subset with `vocab`).

    Also returns the parts and `top1` (the head's argmax equals the target's), each a mean over
    the masked positions, `count` (how many), `hit` [B, T] (per position, unmasked) and
    `target_logits` (logits(h), which a caller may pass back in to skip recomputing them)."""
    count = jnp.maximum(mask.sum(), 1.0)
    mean = lambda x: (x * mask).sum() / count
    diff = jnp.abs(predicted - wanted)
    smooth_l1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
    if vocab is None:
        logits_of, to_target_ids = (lambda h: eagle_logits(target, h)), (lambda i: i)
    else:
        logits_of = lambda h: jnp.einsum("...e,ve->...v", h, vocab[0].astype(jnp.float32))
        to_target_ids = lambda i: vocab[1][i]
    draft_logits = logits_of(predicted)
    if target_logits is None:
        target_logits = logits_of(wanted)
    target_logits = jax.lax.stop_gradient(target_logits)
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    ce = -(target_probs * jax.nn.log_softmax(draft_logits, axis=-1)).sum(-1)
    if target_argmax is None:
        target_argmax = to_target_ids(jnp.argmax(target_logits, -1))
    hit = (to_target_ids(jnp.argmax(draft_logits, -1)) == target_argmax).astype(jnp.float32)
    reg, cls = mean(smooth_l1), mean(ce)
    loss = reg + cls_weight * cls
    return loss, {"loss": loss, "reg": reg, "ce": cls, "top1": mean(hit), "count": mask.sum(),
                  "hit": hit, "target_logits": target_logits}

def eagle_loss(head: EagleHead, target: Llama, features: jax.Array, tokens: jax.Array,
               lengths: jax.Array, cls_weight: float | jax.Array = 0.1,
               noise: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE's training loss over whole sequences (`eagle_forward`, then `feature_loss`):
    SmoothL1(ĥ_{t+1}, h_{t+1}) + cls_weight * CE(softmax(logits(h_{t+1})), logits(ĥ_{t+1})),
    averaged over positions t with t + 1 < length; the metrics as `feature_loss` gives them
    (`hit` [B, T-1] per position)."""
    predicted, wanted, mask, _ = eagle_forward(head, target, features, tokens, lengths, noise)
    return feature_loss(target, predicted, wanted, mask, cls_weight)


def distill_loss(draft: Llama, tokens: jax.Array, target_hidden: jax.Array, lengths: jax.Array
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL(target || draft) per position, averaged over each row's first `lengths` positions.

    The draft runs teacher-forced on tokens [B, T] (one call, a fresh contiguous cache); the
    target's logits come from its stored final hidden states [B, T, E] through the head the
    draft shares with it (`draft.logits`). Also returns `top1`: the draft's argmax equals the
    target's, `count`, the positions averaged over, and `hit` [B, T] (top-1 match per position,
    0 where masked).
    """
    b, t = tokens.shape
    config = draft.config
    cache = KVCache.create(config.num_layers, b, t, config.num_kv_heads, config.head_dim)
    meta = AttentionMetadata.for_prefill(jnp.maximum(lengths.astype(jnp.int32), 1), t)
    draft_logits, _, _ = draft(tokens, cache, meta)
    target_logits = jax.lax.stop_gradient(draft.logits(target_hidden.astype(jnp.float32)))
    log_p = jax.nn.log_softmax(target_logits, axis=-1)
    log_q = jax.nn.log_softmax(draft_logits, axis=-1)
    kl = (jnp.exp(log_p) * (log_p - log_q)).sum(-1)
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    top1 = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    loss = (kl * mask).sum() / count
    return loss, {"loss": loss, "top1": (top1 * mask).sum() / count, "count": mask.sum(),
                  "hit": top1 * mask}
