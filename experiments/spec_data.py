"""Training data for speculative-decoding drafts: the target's own continuations and features.

  python -m experiments.spec_data --num_sequences=256 --prompt_len=64 --new_tokens=96

SmolLM2 (the target) continues prompts built from the training part of the text (characters
[0, 300_000) of `real_text`; evaluation text starts at 360_000): half chat-formatted instructions
("Summarize:", "Explain:", "Continue:", ... over a snippet, through the tokenizer's chat
template), half plain text snippets. Half the rows decode greedily, half sample at
`--temperature`, so drafts see both kinds of text. A row ends at its first end-of-turn token.
Then one `forward_step` pass per batch over prompt + continuation records the target's final
hidden states (after the final norm: its *features*) at every position.

Output, an `.npz` readable with `allow_pickle=False` (see `load_training_data`):
  tokens [N, L] int32 (0 past each row's length), hidden [N, L, E] float16, lengths [N],
  prompt_lens [N], chat [N] bool, greedy [N] bool, meta (a JSON string).
The default path is under `.cache/` (git-ignored): about 60 MB for the defaults.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from absl import flags

if TYPE_CHECKING:
    import numpy as np

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_integer("num_sequences", 256, "sequences to generate", flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 64, "tokens of training text per prompt (chat prompts add "
                     "the template and the instruction)", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 96, "tokens generated per sequence (at most)", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.7, "temperature of the sampled rows", flag_values=FLAGS)
flags.DEFINE_float("greedy_fraction", 0.5, "fraction of rows decoded greedily", flag_values=FLAGS)
flags.DEFINE_float("chat_fraction", 0.5, "fraction of chat-formatted prompts", flag_values=FLAGS)
flags.DEFINE_integer("batch_size", 16, "rows generated together", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "seed of the prompt choice and of the sampled rows", flag_values=FLAGS)
flags.DEFINE_string("out", ".cache/spec_data/smollm2.npz", "output .npz", flag_values=FLAGS)

TRAIN_CHARS = 300_000  # real_text[:TRAIN_CHARS] is training text; >= 360_000 is held out
INSTRUCTIONS = (
    "Summarize the following text.",
    "Explain the following in simple terms.",
    "Continue the following text.",
    "What is this text about?",
    "Rewrite the following more clearly.",
    "Give a short Python example related to this text.",
    "List the key points of this text.",
    "Explain:",
    "Summarize:",
    "Continue:",
)


def build_prompts(tokenizer, num_sequences: int, prompt_len: int, chat_fraction: float,
                  rng) -> tuple[list[list[int]], list[bool]]:
    """Prompt token ids and whether each is chat-formatted, from snippets of the training text."""
    from experiments.common import real_text

    text = real_text(TRAIN_CHARS)
    chunk = prompt_len * 8  # characters that surely hold prompt_len tokens
    prompts, chat = [], []
    for _ in range(num_sequences):
        start = int(rng.integers(0, TRAIN_CHARS - chunk))
        space = text.find(" ", start, start + 64)  # start at a word
        start = start if space < 0 else space + 1
        ids = tokenizer.encode(text[start:start + chunk], add_bos=False)[:prompt_len]
        if rng.random() < chat_fraction:
            instruction = INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]
            message = f"{instruction}\n\n{tokenizer.decode(ids)}"
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}])
            prompts.append(tokenizer.encode(rendered, add_bos=False))
            chat.append(True)
        else:
            prompts.append(list(ids))
            chat.append(False)
    return prompts, chat


def generate_training_data(*, num_sequences: int, prompt_len: int, new_tokens: int,
                           temperature: float, seed: int, out_path: str, batch_size: int = 16,
                           greedy_fraction: float = 0.5, chat_fraction: float = 0.5) -> dict:
    """Generates, records and saves the data (see the module docstring); returns a summary."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import decode_stream
    from infer.io.loader import load
    from infer.sampling_params import SamplingParams

    start_time = time.perf_counter()
    config, model, tokenizer = load("smollm2-135m", "float32")
    steps = DeviceSteps(model)
    rng = np.random.default_rng(seed)
    prompts, chat = build_prompts(tokenizer, num_sequences, prompt_len, chat_fraction, rng)
    greedy = rng.random(num_sequences) < greedy_fraction
    eos = set(tokenizer.eos_ids)
    width = max(len(p) for p in prompts) + new_tokens
    width = -(-width // 16) * 16  # one shape for every batch's feature pass

    tokens = np.zeros((num_sequences, width), np.int32)
    hidden = np.zeros((num_sequences, width, config.hidden_size), np.float16)
    lengths = np.zeros(num_sequences, np.int32)
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    head = (model.embed if model.lm_head is None else model.lm_head)[...]
    fp16_argmax = jax.jit(lambda w, h, logits: jnp.argmax(  # weights an argument, not a constant
        jnp.einsum("bte,ve->btv", h.astype(jnp.float32), w), -1) == jnp.argmax(logits, -1))
    agree_fp16, agree_greedy = [0, 0], [0, 0]  # [matches, positions]

    for lo in tqdm(range(0, num_sequences, batch_size), desc="batches"):
        rows = range(lo, min(lo + batch_size, num_sequences))
        params = [SamplingParams() if greedy[i] else
                  SamplingParams(temperature=temperature, seed=(seed * 1_000_003 + i) % 2**32)
                  for i in rows]
        generated = np.stack(list(decode_stream(steps, [prompts[i] for i in rows], params,
                                                new_tokens)), axis=1)  # [B, new_tokens]
        for j, i in enumerate(rows):
            gen = list(generated[j])
            stop = next((k + 1 for k, t in enumerate(gen) if int(t) in eos), len(gen))
            seq = prompts[i] + [int(t) for t in gen[:stop]]
            tokens[i, :len(seq)] = seq
            lengths[i] = len(seq)

        # The features: one pass over prompt + continuation, every position.
        b = len(rows)
        cache = KVCache.create(config.num_layers, b, width, config.num_kv_heads, config.head_dim)
        meta = AttentionMetadata.for_prefill(jnp.asarray(lengths[lo:lo + b]), width)
        logits, h, _ = steps.forward_step(cache, jnp.asarray(tokens[lo:lo + b]), meta)
        h16 = np.asarray(h).astype(np.float16)
        hidden[lo:lo + b] = h16
        valid = np.arange(width)[None, :] < lengths[lo:lo + b, None]
        ok = np.asarray(fp16_argmax(head, jnp.asarray(h16), logits))
        agree_fp16[0] += int((ok & valid).sum())
        agree_fp16[1] += int(valid.sum())
        # Greedy rows: the recorded logits must pick the generated tokens back.
        argmax = np.asarray(jnp.argmax(logits, -1))
        for j, i in enumerate(rows):
            if greedy[i]:
                span = slice(prompt_lens[i] - 1, lengths[i] - 1)
                agree_greedy[0] += int((argmax[j, span] == tokens[i, span.start + 1:lengths[i]]).sum())
                agree_greedy[1] += span.stop - span.start
        hidden[lo:lo + b][~valid] = 0

    summary = {
        "experiment": "spec_data", "model": config.name, "num_sequences": num_sequences,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "temperature": temperature,
        "greedy_fraction": greedy_fraction, "chat_fraction": chat_fraction, "seed": seed,
        "width": width, "tokens_total": int(lengths.sum()),
        "generated_total": int((lengths - prompt_lens).sum()),
        "ended_with_eos": int(sum(int(tokens[i, lengths[i] - 1]) in eos
                                  for i in range(num_sequences))),
        "fp16_feature_argmax_agreement": agree_fp16[0] / max(agree_fp16[1], 1),
        "greedy_replay_agreement": agree_greedy[0] / max(agree_greedy[1], 1),
        "text_chars": [0, TRAIN_CHARS], "seconds": time.perf_counter() - start_time,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    np.savez(out_path, tokens=tokens, hidden=hidden, lengths=lengths, prompt_lens=prompt_lens,
             chat=np.array(chat), greedy=greedy, meta=np.array(json.dumps(summary)))
    summary["bytes"] = os.path.getsize(out_path)
    summary["path"] = out_path
    print(json.dumps(summary, indent=1))
    print("example (chat)" if chat[0] else "example (plain)", repr(
        tokenizer.decode(tokens[0, :lengths[0]].tolist())[:600]))
    return summary


def load_training_data(path: str) -> dict:
    """The arrays of a `generate_training_data` file (no pickle), `meta` parsed."""
    import numpy as np

    with np.load(path, allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    data["meta"] = json.loads(str(data["meta"]))
    return data


def split_heldout(num_sequences: int, fraction: float = 0.1, seed: int = 0):
    """(train indices, held-out indices): a fixed random `fraction` of sequences held out."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(num_sequences)
    n_held = max(1, int(round(num_sequences * fraction)))
    return np.sort(order[n_held:]), np.sort(order[:n_held])


# -- shared by train_eagle and train_draft ---------------------------------------------------

def batches(data: dict, indices, batch_size: int, rng=None):
    """Yields (tokens [B, L], hidden [B, L, E] float16, lengths [B], prompt_lens [B]) over
    `indices` (shuffled when rng is given), every batch of `batch_size` rows: the last one padded
    with empty rows (length 0), which every loss masks out, so a single shape is ever compiled."""
    import numpy as np

    order = np.array(indices) if rng is None else rng.permutation(indices)
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        pad = batch_size - len(rows)
        out = [data[k][rows] for k in ("tokens", "hidden", "lengths", "prompt_lens")]
        if pad:
            out = [np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) for x in out]
        yield tuple(out)


def generated_mask(prompt_lens, num_positions: int, offset: int):
    """[B, T] float: row t's prediction is of token t + offset, which the target generated (not
    part of the prompt). offset 1 for a draft model at position t, 2 for the EAGLE head."""
    import jax.numpy as jnp

    t = jnp.arange(num_positions)[None, :] + offset
    return (t >= prompt_lens[:, None]).astype(jnp.float32)


def training_split(path: str, max_sequences: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """(dataset, train indices, held-out indices) of the file at `path`: 10% of its first
    `max_sequences` sequences (all when <= 0) held out, the same ones every run."""
    dataset = load_training_data(path)
    n = len(dataset["lengths"])
    train_idx, held_idx = split_heldout(n if max_sequences <= 0 else min(max_sequences, n), 0.1)
    return dataset, train_idx, held_idx


def make_optimizer(*, lr: float, total_steps: int, warmup_steps: int, weight_decay: float,
                   clip: float):
    """AdamW (matrices decayed, norm scales not) with linear warmup then cosine decay to 5% of
    `lr`, after clipping the gradients' global norm to `clip`."""
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(1, min(warmup_steps, total_steps - 1)), max(total_steps, 2), lr * 0.05)
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
        return {k: v / max(self.count, 1.0) for k, v in self.sums.items()}


def main(argv: list[str]) -> None:
    del argv
    from infer.platform import configure_xla_cpu
    configure_xla_cpu()
    generate_training_data(num_sequences=FLAGS.num_sequences, prompt_len=FLAGS.prompt_len,
                           new_tokens=FLAGS.new_tokens, temperature=FLAGS.temperature,
                           seed=FLAGS.seed, out_path=FLAGS.out, batch_size=FLAGS.batch_size,
                           greedy_fraction=FLAGS.greedy_fraction,
                           chat_fraction=FLAGS.chat_fraction)


if __name__ == "__main__":
    from experiments.common import run_experiment
    run_experiment(main, FLAGS)
