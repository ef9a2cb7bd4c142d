"""A reduced draft vocabulary (FR-Spec): the target's token ids ranked by how often the target
itself generates them.

  python -m experiments.draft_vocab       # generate, rank, write (~9 min on 2 quiet cores)
  python -m experiments.draft_vocab --data=.cache/spec_data/smollm2_768.npz

SmolLM2 continues prompts from the training part of the text (`workloads.training_prompts`, as
`experiments.spec_data` builds them: half chat-formatted, half greedy) through the plain loop in
batches, or the generated part of an existing `spec_data` file is read instead (`--data`). A
row's generation ends at its first end-of-turn token, which counts: a draft must be able to
propose it. Ids are ranked by their count in the generations of the training split
(`workloads.split_heldout`), ties by their count in the tokenized training text, then by id, so
every id has a rank and the file is a permutation of the whole vocabulary: the top N of any N is
a prefix. Coverage, the fraction of generated tokens whose id is in the top N, is measured on
the held-out split's generations and on greedy answers to the held-out chat prompts that
`experiments.speculation` runs its model proposers on.

Output: `--out` (int32 [V], default weights/draft_vocab_smollm2.npy, the default of
`SpeculativeConfig.draft_vocab_path`) and one row in results/draft_vocab.jsonl.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from absl import flags

from experiments.common import validate_list_flag, validate_output_flag
from experiments.spec_data import define_generation_flags

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_string("data", "", "a spec_data .npz whose generated tokens are counted (empty: "
                    "generate them here)", flag_values=FLAGS)
# Two at least: `split_heldout` holds one out, and one is left to rank the ids by.
flags.DEFINE_integer("num_sequences", 768, "sequences to generate", lower_bound=2,
                     flag_values=FLAGS)
define_generation_flags(FLAGS, new_tokens=128)
flags.DEFINE_integer("batch_size", 32, "rows generated together", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("eval_prompts", 16, "held-out chat prompts answered greedily for the "
                     "second coverage figure (0: none)", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("eval_tokens", 64, "tokens of each held-out chat answer", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_list("sizes", ["4096", "8192", "16384", "32768"], "N of the coverage columns",
                  flag_values=FLAGS)
validate_list_flag(FLAGS, "sizes", parse=int, lower_bound=1, allow_empty=True)  # empty: the ranking alone
flags.DEFINE_integer("seed", 0, "seed of the prompt choice and of the sampled rows",
                     flag_values=FLAGS)
flags.DEFINE_string("out", "weights/draft_vocab_smollm2.npy", "the ranking (int32 [V])",
                    flag_values=FLAGS)
# np.save adds .npy to a path without it: the file would not be where the row says.
validate_output_flag(FLAGS, "out", suffix=".npy")
flags.DEFINE_string("results", "results/draft_vocab.jsonl", "JSONL row", flag_values=FLAGS)
validate_output_flag(FLAGS, "results")


def rank_ids(counts: Any, fallback: Any) -> Any:
    """Ids sorted by `counts` [V] descending, ties by `fallback` [V] descending, then by id."""
    import numpy as np

    ids = np.arange(len(counts))
    return np.lexsort((ids, -np.asarray(fallback), -np.asarray(counts))).astype(np.int32)


def coverage(ranking: Any, tokens: Any, sizes: Sequence[int]) -> dict[int, float]:
    """Per N of `sizes`: the fraction of `tokens` whose id is among the first N of `ranking`."""
    import numpy as np

    rank_of = np.empty(len(ranking), np.int64)
    rank_of[ranking] = np.arange(len(ranking))
    ranks = rank_of[np.asarray(tokens, np.int64)]
    return {n: float((ranks < n).mean()) if len(ranks) else float("nan") for n in sizes}


def generate(steps: Any, prompts: list[list[int]], params: list[Any], new_tokens: int,
             batch_size: int, eos: set[int]) -> list[list[int]]:
    """Each prompt's continuation through its first end-of-turn token (kept), batch by batch:
    `spec_data.continuations`, the training data's own."""
    from tqdm import tqdm

    from experiments.spec_data import continuations

    out = []
    for lo in tqdm(range(0, len(prompts), batch_size), desc="batches"):
        rows = slice(lo, lo + batch_size)
        out += continuations(steps, prompts[rows], params[rows], new_tokens, eos)
    return out


def run(*, data: str, num_sequences: int, prompt_len: int, new_tokens: int, temperature: float,
        greedy_fraction: float, chat_fraction: float, batch_size: int, eval_prompts: int,
        eval_tokens: int, sizes: list[int], seed: int, out: str, results: str
        ) -> dict[str, Any]:
    """Generates (or reads) the target's text, writes the ranking to `out`; returns the row."""
    from experiments.common import check_output_path
    from experiments.speculation import check_prompt_count
    from experiments.training import check_input_file

    # Before JAX starts and the model loads: each of these failed only after the generation,
    # the ranking already written over `out`, or the result row at the very end.
    if data:
        check_input_file("data", data)
    if eval_prompts:
        check_prompt_count("chat", eval_prompts, 500, "eval_prompts")
    check_output_path(out, ".npy", flag="out")
    check_output_path(results, flag="results")

    import numpy as np

    from experiments.common import ResultLog, real_text
    from experiments.spec_data import load_training_data, training_rows
    from experiments.workloads import TRAIN_CHARS, build_prompts, split_heldout
    from infer.engine.device_steps import DeviceSteps
    from infer.io.loader import load
    from infer.sampling_params import SamplingParams

    start = time.perf_counter()
    config, model, tokenizer = load("smollm2-135m", "float32")
    steps = DeviceSteps(model)
    eos = set(tokenizer.eos_ids)
    if data:
        arrays = load_training_data(data)
        generated = [arrays["tokens"][i, arrays["prompt_lens"][i]:arrays["lengths"][i]].tolist()
                     for i in range(len(arrays["lengths"]))]
    else:
        prompts, _, _, params = training_rows(tokenizer, num_sequences, prompt_len,
                                              chat_fraction, greedy_fraction, temperature, seed)
        generated = generate(steps, prompts, params, new_tokens, batch_size, eos)
    gen_seconds = time.perf_counter() - start
    train, held = split_heldout(len(generated))

    def flat(rows: Sequence[int]) -> np.ndarray:
        return np.asarray([t for i in rows for t in generated[i]], np.int64)

    vocab = config.vocab_size
    counts = np.bincount(flat(train), minlength=vocab)
    # Ties (most ids are never generated) go to the ids the training text uses most.
    fallback = np.bincount(np.asarray(tokenizer.encode(real_text(TRAIN_CHARS), add_bos=False)),
                           minlength=vocab)
    ranking = rank_ids(counts, fallback)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.save(out, ranking)

    row: dict[str, Any] = {
        "experiment": "draft_vocab", "model": config.name, "data": data or None,
        "num_sequences": len(generated), "seed": seed, "vocab_size": vocab, "out": out,
        "train_generated_tokens": int(counts.sum()),
        "distinct_generated_ids": int((counts > 0).sum()),
        "held_out_generated_tokens": int(len(flat(held))),
        "coverage_held_out": coverage(ranking, flat(held), sizes),
        "generate_s": gen_seconds,
    }
    if not data:
        row.update(prompt_len=prompt_len, new_tokens=new_tokens, temperature=temperature,
                   greedy_fraction=greedy_fraction, chat_fraction=chat_fraction)
    if eval_prompts:
        # The model proposers' workload in experiments.speculation: held-out chat prompts, greedy.
        chat = build_prompts(tokenizer, "chat", eval_prompts, 500)
        answers = generate(steps, chat, [SamplingParams()] * len(chat), eval_tokens, batch_size,
                           eos)
        answer_tokens = np.asarray([t for a in answers for t in a], np.int64)
        row["held_out_chat_answer_tokens"] = int(len(answer_tokens))
        row["coverage_held_out_chat"] = coverage(ranking, answer_tokens, sizes)
    row["seconds"] = time.perf_counter() - start
    ResultLog(results).append(row, point={k: row[k] for k in ("experiment", "data", "seed",
                                                               "num_sequences")})
    for name in ("coverage_held_out", "coverage_held_out_chat"):
        if name in row:
            print(name, " ".join(f"top {n}: {c:.4f}" for n, c in row[name].items()))
    print(f"wrote {out} ({vocab} ids; {row['distinct_generated_ids']} ever generated)")
    return row


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
