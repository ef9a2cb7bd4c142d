"""Distils a small draft model of SmolLM2 (`infer.draft.DRAFT_CONFIG`: 2 decoder layers of the
target's width, sharing its tied embedding and LM head, which stay frozen) on the target's own
continuations (`experiments.spec_data`).

  python -m experiments.spec_data
  python -m experiments.train_draft --epochs=3

The draft runs teacher-forced over whole sequences; the loss is KL(target || draft) at every
position, the target's logits recomputed from its stored final hidden states through the shared
head. The draft's layers start as copies of the target's first two (with the target's final norm):
at epoch 0 the draft *is* the 2-layer self-draft. Held out: 10% of the sequences (the same split
as train_eagle); every epoch reports the draft's top-1 agreement with the target there, on all
positions and on the positions whose token the target generated. For comparison the untrained
self-drafts (the target's first N layers, N = 2, 4, 8, with its final norm and head) are
measured on the same positions first.

Writes weights/draft_smollm2.safetensors (bfloat16, the draft's own weights only) and one JSON
line per self-draft and per epoch to results/train_draft.jsonl.
"""

from __future__ import annotations

import math
import time

from absl import flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_string("data", ".cache/spec_data/smollm2.npz", "spec_data output", flag_values=FLAGS)
flags.DEFINE_integer("epochs", 3, "passes over the training sequences", flag_values=FLAGS)
flags.DEFINE_integer("num_layers", 2, "decoder layers of the draft", flag_values=FLAGS)
flags.DEFINE_integer("batch_size", 8, "sequences per step", flag_values=FLAGS)
flags.DEFINE_float("lr", 5e-4, "peak learning rate", flag_values=FLAGS)
flags.DEFINE_float("warmup", 0.05, "fraction of steps of linear warmup", flag_values=FLAGS)
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay (matrices)", flag_values=FLAGS)
flags.DEFINE_float("clip", 1.0, "gradient global-norm clip", flag_values=FLAGS)
flags.DEFINE_list("self_draft_layers", ["2", "4", "8"], "self-drafts measured for comparison",
                  flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "shuffling seed", flag_values=FLAGS)
flags.DEFINE_integer("max_sequences", 0, "use only this many sequences (0: all)", flag_values=FLAGS)
flags.DEFINE_string("weights", "weights/draft_smollm2.safetensors", "output weights",
                    flag_values=FLAGS)
flags.DEFINE_string("out", "results/train_draft.jsonl", "JSONL output", flag_values=FLAGS)


def run(*, data: str, epochs: int, num_layers: int, batch_size: int, lr: float, warmup: float,
        weight_decay: float, clip: float, self_draft_layers: list[int], seed: int,
        max_sequences: int, weights: str, out: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tqdm import tqdm

    from experiments.common import ResultLog, markdown_table
    from experiments.spec_data import (
        MetricMeans,
        batches,
        generated_mask,
        make_optimizer,
        training_split,
    )
    from infer.io.loader import load
    from infer.spec.draft_model import (
        DRAFT_CONFIG,
        SHARED,
        draft_own_params,
        load_draft,
        save_draft,
        self_draft,
    )
    from infer.spec.training import distill_loss

    start = time.perf_counter()
    config, target, _ = load("smollm2-135m", "float32")
    dataset, train_idx, held_idx = training_split(data, max_sequences)
    steps_per_epoch = math.ceil(len(train_idx) / batch_size)
    total = steps_per_epoch * epochs
    log = ResultLog(out)
    settings = dict(data=data, epochs=epochs, batch_size=batch_size, lr=lr, warmup=warmup,
                    weight_decay=weight_decay, clip=clip, seed=seed,
                    train_sequences=len(train_idx), heldout_sequences=len(held_idx),
                    data_meta=dataset["meta"])

    own = lambda path, _: path[0] not in SHARED  # the draft's trainable parameters

    def evaluator(graphdef):
        @jax.jit
        def eval_step(params, shared, tokens, hidden, lengths, prompt_lens):
            _, m = distill_loss(nnx.merge(graphdef, params, shared), tokens, hidden, lengths)
            gen = generated_mask(prompt_lens, tokens.shape[1], 1) * (
                jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])
            m_gen = {"top1": (m["hit"] * gen).sum() / jnp.maximum(gen.sum(), 1), "count": gen.sum()}
            return {k: v for k, v in m.items() if k != "hit"}, m_gen

        def evaluate(params, shared) -> dict:
            alls, gens = MetricMeans(), MetricMeans()
            for tokens, hidden, lengths, prompt_lens in batches(dataset, held_idx, batch_size):
                m, m_gen = eval_step(params, shared, tokens, hidden, lengths, prompt_lens)
                alls.add(m)
                gens.add(m_gen)
            return {"heldout_kl": alls.means()["loss"], "heldout_top1": alls.means()["top1"],
                    "heldout_top1_generated": gens.means()["top1"],
                    "heldout_positions": alls.count, "heldout_generated_positions": gens.count}
        return evaluate

    rows = []
    for layers in self_draft_layers:
        model = self_draft(target, layers)
        graphdef, params, shared = nnx.split(model, own, ...)
        row = {"experiment": "train_draft", "model": f"self_draft_{layers}", "layers": layers,
               "epoch": None, **evaluator(graphdef)(params, shared),
               "seconds": time.perf_counter() - start, **settings}
        log.append(row)
        rows.append(row)
        print(f"self-draft, first {layers} layers: held-out top-1 {row['heldout_top1']:.3f} "
              f"(generated text {row['heldout_top1_generated']:.3f}), KL {row['heldout_kl']:.3f}")

    # The draft: the target's first layers and final norm, copied (the target keeps its own).
    draft = self_draft(target, num_layers)
    draft_cfg = DRAFT_CONFIG(config, num_layers)
    draft.config = draft_cfg
    graphdef, params, shared = nnx.split(draft, own, ...)
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    evaluate = evaluator(graphdef)
    opt, schedule = make_optimizer(lr=lr, total_steps=total, warmup_steps=int(warmup * total),
                                   weight_decay=weight_decay, clip=clip)
    opt_state = opt.init(params)
    print(f"draft {draft_cfg.name}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M own "
          f"parameters; {len(train_idx)} training / {len(held_idx)} held-out sequences; "
          f"{total} steps")

    @jax.jit
    def train_step(params, opt_state, shared, tokens, hidden, lengths):
        def loss_fn(p):
            return distill_loss(nnx.merge(graphdef, p, shared), tokens, hidden, lengths)
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        m = {k: v for k, v in m.items() if k != "hit"}
        return optax.apply_updates(params, updates), opt_state, loss, m, optax.global_norm(grads)

    name = f"draft_{num_layers}"
    row = {"experiment": "train_draft", "model": name, "layers": num_layers, "epoch": 0, "step": 0,
           **evaluate(params, shared), "seconds": time.perf_counter() - start, **settings}
    log.append(row)
    rows.append(row)
    rng = np.random.default_rng(seed)
    step, curve = 0, []
    for epoch in range(1, epochs + 1):
        train = MetricMeans()
        bar = tqdm(batches(dataset, train_idx, batch_size, rng), total=steps_per_epoch,
                   desc=f"epoch {epoch}/{epochs}")
        for tokens, hidden, lengths, _ in bar:
            params, opt_state, loss, m, gnorm = train_step(params, opt_state, shared, tokens,
                                                           hidden, lengths)
            train.add(m)
            step += 1
            curve.append(float(loss))
            bar.set_postfix(kl=f"{float(loss):.3f}", top1=f"{float(m['top1']):.3f}",
                            gnorm=f"{float(gnorm):.2f}")
        row = {"experiment": "train_draft", "model": name, "layers": num_layers, "epoch": epoch,
               "step": step, "train_kl": train.means()["loss"], "train_top1": train.means()["top1"],
               "lr": float(schedule(step)), **evaluate(params, shared),
               "seconds": time.perf_counter() - start, **settings}
        log.append(row)
        rows.append(row)
        print(f"epoch {epoch}: train KL {row['train_kl']:.4f}; held-out KL {row['heldout_kl']:.4f}, "
              f"top-1 {row['heldout_top1']:.3f} (generated text {row['heldout_top1_generated']:.3f})")

    trained = nnx.merge(graphdef, params, shared)
    size = save_draft(trained, weights)
    reloaded = load_draft(target, weights, dtype=jnp.float32)
    assert reloaded.embed.get_value() is target.embed.get_value()
    _, r_params, r_shared = nnx.split(reloaded, own, ...)
    check = evaluate(r_params, r_shared)
    print(f"saved {weights}: {size / 1e6:.2f} MB (bfloat16, "
          f"{sum(x.size for x in draft_own_params(trained).values()) / 1e6:.2f}M parameters); "
          f"reloaded held-out top-1 {check['heldout_top1']:.3f}")
    log.append({"experiment": "train_draft", "final": True, "model": name, "weights": weights,
                  "weights_bytes": size, "reloaded_heldout_top1": check["heldout_top1"],
                  "reloaded_heldout_top1_generated": check["heldout_top1_generated"],
                  "seconds": time.perf_counter() - start})
    print("KL curve (mean per tenth of training):")
    tenth = max(1, len(curve) // 10)
    print("  " + " ".join(f"{np.mean(curve[i:i + tenth]):.3f}" for i in range(0, len(curve), tenth)))
    print(markdown_table(rows, [("model", "model"), ("epoch", "epoch"), ("train_kl", "train KL"),
                                ("heldout_kl", "held-out KL"), ("heldout_top1", "top-1"),
                                ("heldout_top1_generated", "top-1 (generated)")]))
    return rows


def main(argv: list[str]) -> None:
    del argv
    from infer.platform import configure_xla_cpu
    configure_xla_cpu()
    run(data=FLAGS.data, epochs=FLAGS.epochs, num_layers=FLAGS.num_layers,
        batch_size=FLAGS.batch_size, lr=FLAGS.lr, warmup=FLAGS.warmup,
        weight_decay=FLAGS.weight_decay, clip=FLAGS.clip,
        self_draft_layers=[int(x) for x in FLAGS.self_draft_layers], seed=FLAGS.seed,
        max_sequences=FLAGS.max_sequences, weights=FLAGS.weights, out=FLAGS.out)


if __name__ == "__main__":
    from experiments.common import run_experiment
    run_experiment(main, FLAGS)
