"""Training data for speculative-decoding drafts: the target's own continuations and features.

  python -m experiments.spec_data --num_sequences=256 --prompt_len=64 --new_tokens=96
  python -m experiments.spec_data --num_sequences=1600 --new_tokens=320 --gen_batch_size=64 \
      --self_instruct_fraction=0.5 --feature_layers=1,14 --out=.cache/spec_data/eagle3.npz

SmolLM2 (the target) continues prompts built from the training part of the text (characters
[0, 300_000) of `real_text`; evaluation text starts at 360_000): chat-formatted instructions
("Summarize:", "Explain:", "Continue:", ... over a snippet, through the tokenizer's chat
template) and plain text snippets, `--chat_fraction` of them chat. `--self_instruct_fraction`
of the rows instead carry an instruction SmolLM2 wrote itself (Magpie: the chat template up to
a user's message, the model writes the message), for prompts more diverse than ten templates
over one text. Half the rows decode greedily, half sample at `--temperature`, so drafts see
both kinds of text. The plain loop generates every row until its end-of-turn token (kept) or
`--new_tokens`, in batches of `--gen_batch_size` rows of similar prompt length. Then one
`forward_step` pass per batch over prompt + continuation records the target's final hidden
states (after the final norm: its *features*) at every position, the argmax of its logits
there, and, with `--feature_layers`, the residual stream after those decoder layers (an
EAGLE-3 head's taps).

Output, an `.npz` readable with `allow_pickle=False` (see `load_training_data`):
  tokens [N, L] int32 (0 past each row's length), hidden [N, L, E] float16, taps [N, L, n E]
  float16 (with feature layers), target_argmax [N, L] int32, lengths [N], prompt_lens [N],
  chat [N] bool, self_instruct [N] bool, greedy [N] bool, meta (a JSON string).
The default path is under `.cache/` (git-ignored): about 60 MB for the defaults, 2.5 GB for
the EAGLE-3 command above (1,600 sequences, 384,130 generated tokens; 1 h 34 min on this CPU).
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np
from absl import flags

from experiments.common import validate_list_flag, validate_output_flag


def define_generation_flags(flag_values: flags.FlagValues, *, new_tokens: int) -> None:
    """The flags of the rows `training_rows` makes and the plain loop generates, shared with
    experiments.draft_vocab, which generates the same kind of rows."""
    flags.DEFINE_integer("prompt_len", 64, "tokens of training text per prompt (chat prompts "
                         "add the template and the instruction)", lower_bound=1,
                         flag_values=flag_values)
    flags.DEFINE_integer("new_tokens", new_tokens, "tokens generated per sequence (at most)",
                         lower_bound=1, flag_values=flag_values)
    flags.DEFINE_float("temperature", 0.7, "temperature of the sampled rows", lower_bound=0.0,
                       flag_values=flag_values)
    flags.DEFINE_float("greedy_fraction", 0.5, "fraction of rows decoded greedily",
                       lower_bound=0.0, upper_bound=1.0, flag_values=flag_values)
    flags.DEFINE_float("chat_fraction", 0.5, "fraction of chat-formatted prompts",
                       lower_bound=0.0, upper_bound=1.0, flag_values=flag_values)


FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_integer("num_sequences", 256, "sequences to generate", lower_bound=1,
                     flag_values=FLAGS)
define_generation_flags(FLAGS, new_tokens=96)
flags.DEFINE_integer("batch_size", 16, "rows per feature pass", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("gen_batch_size", 32, "rows the plain loop generates together",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("self_instruct_fraction", 0.0, "fraction of rows whose instruction the "
                   "target writes itself (chat-formatted; the rest as --chat_fraction says)",
                   lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_list("feature_layers", [], "decoder layers whose outputs are recorded beside the "
                  "final hidden state (an EAGLE-3 head's taps), e.g. 1,14", flag_values=FLAGS)
validate_list_flag(FLAGS, "feature_layers", parse=int, lower_bound=0, allow_empty=True)
flags.DEFINE_integer("seed", 0, "seed of the prompt choice and of the sampled rows", flag_values=FLAGS)
flags.DEFINE_string("out", ".cache/spec_data/smollm2.npz", "output .npz", flag_values=FLAGS)
# np.savez adds .npz to a path without it: the file would not be where the summary says.
validate_output_flag(FLAGS, "out", suffix=".npz")


def training_rows(tokenizer, num_sequences: int, prompt_len: int, chat_fraction: float,
                  greedy_fraction: float, temperature: float, seed: int) -> tuple:
    """The rows of the training data before generation: (prompts, chat [N] bool, greedy [N]
    bool, SamplingParams per row), greedy rows at temperature 0, the others at `temperature`
    with a seed per row (see the module docstring)."""
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
    """One batch through the plain loop: each prompt's continuation (at most `new_tokens`)
    through its first end-of-turn token, which is kept; the loop stops once every row has
    ended."""
    from infer.engine.simple_loop import decode_stream

    out: list[list[int]] = [[] for _ in prompts]
    ended = np.zeros(len(prompts), bool)
    stream = decode_stream(steps, prompts, params, new_tokens)
    for tokens in stream:
        for i, t in enumerate(tokens.tolist()):
            if not ended[i]:
                out[i].append(t)
                ended[i] = t in eos
        if ended.all():
            stream.close()
            break
    return out


def batched_continuations(steps, prompts: list[list[int]], params: list, new_tokens: int,
                          eos: set[int], batch_size: int, desc: str) -> list[list[int]]:
    """`continuations` over batches of `batch_size` rows of similar prompt length (sorted, so
    a batch's padding is small), in the prompts' order, with a progress bar."""
    from tqdm import tqdm

    order = np.argsort([len(p) for p in prompts], kind="stable")
    out: list[list[int]] = [[] for _ in prompts]
    for lo in tqdm(range(0, len(order), batch_size), desc=desc):
        rows = order[lo:lo + batch_size].tolist()
        for i, gen in zip(rows, continuations(steps, [prompts[i] for i in rows],
                                              [params[i] for i in rows], new_tokens, eos)):
            out[i] = gen
    return out


def self_instructions(steps, tokenizer, count: int, seed: int, batch_size: int,
                      max_tokens: int = 64) -> list[str | None]:
    """Instructions the target writes itself (Magpie): fed its chat template up to the start of
    a user's message, it writes the message, sampled at temperature 1 (no top-p: its sort of the
    whole vocabulary would dominate the step on CPU). None for a message under 8 characters,
    which the caller replaces."""
    from infer.sampling_params import SamplingParams

    mark = "@@INSTRUCTION@@"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": mark}])
    prefix = tokenizer.encode(rendered[:rendered.index(mark)], add_bos=False)
    params = [SamplingParams(temperature=1.0, seed=(seed * 7_000_003 + i) % 2**32)
              for i in range(count)]
    eos = set(tokenizer.eos_ids)
    texts = [tokenizer.decode([t for t in gen if t not in eos]).strip()
             for gen in batched_continuations(steps, [prefix] * count, params, max_tokens, eos,
                                              batch_size, "instructions")]
    return [t if len(t) >= 8 else None for t in texts]


def check_feature_layers_flag(feature_layers: Sequence[int]) -> None:
    """Refuses --feature_layers SmolLM2 has no taps for (`llama.check_feature_layers`), before
    the model loads: the feature pass, after all the generation, would refuse them."""
    from infer.model.config import get_config

    layers, n = [int(i) for i in feature_layers], get_config("smollm2-135m").num_layers
    if layers != sorted(set(layers)) or not all(0 <= i < n for i in layers):
        raise ValueError(f"--feature_layers must be increasing distinct decoder layers in "
                         f"[0, {n}), got {layers}")


def feature_pass(steps, config, tokens: np.ndarray, lengths: np.ndarray, batch_size: int):
    """Yields (rows, features [b, w, F] float16, argmax [b, w]) over the sequences in order of
    length (so that each batch's width, a multiple of 32, wastes little): one `forward_step`
    per batch, the target's features (`steps.feature_layers`, the final hidden state last) and
    the argmax of its logits at every position."""
    import jax.numpy as jnp

    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata

    order = np.argsort(lengths, kind="stable")
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        width = -(-int(lengths[rows].max()) // 32) * 32
        cache = KVCache.create(config.num_layers, len(rows), width, config.num_kv_heads,
                               config.head_dim)
        meta = AttentionMetadata.for_prefill(jnp.asarray(lengths[rows]), width)
        logits, features, _ = steps.forward_step(cache, jnp.asarray(tokens[rows, :width]), meta)
        yield rows, np.asarray(features).astype(np.float16), np.array(jnp.argmax(logits, -1))


def generate_training_data(*, num_sequences: int, prompt_len: int, new_tokens: int,
                           temperature: float, seed: int, out_path: str, batch_size: int = 16,
                           greedy_fraction: float = 0.5, chat_fraction: float = 0.5,
                           self_instruct_fraction: float = 0.0,
                           feature_layers: Sequence[int] = (), gen_batch_size: int = 32) -> dict:
    """Generates, records and saves the data (see the module docstring); returns a summary."""
    from experiments.common import check_output_path

    # Before JAX starts: both failed only after the whole generation.
    check_output_path(out_path, ".npz", flag="out")
    check_feature_layers_flag(feature_layers)

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from experiments.workloads import TRAIN_CHARS
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load

    start_time = time.perf_counter()
    config, model, tokenizer = load("smollm2-135m", "float32")
    feature_layers = tuple(int(i) for i in feature_layers)
    steps = DeviceSteps(model, feature_layers=feature_layers)
    prompts, chat, greedy, params = training_rows(tokenizer, num_sequences, prompt_len,
                                                  chat_fraction, greedy_fraction, temperature,
                                                  seed)
    rng = np.random.default_rng(seed + 1)
    self_rows = np.flatnonzero(rng.random(num_sequences) < self_instruct_fraction)
    # The plain loop, not the engine: rows of one batch start together, and on this CPU its
    # batch-32 step is several times the engine's throughput for this offline job.
    plain_steps = DeviceSteps(model)
    self_instruct = np.zeros(num_sequences, bool)
    if len(self_rows):
        for i, text in zip(self_rows, self_instructions(plain_steps, tokenizer, len(self_rows),
                                                        seed, gen_batch_size)):
            if text is not None:  # else the row keeps its snippet prompt
                rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
                prompts[i], chat[i], self_instruct[i] = (
                    tokenizer.encode(rendered, add_bos=False), True, True)
    eos = set(tokenizer.eos_ids)
    generated = batched_continuations(plain_steps, prompts, params, new_tokens, eos,
                                      gen_batch_size, "answers")
    seqs = [list(p) + gen for p, gen in zip(prompts, generated)]
    width = -(-max(map(len, seqs)) // 32) * 32

    tokens = np.zeros((num_sequences, width), np.int32)
    lengths = np.array([len(q) for q in seqs], np.int32)
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = q
    e = config.hidden_size
    hidden = np.zeros((num_sequences, width, e), np.float16)
    taps = np.zeros((num_sequences, width, e * len(feature_layers)), np.float16)
    target_argmax = np.zeros((num_sequences, width), np.int32)
    head = (model.embed if model.lm_head is None else model.lm_head)[...]
    fp16_argmax = jax.jit(lambda w, h: jnp.argmax(  # weights an argument, not a constant
        jnp.einsum("bte,ve->btv", h.astype(jnp.float32), w), -1))
    agree_fp16, agree_greedy = [0, 0], [0, 0]  # [matches, positions]
    tap_max = 0.0
    batches = feature_pass(steps, config, tokens, lengths, batch_size)
    for rows, features, argmax in tqdm(batches, total=-(-num_sequences // batch_size),
                                       desc="features"):
        w = features.shape[1]
        valid = np.arange(w)[None, :] < lengths[rows, None]
        features[~valid] = 0
        argmax[~valid] = 0
        hidden[rows, :w] = features[..., -e:]
        taps[rows, :w] = features[..., :-e]
        tap_max = max(tap_max, float(np.abs(features[..., :-e]).max(initial=0.0)))
        target_argmax[rows, :w] = argmax
        ok = np.asarray(fp16_argmax(head, jnp.asarray(features[..., -e:]))) == argmax
        agree_fp16[0] += int((ok & valid).sum())
        agree_fp16[1] += int(valid.sum())
        for j, i in enumerate(rows):  # greedy rows: the logits must pick the generated tokens
            if greedy[i]:
                span = slice(prompt_lens[i] - 1, lengths[i] - 1)
                agree_greedy[0] += int((argmax[j, span] == tokens[i, span.start + 1:lengths[i]]).sum())
                agree_greedy[1] += span.stop - span.start

    summary = {
        "experiment": "spec_data", "model": config.name, "num_sequences": num_sequences,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "temperature": temperature,
        "greedy_fraction": greedy_fraction, "chat_fraction": chat_fraction,
        "self_instruct_fraction": self_instruct_fraction,
        "self_instructed": int(self_instruct.sum()), "feature_layers": list(feature_layers),
        "seed": seed, "width": width, "tokens_total": int(lengths.sum()),
        "generated_total": int((lengths - prompt_lens).sum()),
        "ended_with_eos": int(sum(int(tokens[i, lengths[i] - 1]) in eos
                                  for i in range(num_sequences))),
        "fp16_feature_argmax_agreement": agree_fp16[0] / max(agree_fp16[1], 1),
        "greedy_replay_agreement": agree_greedy[0] / max(agree_greedy[1], 1),
        "max_abs_tap": tap_max, "text_chars": [0, TRAIN_CHARS],
        "seconds": time.perf_counter() - start_time,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    np.savez(out_path, tokens=tokens, hidden=hidden, lengths=lengths, prompt_lens=prompt_lens,
             chat=np.array(chat), greedy=greedy, self_instruct=self_instruct,
             target_argmax=target_argmax, meta=np.array(json.dumps(summary)),
             **({"taps": taps} if feature_layers else {}))
    summary["bytes"] = os.path.getsize(out_path)
    summary["path"] = out_path
    print(json.dumps(summary, indent=1))
    for kind, rows in (("self-instructed", np.flatnonzero(self_instruct)),
                       ("chat", np.flatnonzero(np.array(chat) & ~self_instruct)),
                       ("plain", np.flatnonzero(~np.array(chat)))):
        if len(rows):
            i = rows[0]
            print(f"example ({kind}):", repr(tokenizer.decode(tokens[i, :lengths[i]].tolist())[:600]))
    return summary


def load_training_data(path: str) -> dict:
    """The arrays of a `generate_training_data` file (no pickle), `meta` parsed."""
    with np.load(path, allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    data["meta"] = json.loads(str(data["meta"]))
    return data


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(generate_training_data, FLAGS, args=lambda f: {"out_path": f.out})
