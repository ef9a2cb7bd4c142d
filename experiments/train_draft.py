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

import time

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag
from experiments.training import define_trainer_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
define_trainer_flags(FLAGS, epochs=3, lr=5e-4, clip=1.0)
flags.DEFINE_integer("num_layers", 2, "decoder layers of the draft", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_list("self_draft_layers", ["2", "4", "8"], "self-drafts measured for comparison",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "self_draft_layers", parse=int, lower_bound=1, allow_empty=True)
flags.DEFINE_integer("seed", 0, "shuffling seed", flag_values=FLAGS)
flags.DEFINE_string("weights", "weights/draft_smollm2.safetensors", "output weights",
                    flag_values=FLAGS)
validate_output_flag(FLAGS, "weights")
flags.DEFINE_string("out", "results/train_draft.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")


def run(*, data: str, epochs: int, num_layers: int, batch_size: int, lr: float, warmup: float,
        weight_decay: float, clip: float, self_draft_layers: list[int], seed: int,
        max_sequences: int, weights: str, out: str) -> list[dict]:
    from experiments.common import check_output_path
    from experiments.training import check_input_file
    from infer.model.config import get_config

    # Before JAX starts and the model loads: 0 epochs saved the untrained draft over --weights,
    # and a draft deeper than the target failed only after the self-draft rows were measured
    # and written.
    if epochs < 1:
        raise ValueError(f"--epochs must be >= 1 (0 would save an untrained draft to "
                         f"--weights={weights!r}), got {epochs}")
    n = get_config("smollm2-135m").num_layers
    if not 1 <= num_layers <= n:
        raise ValueError(f"--num_layers must be in [1, {n}] (the target's layers), got "
                         f"{num_layers}")
    if not all(1 <= k <= n for k in self_draft_layers):
        raise ValueError(f"--self_draft_layers must each be in [1, {n}] (the target's layers), "
                         f"got {list(self_draft_layers)}")
    check_input_file("data", data)
    check_output_path(weights, flag="weights")
    check_output_path(out, flag="out")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.common import ResultLog, markdown_table
    from experiments.training import Trainer, generated_mask, print_curve
    from infer.io.loader import load
    from infer.spec.draft_model import (DRAFT_CONFIG, SHARED, draft_own_params, load_draft,
                                        save_draft, self_draft)
    from infer.spec.training import distill_loss

    start = time.perf_counter()
    config, target, _ = load("smollm2-135m", "float32")
    trainer = Trainer(data=data, max_sequences=max_sequences, batch_size=batch_size,
                      epochs=epochs, lr=lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                      seed=seed)
    log = ResultLog(out)
    settings = trainer.row_settings(seed=seed)

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
            alls, gens = trainer.heldout(eval_step, params, shared)
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
    opt_state = trainer.opt.init(params)
    print(f"draft {draft_cfg.name}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M own "
          f"parameters; {len(trainer.train_idx)} training / {len(trainer.held_idx)} held-out "
          f"sequences; {trainer.total_steps} steps")
    train_step = trainer.train_step(lambda p, shared, tokens, hidden, lengths: distill_loss(
        nnx.merge(graphdef, p, shared), tokens, hidden, lengths))

    name = f"draft_{num_layers}"
    row = {"experiment": "train_draft", "model": name, "layers": num_layers, "epoch": 0, "step": 0,
           **evaluate(params, shared), "seconds": time.perf_counter() - start, **settings}
    log.append(row)
    rows.append(row)

    def epoch_done(epoch: int, step: int, train: dict, params) -> None:
        row = {"experiment": "train_draft", "model": name, "layers": num_layers, "epoch": epoch,
               "step": step, "train_kl": train["loss"], "train_top1": train["top1"],
               "lr": float(trainer.schedule(step)), **evaluate(params, shared),
               "seconds": time.perf_counter() - start, **settings}
        log.append(row)
        rows.append(row)
        print(f"epoch {epoch}: train KL {row['train_kl']:.4f}; held-out KL {row['heldout_kl']:.4f}, "
              f"top-1 {row['heldout_top1']:.3f} (generated text {row['heldout_top1_generated']:.3f})")

    params, curve = trainer.fit(train_step, params, opt_state, loss_name="kl",
                                args=lambda tokens, hidden, lengths, _: (shared, tokens, hidden,
                                                                         lengths),
                                epoch_done=epoch_done)

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
    print_curve(curve, "KL")
    print(markdown_table(rows, [("model", "model"), ("epoch", "epoch"), ("train_kl", "train KL"),
                                ("heldout_kl", "held-out KL"), ("heldout_top1", "top-1"),
                                ("heldout_top1_generated", "top-1 (generated)")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
