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

from absl import flags

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

def training_rows(tokenizer, num_sequences: int, prompt_len: int, chat_fraction: float,
                  greedy_fraction: float, temperature: float, seed: int) -> tuple:
    """The rows of the training data before generation: (prompts, chat [N] bool, greedy [N]
    bool, SamplingParams per row), greedy rows at temperature 0, the others at `temperature`
    with a seed per row (see the module docstring)."""
    import numpy as np

    from experiments.workloads import training_prompts
    from infer.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    prompts, chat = training_prompts(tokenizer, num_sequences, prompt_len, chat_fraction, rng)
    greedy = rng.random(num_sequences) < greedy_fraction
    params = [SamplingParams() if greedy[i] else
              SamplingParams(temperature=temperature, seed=(seed * 1_000_003 + i) % 2**32)
              for i in range(num_sequences)]
    return prompts, chat, greedy, params


def continuations(steps, prompts: list[list[int]], params: list, new_tokens: int,
                  eos: set[int]) -> list[list[int]]:
    """One batch: each prompt's continuation (at most `new_tokens`) through its first
    end-of-turn token, which is kept."""
    import numpy as np

    from infer.engine.simple_loop import decode_stream

    generated = np.stack(list(decode_stream(steps, prompts, params, new_tokens)), axis=1)
    out = []
    for gen in generated.tolist():
        stop = next((j + 1 for j, t in enumerate(gen) if t in eos), len(gen))
        out.append(gen[:stop])
    return out


def generate_training_data(*, num_sequences: int, prompt_len: int, new_tokens: int,
                           temperature: float, seed: int, out_path: str, batch_size: int = 16,
                           greedy_fraction: float = 0.5, chat_fraction: float = 0.5) -> dict:
    """Generates, records and saves the data (see the module docstring); returns a summary."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from experiments.workloads import TRAIN_CHARS
    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load

    start_time = time.perf_counter()
    config, model, tokenizer = load("smollm2-135m", "float32")
    steps = DeviceSteps(model)
    prompts, chat, greedy, params = training_rows(tokenizer, num_sequences, prompt_len,
                                                  chat_fraction, greedy_fraction, temperature,
                                                  seed)
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
        for i, gen in zip(rows, continuations(steps, prompts[lo:rows.stop], params[lo:rows.stop],
                                              new_tokens, eos)):
            seq = prompts[i] + gen
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


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(generate_training_data, FLAGS, args=lambda f: {"out_path": f.out})
