"""Which speculative method the engine runs, and the proposer it builds for it."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from infer.model.binding import binding, committed_device, on_device
from infer.model.llama import Llama, tile_weights
from infer.sampling_params import is_real
from infer.spec.draft_model import load_draft, self_draft
from infer.spec.eagle_head import load_eagle
from infer.spec.draft_vocab import load_draft_vocab
from infer.spec.model_proposers import DraftModelProposer, EagleProposer
from infer.spec.ngram import NgramProposer
from infer.spec.proposer import Proposer
from infer.spec.suffix import SuffixProposer, check_suffix_params
from infer.spec.tree_draft import TreeShape

if TYPE_CHECKING:
    from infer.engine.runner import RunnerConfig


# The repository's weights/ folder, where the trainers write the drafters.
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "weights")
# The shipped ranking of SmolLM2's ids by how often its own generations use them
# (experiments.draft_vocab).
DRAFT_VOCAB_PATH = os.path.join(WEIGHTS_DIR, "draft_vocab_smollm2.npy")

SPECULATIVE_METHODS = ("ngram", "draft", "self_draft", "eagle", "suffix")
# The methods whose drafts score the vocabulary through an LM head: only they can reduce it
# (draft_vocab_size), and only their drafts come with probabilities to stop on
# (draft_confidence).
DRAFT_VOCAB_METHODS = ("draft", "self_draft", "eagle")

@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={"method": "eagle", "num_tokens": 4})`.

    Methods: `ngram` (prompt lookup over the request's own tokens), `draft` (a small Llama
    distilled from the target, `experiments.train_draft`), `self_draft` (the target's first
    `self_draft_layers` layers with its norm and head, untrained), `eagle` (an EAGLE head over
    the target's features, `experiments.train_eagle`; an EAGLE-3 head's file names the
    target layers it fuses, which the target's steps then return), `suffix` (suffix decoding: suffix tries
    over the request's tokens and the outputs of recently finished requests, `infer.spec.suffix`,
    whose docstring gives the `suffix_*` defaults' reasons)."""

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    draft_path: str = os.path.join(WEIGHTS_DIR, "draft_smollm2.safetensors")
    eagle_path: str = os.path.join(WEIGHTS_DIR, "eagle_smollm2.safetensors")
    self_draft_layers: int = 4
    suffix_max_match: int = 16
    suffix_spec_factor: float = 2.0
    suffix_min_prob: float = 0.5
    suffix_corpus_tokens: int = 16384  # finished requests' tokens kept; 0: no corpus
    suffix_corpus_prompts: bool = False  # their prompts too, not only outputs
    # FR-Spec: model drafts score only the `draft_vocab_size` most frequent target ids of the
    # ranking at `draft_vocab_path` (experiments.draft_vocab); None scores all of them.
    draft_vocab_size: int | None = None
    draft_vocab_path: str = DRAFT_VOCAB_PATH
    # A confidence stop (EAGLE-2's estimate of a path's acceptance): a model draft's chain ends
    # before the first draft whose running product of top probabilities (each draft's, known
    # before it is drawn: `model_proposers._draw_draft`) falls below this; a
    # row with no draft left takes a plain step, and when every row has stopped the chain's
    # remaining draft steps do not run. None: every row drafts its limit.
    draft_confidence: float | None = None
    # EAGLE-2 tree speculation (method "eagle" only): "BxD", the full tree of `branches` children
    # per node and `depth` levels, or "BxD/N" (or "BxDwW/N"), the dynamic tree of N candidates
    # chosen by the head's confidence (`infer.spec.tree_draft.TreeShape`), verified with a tree mask in
    # place of num_tokens' chain. With draft_confidence, a row verifies its candidates only up to
    # the last whose path the head gives at least that probability (none: a plain step).
    tree: str | None = None

    @property
    def tree_shape(self) -> TreeShape | None:
        return None if self.tree is None else TreeShape.parse(self.tree)

    @property
    def reserved_slots(self) -> int:
        """Cache slots past a row's last token that one speculative step may write."""
        shape = self.tree_shape
        return self.num_tokens if shape is None else shape.reserved_slots

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: "
                             f"{SPECULATIVE_METHODS}")
        # An int first: 2.5 or True passed the range check and failed later in the suffix
        # check, whose message named suffix_max_draft whatever the method.
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) \
                or not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens must be an int in [1, 16], got {self.num_tokens!r}")
        if self.tree is not None:
            if self.method != "eagle":
                raise ValueError(f"tree speculation drafts with an EAGLE head: method must be "
                                 f"'eagle', got {self.method!r}")
            if not isinstance(self.tree, str):
                raise ValueError(f"tree is a shape string such as '2x3' or '3x4/15', got "
                                 f"{self.tree!r}")
            shape = TreeShape.parse(self.tree)  # raises on a bad shape
            if self.draft_vocab_size is not None and self.draft_vocab_size < shape.branches:
                raise ValueError(f"a draft vocabulary of {self.draft_vocab_size!r} ids cannot "
                                 f"give tree {self.tree!r} its {shape.branches} children per "
                                 f"node")
        if self.method == "ngram":
            for name in ("ngram_min", "ngram_max"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{name} must be an int, got {value!r}")
            if not 1 <= self.ngram_min <= self.ngram_max:
                raise ValueError(f"n-gram lengths need 1 <= ngram_min <= ngram_max, got "
                                 f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")
        check_suffix_params(self.suffix_max_match, self.suffix_spec_factor, self.suffix_min_prob,
                            self.num_tokens, self.suffix_corpus_tokens)
        path = {"draft": self.draft_path, "eagle": self.eagle_path}.get(self.method)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"speculative method {self.method!r} needs its weights at "
                                    f"{path!r}; train them with experiments.train_"
                                    f"{self.method} or pass {self.method}_path")
        if self.draft_confidence is not None:
            if self.method not in DRAFT_VOCAB_METHODS:
                raise ValueError(f"draft_confidence applies to the methods whose drafts come "
                                 f"with probabilities {DRAFT_VOCAB_METHODS}; {self.method!r} "
                                 f"has none")
            if not is_real(self.draft_confidence) or not 0 < self.draft_confidence <= 1:
                raise ValueError(f"draft_confidence must be a number in (0, 1] (None: no "
                                 f"stop), got {self.draft_confidence!r}")
        if self.draft_vocab_size is not None:
            if self.method not in DRAFT_VOCAB_METHODS:
                raise ValueError(f"draft_vocab_size applies to the methods that score a "
                                 f"vocabulary {DRAFT_VOCAB_METHODS}; {self.method!r} has none "
                                 f"to reduce")
            if isinstance(self.draft_vocab_size, bool) \
                    or not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1:
                raise ValueError(f"draft_vocab_size must be a positive int (None: the whole "
                                 f"vocabulary), got {self.draft_vocab_size!r}")
            if not os.path.isfile(self.draft_vocab_path):
                raise FileNotFoundError(f"draft_vocab_size needs a token ranking at "
                                        f"{self.draft_vocab_path!r}; write it with "
                                        f"experiments.draft_vocab or pass draft_vocab_path")

def make_proposer(config: SpeculativeConfig, model: Llama, runner_config: "RunnerConfig"
                  ) -> Proposer:
    # Its bound is the target's vocabulary, known only here.
    ids = (None if config.draft_vocab_size is None else
           load_draft_vocab(config.draft_vocab_path, config.draft_vocab_size,
                            model.config.vocab_size))
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_max_match, config.suffix_spec_factor,
                              config.suffix_min_prob, config.num_tokens,
                              config.suffix_corpus_tokens, config.suffix_corpus_prompts)
    # A target put on a device explicitly has its proposer's weights put there too: the
    # proposer's programs run where their inputs (the target's features and tokens) are.
    device = committed_device(binding(model).params)
    beside = (lambda module: module) if device is None else (
        lambda module: on_device(module, device))
    if config.method == "draft":
        # Speculation runs on one device: the draft's projections as the target's are.
        return DraftModelProposer(beside(tile_weights(load_draft(model, config.draft_path))),
                                  runner_config, ids,
                                  config.draft_confidence)
    if config.method == "self_draft":
        return DraftModelProposer(self_draft(model, config.self_draft_layers), runner_config,
                                  ids, config.draft_confidence)
    if config.method == "eagle":
        return EagleProposer(beside(load_eagle(model.config, config.eagle_path)), model,
                             runner_config, ids, config.draft_confidence)
    raise ValueError(f"no proposer for {config.method!r}")
