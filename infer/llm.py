"""The user-facing entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from infer.loader import load
from infer.loop import decode_stream, validate_prompts
from infer.steps import Steps
from infer.request import Request, RequestOutput
from infer.sampling import SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str = "float32",
                 max_num_seqs: int = 32) -> None:
        self.config, self.model, self.tokenizer = load(model, dtype)
        self.steps = Steps(self.model)
        self.max_num_seqs = max_num_seqs
        self._next_id = 0

    def _requests(self, prompts: Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None,
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[Request]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts: list[str | None]
        if prompts is not None:
            for i, p in enumerate(prompts):
                if not isinstance(p, str) or not p:
                    raise ValueError(f"prompt {i} is empty or not a string: {p!r}")
            texts = list(prompts)
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            texts = [None] * len(prompt_token_ids)
            ids = [list(map(int, p)) for p in prompt_token_ids]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(ids)
        if len(sampling_params) != len(ids):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(ids)} prompts")
        requests = []
        for text, prompt_ids, params in zip(texts, ids, sampling_params):
            requests.append(Request(str(self._next_id), prompt_ids, params, self.tokenizer,
                                    self.tokenizer.eos_ids, prompt=text))
            self._next_id += 1
        return requests

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        requests = self._requests(prompts, prompt_token_ids, sampling_params)
        validate_prompts([r.prompt_token_ids for r in requests], self.config.vocab_size,
                         self.config.max_position_embeddings, [r.params.max_tokens for r in requests])
        for start in range(0, len(requests), self.max_num_seqs):
            self._run_batch(requests[start:start + self.max_num_seqs])
        return [r.output() for r in requests]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _run_batch(self, batch: list[Request]) -> None:
        steps = max(r.params.max_tokens for r in batch)
        stream = decode_stream(self.steps, [r.prompt_token_ids for r in batch],
                               [r.params for r in batch], steps)
        for tokens in stream:
            for request, token in zip(batch, np.asarray(tokens)):
                if not request.finished:
                    request.append(int(token))
            if all(r.finished for r in batch):
                stream.close()
                break
