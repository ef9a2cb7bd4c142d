"""The drafters' data, training and speculation experiments refuse bad flags before any work:
at parse time (absl bounds, list and output validators), or at the top of `run` for what
involves several flags, input files or the model (before it loads)."""

from __future__ import annotations

import pytest

from experiments import (draft_vocab, eagle_agreement, spec_data, speculation, train_draft,
                         train_eagle, training)
from experiments.common import flag_kwargs
from tests.experiments.flags_util import parses, refusal

MODULES = [spec_data, train_eagle, train_draft, draft_vocab, eagle_agreement, speculation]


@pytest.fixture
def a_file(tmp_path) -> str:
    """An existing file: an output path below it cannot be written."""
    path = tmp_path / "a_file"
    path.write_text("")
    return str(path)


def run_args(module, **overrides):
    """`module.run`'s keyword arguments from its flags' defaults, `overrides` in their place."""
    try:
        module.FLAGS(["experiment"])
        kwargs = flag_kwargs(module.run, module.FLAGS)
    finally:
        module.FLAGS.unparse_flags()
    return {**kwargs, **overrides}


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_defaults_parse(module) -> None:
    parses(module.FLAGS)


# (module, argv, the flag the refusal names); "{file}" stands for an existing file.
REFUSED = [
    # spec_data: np.savez would write x_noext.npz, the summary read x_noext; a batch of 0
    # divided by zero after the generation; a path below a file failed after it.
    (spec_data, "--out={file}_noext", "--out"),
    (spec_data, "--out={file}/x.npz", "--out"),
    (spec_data, "--batch_size=0", "--batch_size"),
    (spec_data, "--gen_batch_size=0", "--gen_batch_size"),
    (spec_data, "--num_sequences=0", "--num_sequences"),
    (spec_data, "--new_tokens=0", "--new_tokens"),
    (spec_data, "--chat_fraction=1.5", "--chat_fraction"),
    (spec_data, "--feature_layers=-1", "--feature_layers"),
    (spec_data, "--feature_layers=a", "--feature_layers"),
    # train_eagle: the whole training ran before the weights' path failed.
    (train_eagle, "--weights={file}/x.safetensors", "--weights"),
    (train_eagle, "--out={file}/x.jsonl", "--out"),
    (train_eagle, "--batch_size=0", "--batch_size"),
    (train_eagle, "--epochs=-1", "--epochs"),
    (train_eagle, "--ttt_steps=0", "--ttt_steps"),
    (train_eagle, "--warmup=1.5", "--warmup"),
    (train_eagle, "--max_sequences=-1", "--max_sequences"),
    (train_eagle, "--draft_vocab_size=-1", "--draft_vocab_size"),
    (train_eagle, "--feature_layers=x", "--feature_layers"),
    # train_draft: 0 epochs saved the untrained draft over the tracked weights.
    (train_draft, "--epochs=0", "--epochs"),
    (train_draft, "--batch_size=0", "--batch_size"),
    (train_draft, "--num_layers=0", "--num_layers"),
    (train_draft, "--self_draft_layers=2,0", "--self_draft_layers"),
    (train_draft, "--weights={file}/x.safetensors", "--weights"),
    (train_draft, "--out={file}/x.jsonl", "--out"),
    # draft_vocab: 0 sequences ranked the ids by no tokens over the tracked ranking (a NaN row);
    # np.save would add .npy to an --out without it.
    (draft_vocab, "--num_sequences=0", "--num_sequences"),
    (draft_vocab, "--num_sequences=1", "--num_sequences"),
    (draft_vocab, "--eval_prompts=-1", "--eval_prompts"),
    (draft_vocab, "--batch_size=0", "--batch_size"),
    (draft_vocab, "--sizes=0", "--sizes"),
    (draft_vocab, "--out={file}_ranking", "--out"),
    (draft_vocab, "--results={file}/x.jsonl", "--results"),
    # eagle_agreement: one answer token leaves no position to score (a division by zero).
    (eagle_agreement, "--max_tokens=1", "--max_tokens"),
    (eagle_agreement, "--num_prompts=0", "--num_prompts"),
    (eagle_agreement, "--kinds=", "--kinds"),
    (eagle_agreement, "--kinds=chatt", "--kinds"),
    (eagle_agreement, "--out={file}/x.jsonl", "--out"),
    # speculation: bad points failed after the baselines were measured, or ran nothing.
    (speculation, "--ks=0", "--ks"),
    (speculation, "--ks=2,17", "--ks"),
    (speculation, "--methods=ngrm", "--methods"),
    (speculation, "--parts=engnie", "--parts"),
    (speculation, "--parts=", "--parts"),
    (speculation, "--temperatures=-0.5", "--temperatures"),
    (speculation, "--temperatures=0,nan", "--temperatures"),  # NaN passes every bound
    (speculation, "--batch_sizes=0", "--batch_sizes"),
    (speculation, "--engine_trees=2x", "--engine_trees"),
    (speculation, "--dynamic_trees=0x3/4", "--dynamic_trees"),
    (speculation, "--num_prompts=0", "--num_prompts"),
    (speculation, "--max_tokens=1", "--max_tokens"),
    (speculation, "--tree_depth=0", "--tree_depth"),
    (speculation, "--tree_prompts=0", "--tree_prompts"),
    (speculation, "--draft_confidence=1.5", "--draft_confidence"),
    (speculation, "--out={file}/x.jsonl", "--out"),
]


@pytest.mark.parametrize("module, arg, flag", REFUSED,
                         ids=[f"{m.__name__.split('.')[-1]}:{a}" for m, a, _ in REFUSED])
def test_bad_flags_are_refused_at_parse_time(module, arg: str, flag: str, a_file: str) -> None:
    assert flag in refusal(module.FLAGS, arg.format(file=a_file))


def test_speculation_methods_are_the_engines() -> None:
    from infer.spec.config import SPECULATIVE_METHODS

    assert speculation.METHODS == list(SPECULATIVE_METHODS)


def test_valid_lists_parse() -> None:
    parses(speculation.FLAGS, "--ks=1,16", "--engine_trees=2x3,3x4/15", "--dynamic_trees=3x4w2/10",
           "--parts=tree", "--methods=eagle")
    parses(train_draft.FLAGS, "--self_draft_layers=")
    parses(draft_vocab.FLAGS, "--sizes=")  # the ranking without coverage columns
    parses(eagle_agreement.FLAGS, "--kinds=grounded,repetitive", "--max_tokens=2")


# -- run(): what involves several flags, an input file or the model, before the model loads --

def test_train_eagle_run_refuses_before_the_model_loads(tmp_path, a_file: str) -> None:
    data = tmp_path / "data.npz"
    data.write_text("")  # exists: the checks after --data's are reached
    with pytest.raises(ValueError, match="--epochs=0 trains nothing"):
        train_eagle.run(**run_args(train_eagle, epochs=0, init=""))
    with pytest.raises(ValueError, match="--data="):
        train_eagle.run(**run_args(train_eagle, data=str(tmp_path / "missing.npz")))
    with pytest.raises(ValueError, match="--init="):
        train_eagle.run(**run_args(train_eagle, data=str(data), init=str(tmp_path / "no")))
    with pytest.raises(ValueError, match="--feature_layers"):
        train_eagle.run(**run_args(train_eagle, data=str(data), feature_layers=[14, 1]))
    with pytest.raises(ValueError, match="--feature_layers"):
        train_eagle.run(**run_args(train_eagle, data=str(data), feature_layers=[1, 30]))
    # Two output paths: the message says which flag's cannot be written.
    with pytest.raises(ValueError, match="--weights: output path .* lies below"):
        train_eagle.run(**run_args(train_eagle, data=str(data), weights=f"{a_file}/x"))
    with pytest.raises(ValueError, match="--out: output path .* lies below"):
        train_eagle.run(**run_args(train_eagle, data=str(data), out=f"{a_file}/x.jsonl"))


def test_trainer_refuses_no_batch_before_the_data_loads(tmp_path) -> None:
    args = dict(data=str(tmp_path / "missing.npz"), max_sequences=0, lr=1e-3, warmup=0.0,
                weight_decay=0.0, clip=1.0, seed=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        training.Trainer(batch_size=0, epochs=1, **args)
    with pytest.raises(ValueError, match="epochs must be >= 0"):
        training.Trainer(batch_size=8, epochs=-1, **args)


def test_train_draft_run_checks_the_targets_layers_first() -> None:
    with pytest.raises(ValueError, match=r"--num_layers must be in \[1, 30\]"):
        train_draft.run(**run_args(train_draft, num_layers=99))
    with pytest.raises(ValueError, match="--self_draft_layers"):
        train_draft.run(**run_args(train_draft, self_draft_layers=[2, 31]))
    with pytest.raises(ValueError, match="--epochs must be >= 1"):
        train_draft.run(**run_args(train_draft, epochs=0))


def test_spec_data_refuses_taps_smollm2_lacks_before_generating(tmp_path) -> None:
    args = dict(num_sequences=2, prompt_len=8, new_tokens=2, temperature=0.7, seed=0)
    with pytest.raises(ValueError, match="--feature_layers"):
        spec_data.generate_training_data(out_path=str(tmp_path / "d.npz"),
                                         feature_layers=[14, 1], **args)
    with pytest.raises(ValueError, match=r"must end in \.npz"):
        spec_data.generate_training_data(out_path=str(tmp_path / "d"), **args)


def test_prompt_counts_past_the_held_out_text_are_refused_before_the_model(tmp_path) -> None:
    # 124 held-out paragraphs: chat prompts take the `count` after the first `count`.
    with pytest.raises(ValueError, match="--eval_prompts=63"):
        draft_vocab.run(**run_args(draft_vocab, eval_prompts=63))
    with pytest.raises(ValueError, match="--data="):
        draft_vocab.run(**run_args(draft_vocab, data=str(tmp_path / "missing.npz")))
    with pytest.raises(ValueError, match="--num_prompts=63"):
        eagle_agreement.run(**run_args(eagle_agreement, kinds=["grounded", "chat"],
                                       num_prompts=63, out=str(tmp_path / "a.jsonl")))
    assert not (tmp_path / "a.jsonl").exists()
    spec = run_args(speculation, out=str(tmp_path / "s.jsonl"))
    with pytest.raises(ValueError, match="--tree_prompts=63"):
        speculation.run(**{**spec, "parts": ["tree"], "tree_prompts": 63})
    with pytest.raises(ValueError, match="--num_prompts=125"):
        speculation.run(**{**spec, "parts": ["engine"], "methods": ["ngram"], "num_prompts": 125})
    with pytest.raises(ValueError, match="--batch_sizes=70"):
        speculation.run(**{**spec, "parts": ["engine"], "batch_sizes": [1, 70]})


def test_speculation_refuses_engine_trees_without_eagle(tmp_path) -> None:
    with pytest.raises(ValueError, match="--engine_trees=2x3 are method eagle's"):
        speculation.run(**run_args(speculation, methods=["ngram"], engine_trees=["2x3"],
                                   out=str(tmp_path / "s.jsonl")))


def test_prompt_counts_leave_out_a_method_that_will_be_skipped(monkeypatch, tmp_path) -> None:
    """A method without its weights is skipped with a line, so its prompt kind (chat, 60 at
    most) must not refuse a batch the others' kinds can fill (grounded: 124)."""
    import experiments.common

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(experiments.common, "one_engine", load)
    spec = run_args(speculation, out=str(tmp_path / "s.jsonl"), parts=["engine"],
                    methods=["ngram", "eagle"], batch_sizes=[1, 64])
    with pytest.raises(Loaded):
        speculation.run(**{**spec, "eagle_path": str(tmp_path / "no_head.safetensors")})
    with pytest.raises(ValueError, match="--batch_sizes=64"):
        speculation.run(**spec)  # the shipped head runs: its chat prompts must fit
