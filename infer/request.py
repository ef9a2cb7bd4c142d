"""One request's host-side state: prompt, sampling parameters, output so far, stop conditions,
timestamps. Plain Python, shared by the simple loop and the serving engine."""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from infer.sampling import SamplingParams
from infer.tokenizer import IncrementalDetokenizer, Tokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one request in seconds; inter-token latencies are the gaps between tokens
    as the host saw them."""

    arrival_s: float
    ttft_s: float | None  # arrival -> first output token
    tpot_s: float | None  # mean time per output token after the first
    e2e_s: float | None  # arrival -> finish
    itl_s: tuple[float, ...]  # inter-token latencies
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics


class Request:
    """Appending tokens checks the stop conditions: EOS (unless ignore_eos), stop token ids,
    stop strings (the text is cut before the stop string) and max_tokens."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, eos_ids: tuple[int, ...] = (),
                 prompt: str | None = None, arrival_s: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self.token_times: list[float] = []
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True) if tokenizer else None
        self._text = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_token_ids[-1]

    @property
    def text(self) -> str:
        return self._text

    def append(self, token: int, now: float | None = None) -> bool:
        """Records one generated token; returns True when the request is finished."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished ({self.finish_reason})")
        self.output_ids.append(int(token))
        self.token_times.append(time.perf_counter() if now is None else now)
        if self._detok is not None:
            self._text += self._detok.step(self.output_ids)
        if int(token) in self._stop_ids:
            self.finish_reason = FinishReason.STOP
        elif self.params.stop and self._cut_at_stop_string():
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finished and self._detok is not None and self.finish_reason != FinishReason.STOP:
            self._text += self._detok.step(self.output_ids, final=True)
        return self.finished

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = FinishReason.ABORT

    def _cut_at_stop_string(self) -> bool:
        hits = [i for i in (self._text.find(s) for s in self.params.stop or ()) if i >= 0]
        if not hits:
            return False
        self._text = self._text[:min(hits)]
        return True

    def metrics(self) -> RequestMetrics:
        times = self.token_times
        itl = tuple(float(b - a) for a, b in zip(times, times[1:]))
        return RequestMetrics(
            arrival_s=self.arrival_s,
            ttft_s=times[0] - self.arrival_s if times else None,
            tpot_s=float(np.mean(itl)) if itl else None,
            e2e_s=times[-1] - self.arrival_s if times and self.finished else None,
            itl_s=itl,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
        )

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids), text=self._text,
                             token_ids=list(self.output_ids), finished=self.finished,
                             finish_reason=self.finish_reason, metrics=self.metrics())
