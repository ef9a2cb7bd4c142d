"""Trains the EAGLE draft head of SmolLM2 on the target's own features (`experiments.spec_data`).

  python -m experiments.spec_data
  python -m experiments.train_eagle --epochs=4

EAGLE-3 (the head fuses the target's layers 1 and 14 with its final hidden state, trained
from the EAGLE-1 head with a three-step training-time test on the draft vocabulary):

  python -m experiments.spec_data --num_sequences=1600 --new_tokens=320 --gen_batch_size=64 \
      --self_instruct_fraction=0.5 --feature_layers=1,14 --out=.cache/spec_data/eagle3.npz
  python -m experiments.train_eagle --data=.cache/spec_data/eagle3.npz --feature_layers=1,14 \
      --init=weights/eagle_smollm2.safetensors --draft_vocab_size=8192 --ttt_steps=3 \
      --weights=weights/eagle3_smollm2.safetensors --out=results/train_eagle3.jsonl

Teacher forcing over whole sequences: the head reads (h_t, x_{t+1}) at every position at once
through a contiguous one-layer KV cache sized to the sequence (full causal attention in one
call) and predicts h_{t+1}. Loss: SmoothL1(ĥ_{t+1}, h_{t+1}) + w · CE(softmax(logits(h_{t+1})),
logits(ĥ_{t+1})), the second term (what acceptance depends on) through the target's LM head.

With `--feature_layers` the head is EAGLE-3's (`infer.spec.eagle_head`): its input at real
positions is the fuse of the target's taps and final hidden state; `--init` with an EAGLE-1
head starts it there (pass-through fuse). `--draft_vocab_size` N puts the cross-entropy over
the N most frequent target ids, the ones the head drafts from at serving time.

Optionally (`--step2_weight` > 0) "draft-time" passes (the training-time test) train the head
on its own predictions, as drafting k > 1 tokens feeds them back: drafted step s at position t
reads (ĥ_t, x_{t+1}) while attending to the real rows before the draft began (the first pass's
keys and values) and to the keys of the draft's earlier steps, and predicts h_{t+1};
`--ttt_steps` says how many steps (2: the second drafted token). Held out: 10% of the
sequences; every epoch reports the top-1 agreement of the head's argmax with the target's
argmax there (which approximates the acceptance rate of the first drafted token), that of each
later drafted token given the ones before it, and of all of them together.

Writes weights/eagle_smollm2.safetensors (bfloat16) and one JSON line per epoch to
results/train_eagle.jsonl.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag
from experiments.training import define_trainer_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
# --epochs=0 with --init evaluates that head (and saves it again); without, run refuses it.
define_trainer_flags(FLAGS, epochs=4, lr=1e-3, clip=0.5, min_epochs=0)
flags.DEFINE_float("cls_weight", 0.5, "weight w of the cross-entropy term", lower_bound=0.0,
                   flag_values=FLAGS)
flags.DEFINE_float("step2_weight", 0.5, "weight of each drafted step's loss in the "
                   "training-time test (0: off)", lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("ttt_steps", 2, "drafted steps the training-time test unrolls (HASS, "
                     "EAGLE-3): 2 trains the second drafted token on the head's own first "
                     "prediction, 3 the third on its first two", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("noise", 0.0, "uniform noise amplitude added to input features",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "initialization, shuffling and noise seed", flag_values=FLAGS)
flags.DEFINE_string("weights", "weights/eagle_smollm2.safetensors", "output weights",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "weights")
flags.DEFINE_string("init", "", "continue training from these weights (empty: random init); "
                    "the weights only: the optimizer's moments, the step count and the warmup "
                    "and cosine schedule (over this run's --epochs) start afresh, and the same "
                    "--seed shuffles as the earlier run did; an EAGLE-1 head with "
                    "--feature_layers starts an EAGLE-3 head that drafts as it does "
                    "(`from_eagle1`)", flag_values=FLAGS)
flags.DEFINE_list("feature_layers", [], "EAGLE-3: the target layers whose outputs the head fuses "
                  "with the final hidden state (the data must hold them: spec_data "
                  "--feature_layers); empty: EAGLE-1", flag_values=FLAGS)
validate_list_flag(FLAGS, "feature_layers", parse=int, lower_bound=0, allow_empty=True)
flags.DEFINE_integer("draft_vocab_size", 0, "cross-entropy over the draft vocabulary's N most "
                     "frequent target ids (the head drafts from those: SpeculativeConfig's "
                     "draft_vocab_size); 0: the whole vocabulary", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("draft_vocab_path", "weights/draft_vocab_smollm2.npy",
                    "the token ranking (experiments.draft_vocab)", flag_values=FLAGS)
flags.DEFINE_string("out", "results/train_eagle.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")


@functools.cache
def test_time_cache_class():
    import jax
    import jax.numpy as jnp

    from infer.cache import attention
    from infer.cache.protocol import WriteThenAttend

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class TestTimeCache(WriteThenAttend):
        """The cache the head sees when it drafts its s-th token, for every position at once
        (training-time test): query i, the draft that started after real rows 0..i, attends
        the first pass's real keys at slots 0..i, the key of each earlier drafted step at its
        own index i, and its own key; nothing else. Implements the caches' write/attend
        protocol for layer 0; `advance` files this step's keys with the earlier ones."""

        real_k: jax.Array  # [B, K, S, D] from the first pass
        real_v: jax.Array
        earlier_k: tuple[jax.Array, ...] = ()  # [B, K, T_j, D] per earlier drafted step
        earlier_v: tuple[jax.Array, ...] = ()
        new_k: jax.Array | None = None  # [B, K, T, D]
        new_v: jax.Array | None = None

        def write(self, layer, k, v, meta):
            head_major = lambda x: x.transpose(0, 2, 1, 3).astype(self.real_k.dtype)
            return dataclasses.replace(self, new_k=head_major(k), new_v=head_major(v))

        def attend(self, layer, q, meta):
            s, t = self.real_k.shape[2], q.shape[1]
            i = jnp.arange(t)[:, None]
            own = jnp.arange(t)[None, :] == i
            blocks = len(self.earlier_k) + 1
            mask = jnp.concatenate([jnp.arange(s)[None, :] <= i] + [own] * blocks, 1)
            mask = jnp.broadcast_to(mask[None], (q.shape[0], t, s + blocks * t))
            keys = jnp.concatenate([self.real_k, *(k[:, :, :t] for k in self.earlier_k),
                                    self.new_k], axis=2)
            values = jnp.concatenate([self.real_v, *(v[:, :, :t] for v in self.earlier_v),
                                      self.new_v], axis=2)
            return attention.masked_attention(q, keys, values, mask)

        def advance(self):
            return dataclasses.replace(self, earlier_k=self.earlier_k + (self.new_k,),
                                       earlier_v=self.earlier_v + (self.new_v,),
                                       new_k=None, new_v=None)

    return TestTimeCache


def losses(head, target, hidden, tokens, lengths, target_argmax, *, cls_weight, step2_weight,
           noise, key, drafted_steps, vocab=None):
    """(loss, step-1 metrics, [metrics of drafted steps 2..drafted_steps]) of one batch; the
    metrics as `infer.eagle.feature_loss` gives them, step s's with `all` [B, T-s]: the first s
    drafted tokens all match the target's, `top1_all` its mean, and `predicted` [B, T-s, E]. `target_argmax` [B, T]:
    the target's argmax at each position; `vocab`: the draft vocabulary (`feature_loss`).
    Each drafted step's loss weighs `step2_weight`."""
    import jax
    import jax.numpy as jnp

    from infer.cache.metadata import AttentionMetadata
    from infer.spec.eagle_head import eagle_forward
    from infer.spec.training import feature_loss

    noise_arr = None
    if noise > 0:
        shape = hidden.shape[:2] + (head.config.hidden_size,)  # the head's input, fused
        noise_arr = noise * jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0)
    predicted, wanted, mask, cache = eagle_forward(head, target, hidden, tokens, lengths, noise_arr)
    # Row t predicts x_{t+2}, the target's argmax at position t + 1.
    loss, m1 = feature_loss(target, predicted, wanted, mask, cls_weight, vocab=vocab,
                            target_argmax=target_argmax[:, 1:])
    later, previous, hits = [], predicted, m1["hit"]
    cache = test_time_cache_class()(real_k=cache.k[0], real_v=cache.v[0])
    b, t = predicted.shape[:2]
    for s in range(2, drafted_steps + 1):
        # Step s, query i: reads (ĥ_{i+s-1}, x_{i+s}) at position i + s - 1, predicts h_{i+s}.
        n = t - s + 1
        meta = AttentionMetadata.for_tree(jnp.zeros((b,), jnp.int32), jnp.full((b,), n),
                                          jnp.arange(s - 1, s - 1 + n), tree_mask=None)
        feats = jax.lax.stop_gradient(previous[:, :-1])
        previous, cache = head(feats, tokens[:, s:], target.embed, cache, meta)
        cache = cache.advance()
        loss_s, m = feature_loss(target, previous, wanted[:, s - 1:], mask[:, s - 1:],
                                 cls_weight, target_logits=m1["target_logits"][:, s - 1:],
                                 vocab=vocab, target_argmax=target_argmax[:, s:])
        hits = hits[:, :-1] * m["hit"]
        m["predicted"] = previous
        m["valid"] = mask[:, s - 1:]
        m["all"] = hits * m["valid"]
        m["top1_all"] = m["all"].sum() / jnp.maximum(m["valid"].sum(), 1)
        loss = loss + step2_weight * loss_s
        later.append(m)
    return loss, m1, later


def run(*, data: str, epochs: int, batch_size: int, lr: float, warmup: float, weight_decay: float,
        clip: float, cls_weight: float, step2_weight: float, noise: float, seed: int,
        max_sequences: int, weights: str, out: str, init: str = "",
        feature_layers: Sequence[int] = (), draft_vocab_size: int = 0, ttt_steps: int = 2,
        draft_vocab_path: str = "weights/draft_vocab_smollm2.npy") -> list[dict]:
    from experiments.common import check_output_path
    from experiments.spec_data import check_feature_layers_flag
    from experiments.training import check_input_file

    # Before JAX starts and the model and data load: each of these failed only after them, or
    # after the whole training (the weights' path), and --epochs=0 from a random init saved that
    # head over --weights.
    if epochs < 1 and not init:
        raise ValueError(f"--epochs={epochs} trains nothing: it would save a random-init head "
                         f"to --weights={weights!r} (--init with --epochs=0 evaluates a head)")
    check_input_file("data", data)
    if init:
        check_input_file("init", init)
    if draft_vocab_size:
        check_input_file("draft_vocab_path", draft_vocab_path)
    check_feature_layers_flag(feature_layers)
    check_output_path(weights, flag="weights")
    check_output_path(out, flag="out")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.common import ResultLog, markdown_table
    from experiments.training import Trainer, generated_mask, print_curve
    from infer.io.loader import load
    from infer.spec.eagle_head import EagleHead, from_eagle1, load_eagle, save_eagle
    from infer.spec.draft_vocab import draft_vocab_rows, load_draft_vocab

    start = time.perf_counter()
    config, target, _ = load("smollm2-135m", "float32")
    layers = tuple(int(i) for i in feature_layers)
    trainer = Trainer(data=data, max_sequences=max_sequences, batch_size=batch_size,
                      epochs=epochs, lr=lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                      seed=seed, feature_keys=("taps", "hidden") if layers else ("hidden",),
                      extra_keys=("target_argmax",))
    data_layers = tuple(trainer.dataset["meta"].get("feature_layers", ()))
    if layers and data_layers != layers:
        raise ValueError(f"--feature_layers={list(layers)} but {data!r} holds the taps of layers "
                         f"{list(data_layers)}")
    vocab = draft_vocab_rows(target, load_draft_vocab(
        draft_vocab_path, draft_vocab_size, config.vocab_size) if draft_vocab_size else None)

    if init:
        head = load_eagle(config, init)  # float32 master weights from the saved bfloat16
        if layers and not head.feature_layers:
            head = from_eagle1(head, layers)
        elif head.feature_layers != layers:
            raise ValueError(f"{init!r} reads layers {list(head.feature_layers)}, "
                             f"--feature_layers={list(layers)}")
    else:
        head = EagleHead(config, rngs=nnx.Rngs(seed), feature_layers=layers)
        # Start the output scale at the target's: predicted features are normalized like its own.
        head.norm.weight.set_value(target.norm.weight.get_value())
    graphdef, params = nnx.split(head)
    tgraph, tstate = nnx.split(target)
    opt_state = trainer.opt.init(params)
    print(f"EAGLE head: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters; "
          f"{len(trainer.train_idx)} training / {len(trainer.held_idx)} held-out sequences of <= "
          f"{trainer.dataset['tokens'].shape[1]} tokens; {trainer.total_steps} steps")

    def batch_losses(params, tstate, tokens, hidden, lengths, argmax, key, steps):
        return losses(nnx.merge(graphdef, params), nnx.merge(tgraph, tstate), hidden, tokens,
                      lengths, argmax, cls_weight=cls_weight, step2_weight=step2_weight,
                      noise=noise if key is not None else 0.0, key=key, drafted_steps=steps,
                      vocab=vocab)

    def train_loss(p, tstate, tokens, hidden, lengths, argmax, key):
        loss, m1, _ = batch_losses(p, tstate, tokens, hidden, lengths, argmax, key,
                                   ttt_steps if step2_weight > 0 else 1)
        return loss, m1

    train_step = trainer.train_step(train_loss, drop=("hit", "target_logits"))

    @jax.jit
    def eval_step(params, tstate, tokens, hidden, lengths, prompt_lens, argmax):
        _, m1, later = batch_losses(params, tstate, tokens, hidden, lengths, argmax, None,
                                    max(ttt_steps, 2))
        # Positions whose predicted token the target generated (offset 2: row t drafts x_{t+2}).
        gen = generated_mask(prompt_lens, m1["hit"].shape[1], 2) * (
            jnp.arange(m1["hit"].shape[1])[None, :] < lengths[:, None] - 1)
        m_gen = {"top1": (m1["hit"] * gen).sum() / jnp.maximum(gen.sum(), 1), "count": gen.sum()}
        # Step s's own positions (a target s tokens on) among those: each mean with its own
        # count, so MetricMeans pools batches by it.
        gen_later = []
        for m in later:
            g = gen[:, :m["all"].shape[1]] * m["valid"]
            gen_later.append({"top1_all": (m["all"] * g).sum() / jnp.maximum(g.sum(), 1),
                              "count": g.sum()})
        drop = lambda m: {k: v for k, v in m.items()
                          if k not in ("hit", "all", "valid", "target_logits", "predicted")}
        return (drop(m1), m_gen, *map(drop, later), *gen_later)

    def evaluate(params) -> dict:
        first, gen, *rest = trainer.heldout(eval_step, params, tstate)
        later, gen_later = rest[:len(rest) // 2], rest[len(rest) // 2:]
        m1, mg = first.means(), gen.means()
        row = {"heldout_loss": m1["loss"], "heldout_reg": m1["reg"], "heldout_ce": m1["ce"],
               "heldout_top1": m1["top1"], "heldout_top1_generated": mg["top1"],
               "heldout_positions": first.count, "heldout_generated_positions": gen.count}
        for s, (m, g) in enumerate(zip(later, gen_later), 2):
            m, g = m.means(), g.means()
            # Step 2's names as before the deeper steps: "both" is "all2".
            name = "both" if s == 2 else f"all{s}"
            row[f"heldout_top1_step{s}"] = m["top1"]
            row[f"heldout_top1_{name}"] = m["top1_all"]
            row[f"heldout_top1_{name}_generated"] = g["top1_all"]
        return row

    log = ResultLog(out)
    settings = trainer.row_settings(cls_weight=cls_weight, step2_weight=step2_weight,
                                    noise=noise, seed=seed, init=init,
                                    feature_layers=list(layers), ttt_steps=ttt_steps,
                                    draft_vocab_size=draft_vocab_size)
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
        args=lambda tokens, hidden, lengths, step, argmax: (
            tstate, tokens, hidden, lengths, argmax, jax.random.fold_in(key, step)))

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
