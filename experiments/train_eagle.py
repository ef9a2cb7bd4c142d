"""Trains the EAGLE draft head of SmolLM2 on the target's own features (`experiments.spec_data`).

  python -m experiments.spec_data
  python -m experiments.train_eagle --epochs=4

Teacher forcing over whole sequences: the head reads (h_t, x_{t+1}) at every position at once
through a contiguous one-layer KV cache sized to the sequence (full causal attention in one
call) and predicts h_{t+1}. Loss: SmoothL1(ĥ_{t+1}, h_{t+1}) + w · CE(softmax(logits(h_{t+1})),
logits(ĥ_{t+1})), the second term (what acceptance depends on) through the target's LM head.

Optionally (`--step2_weight` > 0) a second, "draft-time" pass trains the head on its own
predictions, as drafting k > 1 tokens feeds them back: at position t it reads (ĥ_t, x_{t+1})
while attending to the real features of positions < t (the first pass's keys and values) and
predicts h_{t+1}. Held out: 10% of the sequences; every epoch reports the top-1 agreement of the
head's argmax with the target's argmax there (which approximates the acceptance rate of the
first drafted token), that of the second drafted token given the first, and of both.

Writes weights/eagle_smollm2.safetensors (bfloat16) and one JSON line per epoch to
results/train_eagle.jsonl.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from absl import flags

from experiments.training import define_trainer_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
define_trainer_flags(FLAGS, epochs=4, lr=1e-3, clip=0.5)
flags.DEFINE_float("cls_weight", 0.5, "weight w of the cross-entropy term", flag_values=FLAGS)
flags.DEFINE_float("step2_weight", 0.5, "weight of the draft-time second pass (0: off)",
                   flag_values=FLAGS)
flags.DEFINE_float("noise", 0.0, "uniform noise amplitude added to input features",
                   flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "initialization, shuffling and noise seed", flag_values=FLAGS)
flags.DEFINE_string("weights", "weights/eagle_smollm2.safetensors", "output weights",
                    flag_values=FLAGS)
flags.DEFINE_string("init", "", "continue training from these weights (empty: random init)",
                    flag_values=FLAGS)
flags.DEFINE_string("out", "results/train_eagle.jsonl", "JSONL output", flag_values=FLAGS)


@functools.cache
def step_two_cache_class():
    import jax
    import jax.numpy as jnp

    from infer.cache import attention

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class StepTwoCache:
        """The cache the head sees when it drafts its second token, for every position at once:
        query i (position i + 1) attends to the first pass's real keys at slots 0..i and to its
        own key, nothing else. Implements the caches' write/attend protocol for layer 0."""

        real_k: jax.Array  # [B, K, S, D] from the first pass
        real_v: jax.Array
        new_k: jax.Array | None = None  # [B, K, T, D], T = S - 1
        new_v: jax.Array | None = None

        def write(self, layer, k, v, meta):
            head_major = lambda x: x.transpose(0, 2, 1, 3).astype(self.real_k.dtype)
            return dataclasses.replace(self, new_k=head_major(k), new_v=head_major(v))

        def attend(self, layer, q, meta):
            s, t = self.real_k.shape[2], q.shape[1]
            i = jnp.arange(t)[:, None]
            real = jnp.arange(s)[None, :] <= i
            own = jnp.arange(t)[None, :] == i
            mask = jnp.broadcast_to(jnp.concatenate([real, own], 1)[None], (q.shape[0], t, s + t))
            keys = jnp.concatenate([self.real_k, self.new_k], axis=2)
            values = jnp.concatenate([self.real_v, self.new_v], axis=2)
            return attention.masked_attention(q, keys, values, mask)

    return StepTwoCache


def losses(head, target, hidden, tokens, lengths, *, cls_weight, step2_weight, noise, key,
           with_step2):
    """(loss, step-1 metrics, step-2 metrics or None) of one batch; the metrics as
    `infer.eagle.feature_loss` gives them, step 2's with `both` [B, T-2]: the first and the
    second drafted tokens both match the target's."""
    import jax
    import jax.numpy as jnp

    from infer.cache.metadata import AttentionMetadata
    from infer.spec.eagle_head import eagle_forward
    from infer.spec.training import feature_loss

    noise_arr = None
    if noise > 0:
        noise_arr = noise * jax.random.uniform(key, hidden.shape, jnp.float32, -1.0, 1.0)
    predicted, wanted, mask, cache = eagle_forward(head, target, hidden, tokens, lengths, noise_arr)
    loss, m1 = feature_loss(target, predicted, wanted, mask, cls_weight)
    if not with_step2:
        return loss, m1, None
    # Second drafted token: row i reads (ĥ_{i+1}, x_{i+2}) at position i + 1.
    b, t = predicted.shape[:2]
    feats = jax.lax.stop_gradient(predicted[:, :-1])
    # Query i sits in slot i of its own keys, at position i + 1.
    meta = AttentionMetadata.for_tree(jnp.zeros((b,), jnp.int32), jnp.full((b,), t - 1),
                                      jnp.arange(1, t), tree_mask=None)
    cache2 = step_two_cache_class()(real_k=cache.k[0], real_v=cache.v[0])
    predicted2, _ = head(feats, tokens[:, 2:], target.embed, cache2, meta)
    loss2, m2 = feature_loss(target, predicted2, wanted[:, 1:], mask[:, 1:], cls_weight,
                             target_logits=m1["target_logits"][:, 1:])
    m2["both"] = m1["hit"][:, :-1] * m2["hit"] * mask[:, 1:]
    m2["top1_both"] = m2["both"].sum() / jnp.maximum(mask[:, 1:].sum(), 1)
    return loss + step2_weight * loss2, m1, m2


def run(*, data: str, epochs: int, batch_size: int, lr: float, warmup: float, weight_decay: float,
        clip: float, cls_weight: float, step2_weight: float, noise: float, seed: int,
        max_sequences: int, weights: str, out: str, init: str = "") -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.common import ResultLog, markdown_table
    from experiments.training import Trainer, generated_mask, print_curve
    from infer.io.loader import load
    from infer.spec.eagle_head import EagleHead, load_eagle, save_eagle

    start = time.perf_counter()
    config, target, _ = load("smollm2-135m", "float32")
    trainer = Trainer(data=data, max_sequences=max_sequences, batch_size=batch_size,
                      epochs=epochs, lr=lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                      seed=seed)

    if init:
        head = load_eagle(config, init)  # float32 master weights from the saved bfloat16
    else:
        head = EagleHead(config, rngs=nnx.Rngs(seed))
        # Start the output scale at the target's: predicted features are normalized like its own.
        head.norm.weight.set_value(target.norm.weight.get_value())
    graphdef, params = nnx.split(head)
    tgraph, tstate = nnx.split(target)
    opt_state = trainer.opt.init(params)
    print(f"EAGLE head: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters; "
          f"{len(trainer.train_idx)} training / {len(trainer.held_idx)} held-out sequences of <= "
          f"{trainer.dataset['tokens'].shape[1]} tokens; {trainer.total_steps} steps")

    def batch_losses(params, tstate, tokens, hidden, lengths, key, with_step2):
        return losses(nnx.merge(graphdef, params), nnx.merge(tgraph, tstate), hidden, tokens,
                      lengths, cls_weight=cls_weight, step2_weight=step2_weight,
                      noise=noise if key is not None else 0.0, key=key, with_step2=with_step2)

    def train_loss(p, tstate, tokens, hidden, lengths, key):
        loss, m1, _ = batch_losses(p, tstate, tokens, hidden, lengths, key, step2_weight > 0)
        return loss, m1

    train_step = trainer.train_step(train_loss, drop=("hit", "target_logits"))

    @jax.jit
    def eval_step(params, tstate, tokens, hidden, lengths, prompt_lens):
        _, m1, m2 = batch_losses(params, tstate, tokens, hidden, lengths, None, True)
        # Positions whose predicted token the target generated (offset 2: row t drafts x_{t+2}).
        gen = generated_mask(prompt_lens, m1["hit"].shape[1], 2) * (
            jnp.arange(m1["hit"].shape[1])[None, :] < lengths[:, None] - 1)
        m_gen = {"top1": (m1["hit"] * gen).sum() / jnp.maximum(gen.sum(), 1),
                 "top1_both": (m2["both"] * gen[:, :-1]).sum() / jnp.maximum(gen[:, :-1].sum(), 1),
                 "count": gen.sum()}
        drop = lambda m: {k: v for k, v in m.items() if k not in ("hit", "both", "target_logits")}
        return drop(m1), drop(m2), m_gen

    def evaluate(params) -> dict:
        first, second, gen = trainer.heldout(eval_step, params, tstate)
        m1, m2, mg = first.means(), second.means(), gen.means()
        return {"heldout_loss": m1["loss"], "heldout_reg": m1["reg"], "heldout_ce": m1["ce"],
                "heldout_top1": m1["top1"], "heldout_top1_step2": m2["top1"],
                "heldout_top1_both": m2["top1_both"], "heldout_top1_generated": mg["top1"],
                "heldout_top1_both_generated": mg["top1_both"],
                "heldout_positions": first.count, "heldout_generated_positions": gen.count}

    log = ResultLog(out)
    settings = trainer.row_settings(cls_weight=cls_weight, step2_weight=step2_weight,
                                    noise=noise, seed=seed, init=init)
    rows = [{"experiment": "train_eagle", "epoch": 0, "step": 0, **evaluate(params),
             "seconds": time.perf_counter() - start, **settings}]
    log.append(rows[-1])
    print(f"epoch 0 ({init or 'random init'}): held-out top-1 {rows[-1]['heldout_top1']:.3f}")
    key = jax.random.key(seed)

    def epoch_done(epoch: int, step: int, means: dict, params) -> None:
        row = {"experiment": "train_eagle", "epoch": epoch, "step": step,
               "train_loss": means["loss"], "train_reg": means["reg"], "train_ce": means["ce"],
               "train_top1": means["top1"], "lr": float(trainer.schedule(step)),
               **evaluate(params), "seconds": time.perf_counter() - start, **settings}
        log.append(row)
        rows.append(row)
        print(f"epoch {epoch}: train loss {row['train_loss']:.4f} (reg {row['train_reg']:.4f}, "
              f"ce {row['train_ce']:.3f}); held-out top-1 {row['heldout_top1']:.3f} "
              f"(generated text {row['heldout_top1_generated']:.3f}), 2nd token "
              f"{row['heldout_top1_step2']:.3f}, both {row['heldout_top1_both']:.3f}")

    params, curve = trainer.fit(
        train_step, params, opt_state, epoch_done=epoch_done,
        args=lambda tokens, hidden, lengths, step: (tstate, tokens, hidden, lengths,
                                                    jax.random.fold_in(key, step)))

    size = save_eagle(nnx.merge(graphdef, params), weights)
    # The file must load back and give the held-out numbers (up to bfloat16 weights).
    reloaded = nnx.split(load_eagle(config, weights))[1]
    check = evaluate(reloaded)
    print(f"saved {weights}: {size / 1e6:.2f} MB (bfloat16); reloaded held-out top-1 "
          f"{check['heldout_top1']:.3f}")
    rows[-1]["weights"], rows[-1]["weights_bytes"] = weights, size
    rows[-1]["reloaded_heldout_top1"] = check["heldout_top1"]
    log.append({"experiment": "train_eagle", "final": True, "weights": weights,
                  "weights_bytes": size, "reloaded_heldout_top1": check["heldout_top1"],
                  "reloaded_heldout_top1_both": check["heldout_top1_both"],
                  "seconds": time.perf_counter() - start})
    print_curve(curve, "loss")
    print(markdown_table(rows, [("epoch", "epoch"), ("train_loss", "train loss"),
                                ("heldout_loss", "held-out loss"), ("heldout_top1", "top-1"),
                                ("heldout_top1_generated", "top-1 (generated)"),
                                ("heldout_top1_step2", "2nd top-1"),
                                ("heldout_top1_both", "both")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
