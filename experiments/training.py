"""What the drafters' trainers (`train_draft`, `train_eagle`) share: the data split and batches of
a `spec_data` file, the optimizer, the jitted train step, the epoch loop and the held-out pass.
Each trainer keeps its model, its loss and its rows."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from experiments.workloads import split_heldout


def define_trainer_flags(flag_values: Any, *, epochs: int, lr: float, clip: float,
                         min_epochs: int = 1) -> None:
    """The flags both trainers take (the data, the optimizer, the epochs), with each trainer's
    own defaults where they differ; `min_epochs` 0 for a trainer that can evaluate given
    weights without training them."""
    from absl import flags

    for define, name, default, help_, bounds in (
            (flags.DEFINE_string, "data", ".cache/spec_data/smollm2.npz", "spec_data output", {}),
            (flags.DEFINE_integer, "epochs", epochs, "passes over the training sequences",
             {"lower_bound": min_epochs}),
            (flags.DEFINE_integer, "batch_size", 8, "sequences per step", {"lower_bound": 1}),
            (flags.DEFINE_float, "lr", lr, "peak learning rate", {"lower_bound": 0.0}),
            (flags.DEFINE_float, "warmup", 0.05, "fraction of steps of linear warmup",
             {"lower_bound": 0.0, "upper_bound": 1.0}),
            (flags.DEFINE_float, "weight_decay", 0.01, "AdamW weight decay (matrices)",
             {"lower_bound": 0.0}),
            (flags.DEFINE_float, "clip", clip, "gradient global-norm clip", {"lower_bound": 0.0}),
            (flags.DEFINE_integer, "max_sequences", 0, "use only this many sequences (0: all)",
             {"lower_bound": 0})):
        define(name, default, help_, flag_values=flag_values, **bounds)


def check_input_file(flag: str, path: str) -> None:
    """Refuses, naming its flag, an input file that is not there, before the model loads."""
    if not os.path.isfile(path):
        raise ValueError(f"--{flag}={path!r}: no such file")


def training_split(path: str, max_sequences: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """(dataset, train indices, held-out indices) of the file at `path`: 10% of its sequences
    held out, the same ones every run; with `max_sequences` > 0, only those of the first
    `max_sequences` (training and held-out alike). The split is always the whole file's: one
    of the first m sequences alone would train on sequences that a run over the whole file (an
    `--init` continuation, `draft_vocab --data`) holds out, and hold out ones it trained on."""
    from experiments.spec_data import load_training_data

    dataset = load_training_data(path)
    n = len(dataset["lengths"])
    train_idx, held_idx = split_heldout(n, 0.1)
    if 0 < max_sequences < n:
        train_idx = train_idx[train_idx < max_sequences]
        held_idx = held_idx[held_idx < max_sequences]
        if not len(held_idx):
            raise ValueError(f"the first {max_sequences} sequences of {path!r} hold none of its "
                             f"held-out ones: pass a larger --max_sequences")
    return dataset, train_idx, held_idx


def batches(data: dict, indices, batch_size: int, rng=None,
            feature_keys: Sequence[str] = ("hidden",), extra_keys: Sequence[str] = ()
            ) -> Iterator[tuple]:
    """Yields (tokens [B, L], features [B, L, F] float16, lengths [B], prompt_lens [B], then
    the arrays of `extra_keys`) over `indices` (shuffled when rng is given), every batch of
    `batch_size` rows: the last one padded with empty rows (length 0), which every loss masks
    out, so a single shape is ever compiled. The features are the arrays of `feature_keys`
    side by side (an EAGLE-3 head's taps, then the final hidden states)."""
    order = np.array(indices) if rng is None else rng.permutation(indices)
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        pad = batch_size - len(rows)
        features = [data[k][rows] for k in feature_keys]
        out = [data["tokens"][rows],
               features[0] if len(features) == 1 else np.concatenate(features, axis=-1),
               *(data[k][rows] for k in ("lengths", "prompt_lens", *extra_keys))]
        if pad:
            out = [np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) for x in out]
        yield tuple(out)


def generated_mask(prompt_lens, num_positions: int, offset: int):
    """[B, T] float: row t's prediction is of token t + offset, which the target generated (not
    part of the prompt). offset 1 for a draft model at position t, 2 for the EAGLE head."""
    import jax.numpy as jnp

    t = jnp.arange(num_positions)[None, :] + offset
    return (t >= prompt_lens[:, None]).astype(jnp.float32)


def make_optimizer(*, lr: float, total_steps: int, warmup_steps: int, weight_decay: float,
                   clip: float):
    """AdamW (matrices decayed, norm scales not) with linear warmup then cosine decay to 5% of
    `lr`, after clipping the gradients' global norm to `clip`."""
    import jax
    import optax

    # No floor of one warmup step: its learning rate is 0, so `--warmup=0` would still waste
    # the first step, and a one-step run would train nothing.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(0, min(warmup_steps, total_steps - 1)), max(total_steps, 1), lr * 0.05)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                   mask=decay_mask)), schedule


class MetricMeans:
    """Averages of per-batch mean metrics, weighted by each batch's `count` of positions."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0.0

    def add(self, metrics: dict) -> None:
        n = float(metrics["count"])
        for k, v in metrics.items():
            if k != "count" and getattr(v, "ndim", 0) == 0:
                self.sums[k] = self.sums.get(k, 0.0) + float(v) * n
        self.count += n

    def means(self) -> dict[str, float]:
        """NaN over no positions (held-out rows too short for a drafted step), not 0."""
        return {k: v / self.count if self.count else math.nan for k, v in self.sums.items()}


class Trainer:
    """One trainer's set-up: the data split, the optimizer over `epochs` passes, and the jitted
    step of `loss_fn(params, *args) -> (loss, metrics)` (AdamW through `make_optimizer`; the
    metrics named in `drop` are per-position arrays the step does not return)."""

    def __init__(self, *, data: str, max_sequences: int, batch_size: int, epochs: int, lr: float,
                 warmup: float, weight_decay: float, clip: float, seed: int,
                 feature_keys: Sequence[str] = ("hidden",), extra_keys: Sequence[str] = ()
                 ) -> None:
        """`feature_keys` and `extra_keys`: what each batch carries (`batches`)."""
        # Before the data loads: a batch of 0 divides by zero only once it has, and negative
        # epochs would pass for no training at all. 0 epochs (evaluate only) is the caller's call.
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        self.dataset, self.train_idx, self.held_idx = training_split(data, max_sequences)
        missing = [k for k in (*feature_keys, *extra_keys) if k not in self.dataset]
        if missing:
            raise ValueError(f"{data!r} has no {missing}: regenerate it with experiments.spec_data"
                             f" (--feature_layers for an EAGLE-3 head's taps)")
        self.feature_keys, self.extra_keys = tuple(feature_keys), tuple(extra_keys)
        self.batch_size, self.epochs, self.seed = batch_size, epochs, seed
        self.steps_per_epoch = math.ceil(len(self.train_idx) / batch_size)
        self.total_steps = self.steps_per_epoch * epochs
        self.opt, self.schedule = make_optimizer(
            lr=lr, total_steps=self.total_steps, warmup_steps=int(warmup * self.total_steps),
            weight_decay=weight_decay, clip=clip)
        self.settings = dict(data=data, epochs=epochs, batch_size=batch_size, lr=lr,
                             warmup=warmup, weight_decay=weight_decay, clip=clip)

    def row_settings(self, **extra: Any) -> dict[str, Any]:
        """The settings every row of the run carries: the shared hyperparameters, `extra` (the
        trainer's own, seed included where it wants it), the split and the data's meta."""
        return {**self.settings, **extra, "train_sequences": len(self.train_idx),
                "heldout_sequences": len(self.held_idx), "data_meta": self.dataset["meta"]}

    def train_step(self, loss_fn: Callable[..., tuple[Any, dict]],
                   drop: Sequence[str] = ("hit",)) -> Callable[..., tuple]:
        """jit of (params, opt_state, *args) -> (params, opt_state, loss, metrics, grad norm)."""
        import jax
        import optax

        opt = self.opt

        @jax.jit
        def step(params, opt_state, *args):
            (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
            updates, opt_state = opt.update(grads, opt_state, params)
            m = {k: v for k, v in m.items() if k not in drop}
            return (optax.apply_updates(params, updates), opt_state, loss, m,
                    optax.global_norm(grads))

        return step

    def heldout(self, eval_step: Callable[..., tuple[dict, ...]], *args: Any
                ) -> list[MetricMeans]:
        """eval_step(*args, tokens, features, lengths, prompt_lens, *extras) -> metric dicts over
        every held-out batch; one MetricMeans per dict it returns."""
        means: list[MetricMeans] = []
        for batch in batches(self.dataset, self.held_idx, self.batch_size,
                             feature_keys=self.feature_keys, extra_keys=self.extra_keys):
            out = eval_step(*args, *batch)
            means = means or [MetricMeans() for _ in out]
            for acc, m in zip(means, out):
                acc.add(m)
        return means

    def fit(self, step: Callable[..., tuple], params: Any, opt_state: Any, *,
            args: Callable[..., tuple],
            epoch_done: Callable[[int, int, dict, Any], None], loss_name: str = "loss"
            ) -> tuple[Any, list[float]]:
        """The epoch loop: every training batch, shuffled by `seed`, through `step(params,
        opt_state, *args(tokens, features, lengths, step_number, *extras))`, a progress bar showing the
        loss (as `loss_name`), top-1 and gradient norm; `epoch_done(epoch, steps so far, the
        epoch's mean train metrics, params)` after each epoch. Returns (params, loss per step)."""
        from tqdm import tqdm

        rng = np.random.default_rng(self.seed)
        n, curve = 0, []
        for epoch in range(1, self.epochs + 1):
            train = MetricMeans()
            bar = tqdm(batches(self.dataset, self.train_idx, self.batch_size, rng,
                               self.feature_keys, self.extra_keys),
                       total=self.steps_per_epoch, desc=f"epoch {epoch}/{self.epochs}")
            for tokens, features, lengths, _, *extras in bar:
                params, opt_state, loss, m, gnorm = step(
                    params, opt_state, *args(tokens, features, lengths, n, *extras))
                train.add(m)
                n += 1
                curve.append(float(loss))
                bar.set_postfix({loss_name: f"{float(loss):.3f}",
                                 "top1": f"{float(m['top1']):.3f}",
                                 "gnorm": f"{float(gnorm):.2f}"})
            epoch_done(epoch, n, train.means(), params)
        return params, curve


def print_curve(curve: list[float], name: str) -> None:
    """The loss per step, as the mean of each tenth of training."""
    print(f"{name} curve (mean per tenth of training):")
    tenth = max(1, len(curve) // 10)
    print("  " + " ".join(f"{np.mean(curve[i:i + tenth]):.3f}"
                          for i in range(0, len(curve), tenth)))
