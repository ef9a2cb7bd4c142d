"""How often the EAGLE head's first draft is the target's own next token, teacher-forced, on the
prompts of `experiments.speculation` and SmolLM2's greedy answers to them.

  python -m experiments.eagle_agreement --kinds=chat,grounded --num_prompts=4 --max_tokens=32

The training script reports this agreement on held-out training-style text; the speculation
experiment measures acceptance inside the engine. This runs the training's own teacher-forced
pass (`infer.eagle.eagle_forward`, true features at every position) over the speculation
experiment's prompts, so the three can be compared: if the engine accepted fewer drafts than this
agreement on answer tokens predicts, the engine's drafting would be at fault; if they match, the
head is. Writes one JSON line per prompt kind to results/eagle_agreement.jsonl (--out).
"""

from __future__ import annotations

from absl import flags

from experiments.common import define_resume_flag, validate_list_flag, validate_output_flag

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("kinds", ["chat"], "prompt kinds of experiments.speculation", flag_values=FLAGS)
validate_list_flag(FLAGS, "kinds", choices=["grounded", "chat", "repetitive"])
flags.DEFINE_integer("num_prompts", 4, "prompts per kind", lower_bound=1, flag_values=FLAGS)
# Two at least: the first answer token follows the prompt's last position, which the target
# computes itself, so one token leaves no answer position to score (a division by zero).
flags.DEFINE_integer("max_tokens", 32, "greedy answer tokens per prompt", lower_bound=2,
                     flag_values=FLAGS)
flags.DEFINE_integer("snippet_chars", 500, "characters of held-out text per prompt at most",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("eagle_path", "weights/eagle_smollm2.safetensors", "EAGLE head weights",
                    flag_values=FLAGS)
flags.DEFINE_integer("draft_vocab_size", 0, "the head drafts over this many of the most frequent "
                     "target ids (SpeculativeConfig's draft_vocab_size); 0: all",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("out", "results/eagle_agreement.jsonl", "JSONL output", flag_values=FLAGS)
validate_output_flag(FLAGS, "out")
define_resume_flag(FLAGS)


def agreement(target, head, prompt: list[int], answer: list[int], vocab_ids=None
              ) -> tuple[int, int, int, int]:
    """(answer hits, answer positions, all hits, all positions): the head's argmax draft (over
    `vocab_ids` only when given) against the target's argmax, teacher-forced over prompt +
    answer. Answer positions are those whose drafted token is an answer token after the first
    (the first follows the prompt's last position, which the target computes itself)."""
    import jax.numpy as jnp
    import numpy as np

    from experiments.training import generated_mask
    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata
    from infer.spec.eagle_head import eagle_forward, eagle_logits

    c = target.config
    tokens = jnp.asarray([list(prompt) + list(answer)])
    n = tokens.shape[1]
    cache = KVCache.create(c.num_layers, 1, n, c.num_kv_heads, c.head_dim)
    logits, hidden, _ = target(tokens, cache, AttentionMetadata.for_prefill(jnp.asarray([n]), n),
                               feature_layers=head.feature_layers)
    predicted, _, _, _ = eagle_forward(head, target, hidden, tokens, jnp.asarray([n]))
    # Row t reads (h_t, x_{t+1}) and drafts x_{t+2}; the target's choice there is argmax at t+1.
    draft_logits = np.asarray(eagle_logits(target, predicted))[0]
    if vocab_ids is None:
        drafted = draft_logits.argmax(-1)
    else:
        drafted = vocab_ids[draft_logits[:, vocab_ids].argmax(-1)]
    wanted = np.asarray(jnp.argmax(logits, -1))[0, 1:]
    hit = drafted == wanted
    # Drafted tokens the target generated, answer[0] excepted: as if the prompt ran one further.
    # The last row drafts x_n, past the answer: an engine that stops there never drafts it.
    in_answer = np.asarray(generated_mask(jnp.asarray([len(prompt) + 1]), n - 1, 2))[0] > 0
    in_answer[-1] = False
    return int(hit[in_answer].sum()), int(in_answer.sum()), int(hit.sum()), n - 1


def run(*, kinds: list[str], num_prompts: int, max_tokens: int, snippet_chars: int,
        eagle_path: str, out: str, resume: bool = False, draft_vocab_size: int = 0
        ) -> list[dict]:
    """One row per prompt kind, each appended to `out` as it is measured (with `resume`, kinds
    already there are not measured again); the table from the file."""
    import functools

    from experiments.common import ResultLog, markdown_table
    from experiments.speculation import check_prompt_count
    from experiments.workloads import build_prompts
    from infer.engine.device_steps import DeviceSteps
    from infer.engine.simple_loop import generate
    from infer.io.loader import load
    from infer.spec.config import DRAFT_VOCAB_PATH
    from infer.spec.eagle_head import load_eagle
    from infer.spec.draft_vocab import load_draft_vocab

    # Before the model loads: a kind past the held-out text failed after the kinds before it.
    for kind in kinds:
        check_prompt_count(kind, num_prompts, snippet_chars, "num_prompts")
    log = ResultLog(out, resume=resume)

    @functools.cache
    def models():
        config, target, tokenizer = load("smollm2-135m", "float32")
        ids = None
        if draft_vocab_size:
            ids = load_draft_vocab(DRAFT_VOCAB_PATH, draft_vocab_size,
                                   config.vocab_size)
        return target, load_eagle(config, eagle_path), tokenizer, DeviceSteps(target), ids

    def measure(kind: str) -> dict:
        target, head, tokenizer, plain, ids = models()
        totals = [0, 0, 0, 0]
        for prompt in build_prompts(tokenizer, kind, num_prompts, snippet_chars):
            answer, _ = generate(plain, prompt, max_tokens)
            totals = [a + b for a, b in zip(totals, agreement(target, head, prompt, answer, ids))]
        return {"answer_top1": totals[0] / totals[1], "answer_positions": totals[1],
                "all_top1": totals[2] / totals[3], "all_positions": totals[3]}

    for kind in kinds:
        log.measure({"experiment": "eagle_agreement", "kind": kind, "eagle_path": eagle_path,
                     "num_prompts": num_prompts, "max_tokens": max_tokens,
                     "snippet_chars": snippet_chars,
                     **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {})},
                    lambda kind=kind: measure(kind))
    rows = log.rows()
    print(markdown_table(rows, [("eagle_path", "head"), ("draft_vocab_size", "draft vocab"),
                                ("kind", "prompts"), ("answer_top1", "top-1 on answers"),
                                ("answer_positions", "answer positions"),
                                ("all_top1", "top-1, all positions")]))
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
