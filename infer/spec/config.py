"""Which speculative method the engine runs, and the proposer it builds for it."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from infer.model.llama import Llama
from infer.spec.draft_model import load_draft, self_draft
from infer.spec.eagle_head import load_eagle
from infer.spec.model_proposers import DraftModelProposer, EagleProposer
from infer.spec.ngram import NgramProposer
from infer.spec.proposer import Proposer

if TYPE_CHECKING:
    from infer.engine.runner import RunnerConfig


# The repository's weights/ folder, where the trainers write the drafters.
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "weights")

SPECULATIVE_METHODS = ("ngram", "draft", "self_draft", "eagle")

@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={"method": "eagle", "num_tokens": 4})`.

    Methods: `ngram` (prompt lookup over the request's own tokens), `draft` (a small Llama
    distilled from the target, `experiments.train_draft`), `self_draft` (the target's first
    `self_draft_layers` layers with its norm and head, untrained), `eagle` (an EAGLE head over
    the target's features, `experiments.train_eagle`)."""

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    draft_path: str = os.path.join(WEIGHTS_DIR, "draft_smollm2.safetensors")
    eagle_path: str = os.path.join(WEIGHTS_DIR, "eagle_smollm2.safetensors")
    self_draft_layers: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: "
                             f"{SPECULATIVE_METHODS}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens must be in [1, 16], got {self.num_tokens}")
        path = {"draft": self.draft_path, "eagle": self.eagle_path}.get(self.method)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"speculative method {self.method!r} needs its weights at "
                                    f"{path!r}; train them with experiments.train_"
                                    f"{self.method} or pass {self.method}_path")

def make_proposer(config: SpeculativeConfig, model: Llama, runner_config: "RunnerConfig"
                  ) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if config.method == "draft":
        return DraftModelProposer(load_draft(model, config.draft_path), runner_config)
    if config.method == "self_draft":
        return DraftModelProposer(self_draft(model, config.self_draft_layers), runner_config)
    if config.method == "eagle":
        return EagleProposer(load_eagle(model.config, config.eagle_path), model, runner_config)
    raise ValueError(f"no proposer for {config.method!r}")
