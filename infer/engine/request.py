"""One request's host-side state: prompt, sampling parameters, output so far, stop conditions,
timestamps. Plain Python, shared by the simple loop and the serving engine."""

from __future__ import annotations

import bisect
import dataclasses
import enum
import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Sequence

from infer.io.tokenizer import IncrementalDetokenizer, Tokenizer
from infer.sampling_params import SamplingParams, is_integer

if TYPE_CHECKING:
    from infer.structured import TokenConstraint


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


class RequestIds:
    """Numbered request ids "0", "1", ... for requests made without one. A caller may choose
    ids like "3" itself, so a number still held (`taken`: queued, running or a kept finished
    output) is skipped: a clash would fail a later add, or replace the output kept under it."""

    def __init__(self) -> None:
        self.next_number = 0

    def fresh(self, taken: Callable[[str], bool]) -> str:
        while taken(str(self.next_number)):
            self.next_number += 1
        self.next_number += 1
        return str(self.next_number - 1)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request must fit. None: not checked at this level (the scheduler knows the
    context and the page pool, not the vocabulary)."""

    vocab_size: int | None = None
    max_model_len: int | None = None
    pool_tokens: int | None = None  # token slots of the whole page pool

    def implies(self, other: RequestLimits) -> bool:
        """Whether a request that passed `validate_request` with these limits passes it with
        `other`'s: every limit `other` sets is set here, no looser."""
        return all(theirs is None or (mine is not None and mine <= theirs)
                   for mine, theirs in ((self.vocab_size, other.vocab_size),
                                        (self.max_model_len, other.max_model_len),
                                        (self.pool_tokens, other.pool_tokens)))


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams,
                     limits: RequestLimits) -> list[int]:
    """The one check of a request, used by the engine (for the LLM too), the scheduler (for a
    request not checked yet against its limits: `Request.validated`) and the simple loop.
    Raises ValueError naming the problem; returns the prompt's ids as Python ints."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_token_ids, (str, bytes)):
        raise ValueError("prompt_token_ids must be a sequence of ints, got a string")
    try:
        tokens = iter(prompt_token_ids)
    except TypeError:  # one id where a prompt's list was meant, or None
        raise ValueError(f"prompt_token_ids must be a sequence of ints, got "
                         f"{prompt_token_ids!r}") from None
    ids = []
    for t in tokens:
        if not is_integer(t):
            raise ValueError(f"prompt token ids must be ints, got {t!r}")
        ids.append(int(t))
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    if limits.vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {limits.vocab_size}): "
                             f"{bad[:5]}")
    need = len(ids) + params.max_tokens
    if limits.max_model_len is not None and need > limits.max_model_len:
        raise ValueError(f"{len(ids)} prompt tokens + max_tokens={params.max_tokens} exceed "
                         f"max_model_len={limits.max_model_len} ({need} positions)")
    # KV is written for every position but the last: the last token is never fed back.
    slots = need - 1
    if limits.pool_tokens is not None and slots > limits.pool_tokens:
        raise ValueError(f"{len(ids)} prompt tokens + max_tokens={params.max_tokens} need "
                         f"{slots} KV slots, more than the whole page pool holds "
                         f"({limits.pool_tokens})")
    return ids


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One output token under the model's raw distribution (before temperature, truncation and
    any structured-output mask): its logprob, its rank (1 = the most likely), and the
    `SamplingParams.logprobs` most likely tokens as (id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def waited_gaps(gaps: Sequence[float]) -> tuple[float, ...]:
    """Inter-token gaps as vLLM counts them (its ITL histogram, its benchmark's chunks): one
    per step that brought tokens. A step that emits several (speculative decoding) gives them
    one time; their zero gaps were waited by no one."""
    return tuple(g for g in gaps if g > 0)


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

    @property
    def step_gaps(self) -> tuple[float, ...]:
        """`itl_s` as vLLM counts inter-token latencies (`waited_gaps`)."""
        return waited_gaps(self.itl_s)

    @classmethod
    def from_token_times(cls, arrival_s: float, token_times: Sequence[float],
                         num_prompt_tokens: int, finished: bool = True,
                         num_cached_tokens: int = 0, num_preemptions: int = 0,
                         gaps: Sequence[float] | None = None) -> "RequestMetrics":
        """The latencies of a request that arrived at `arrival_s` and got a token at each of
        `token_times` (the engine's requests and the peers' streams alike); e2e once finished.
        `gaps`: the differences of consecutive token times, where the caller keeps them as
        tokens come (the engine asks for every running request's metrics at every step, and
        recomputing them made that O(tokens) per request per step)."""
        times = token_times
        if gaps is None:
            gaps = [b - a for a, b in zip(times, times[1:])]
        elif len(gaps) != max(len(times) - 1, 0):
            raise ValueError(f"{len(gaps)} gaps between {len(times)} token times")
        itl = tuple(gaps)
        return cls(arrival_s=arrival_s, ttft_s=times[0] - arrival_s if times else None,
                   tpot_s=math.fsum(itl) / len(itl) if itl else None,
                   e2e_s=times[-1] - arrival_s if times and finished else None, itl_s=itl,
                   num_prompt_tokens=num_prompt_tokens, num_output_tokens=len(times),
                   num_cached_tokens=num_cached_tokens, num_preemptions=num_preemptions)


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
    seed: int | None = None  # the seed it drew with: a fresh one when none was asked for
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when asked for
    # What stopped it (vLLM's stop_reason): the stop string matched, or the stop token id;
    # None for EOS, a finished constraint, max_tokens or an abort. A stop string that cuts the
    # text at the token that also ends it otherwise is the reason: it is where the text ends.
    stop_reason: str | int | None = None


class Request:
    """Appending tokens checks the stop conditions: EOS (unless ignore_eos), stop token ids
    (the text leaves out the stop token's), stop strings (the text is cut before the stop
    string) and max_tokens; with include_stop_str_in_output, the stop token's text or the stop
    string stays in the text.

    Until it finishes, a request's visible text holds back any tail that could still grow into
    a stop string, so streamed text never shows part of one.

    `validated`: the limits `validate_request` already passed it with (None: not checked), so
    that a request is checked once on its way in. `constraint`: the matcher of its
    `params.structured` (`infer.structured`), which follows every token appended; the request
    stops when the constraint is complete."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, eos_ids: tuple[int, ...] = (),
                 prompt: str | None = None, arrival_s: float | None = None,
                 validated: RequestLimits | None = None,
                 constraint: TokenConstraint | None = None) -> None:
        if (constraint is None) != (params.structured is None):
            raise ValueError("a request has a constraint exactly when its params ask for "
                             "structured output (Engine.make_request compiles it)")
        if params.stop and tokenizer is None:
            # Without text, a stop string could never match: the request would run to
            # max_tokens as if none were asked for.
            raise ValueError("stop strings need a tokenizer; without one, use stop_token_ids")
        self.constraint = constraint
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.request_id = request_id
        self.validated = validated
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # see RequestOutput.stop_reason
        self.arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self.token_times: list[float] = []
        self._token_gaps: list[float] = []  # token_times' differences, for metrics()
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._tokenizer = tokenizer
        # Text as tokens come, where someone reads it before the end: a streamed output, or
        # stop strings to find. A final-only request decodes its tokens once, when asked.
        incremental = tokenizer is not None and (params.streams or bool(params.stop))
        self._detok = (IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
                       if incremental else None)
        self._text = ""
        self._text_tokens = 0  # output tokens _text holds, where decoded when asked
        self._silent_last = False  # the last token is a stop token whose text is left out
        # The stop strings sorted, so that whether a tail of the text begins one is a binary
        # search, not a pass over all of them at every length (100k stop strings held the
        # engine thread for a second a step, every other request waiting).
        self._sorted_stops = tuple(sorted(set(params.stop or ())))
        self._longest_stop = max(map(len, self._sorted_stops), default=0)

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
        return self._visible_text()

    def append(self, token: int, now: float | None = None,
               logprob: TokenLogprob | None = None) -> bool:
        """Records one generated token (with its logprob when the request asked for them);
        returns True when the request is finished."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished ({self.finish_reason})")
        if self.logprobs is not None and (logprob is None or logprob.token_id != int(token)):
            raise RuntimeError(f"request {self.request_id} asked for logprobs, but the step "
                               f"that emitted token {token} brought {logprob}")
        if self.constraint is not None and not self.constraint.consume(token):
            # The grammar refused a token its own mask allowed (`TokenConstraint.consume`):
            # this request ends without it, aborted; the others in the batch go on.
            logging.getLogger("infer").error(
                "request %s: structured output refused token %d (%s); aborting the request",
                self.request_id, int(token), self.constraint.error)
            self.finish_reason = FinishReason.ABORT
            self._extend_text(final=True)
            return True
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        self.output_ids.append(int(token))
        now = time.perf_counter() if now is None else now
        if self.token_times:
            self._token_gaps.append(now - self.token_times[-1])
        self.token_times.append(now)
        stop_token = int(token) in self._stop_ids
        ending = (stop_token or (self.constraint is not None and self.constraint.done)
                  or len(self.output_ids) >= self.params.max_tokens)
        # As vLLM: the text of a stop token (EOS, a stop token id) is left out of the text.
        self._silent_last = stop_token and not self.params.include_stop_str_in_output
        cut = self._extend_text(final=ending)
        if cut is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, cut
        elif stop_token or (self.constraint is not None and self.constraint.done):
            self.finish_reason = FinishReason.STOP
            if int(token) in self.params.stop_token_ids:
                self.stop_reason = int(token)
        elif ending:
            self.finish_reason = FinishReason.LENGTH
        return self.finished

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = FinishReason.ABORT
            self._extend_text(final=True)

    def _extend_text(self, final: bool) -> str | None:
        """Adds the latest token's text and cuts the text at a stop string it completes
        (returned then), whatever else ends the request at that token: the text never holds
        what the stop string alone would have cut, nor, when `_silent_last`, the stop token's
        text. `final`: the request ends here, so what the detokenizer held back (a character
        the last tokens leave incomplete) is added too: uncut, the text is then all the
        tokens' (decode(output_ids), less a silent last one)."""
        if self._detok is None:
            return None  # no stop strings (they make a detokenizer): decoded when asked
        searched = len(self._text)
        # The stop token's text is searched too, for a stop string that starts before it:
        # kept, its start would show the part of the stop string the stop token completes.
        # It is decoded with the text held back before it (peeked before the step below
        # emits that text alone), as the stop token may complete a character the text
        # without it leaves incomplete, and a stop string ends in that character.
        with_stop = (self._text + self._detok.peek(self.output_ids)
                     if self._silent_last and self.params.stop else None)
        ids = self.output_ids[:-1] if self._silent_last else self.output_ids
        self._text += self._detok.step(ids, final=final)
        if not self.params.stop:
            return None
        if (cut := self._cut_at_stop_string(searched)) is not None or with_stop is None:
            return cut
        # Up to the character the stop token completes, the two texts are the same.
        kept = len(self._text)
        at, cut = self._find_stop_string(with_stop, searched)
        self._text = self._text[:min(at, kept)]
        return cut if at < kept else None

    def _find_stop_string(self, text: str, searched: int) -> tuple[int, str | None]:
        """Where the first stop string starts in `text` (the text, or the text with a silent
        stop token's) and which it is (of those found at one place, the longest), or
        (len(text), None); `searched`: text length already known to hold none, so only what
        could end in the new characters is searched again."""
        start = max(0, searched - self._longest_stop + 1)
        hits = [(i, -len(s), s) for s in self.params.stop
                if (i := text.find(s, start)) >= 0]
        if not hits:
            return len(text), None
        at, _, stop = min(hits)
        return at, stop

    def _cut_at_stop_string(self, searched: int) -> str | None:
        """Cuts the text at the first stop string and returns it (None: none found): before
        it, or after it with include_stop_str_in_output. `searched`: as `_find_stop_string`."""
        at, stop = self._find_stop_string(self._text, searched)
        if stop is not None:
            self._text = self._text[:at + (len(stop) if self.params.include_stop_str_in_output
                                           else 0)]
        return stop

    def _decoded(self) -> str:
        """The text of the output so far."""
        if self._detok is None and self._tokenizer is not None:
            n = len(self.output_ids) - int(self._silent_last)
            if self._text_tokens != n:
                self._text = self._tokenizer.decode(self.output_ids[:n], skip_special_tokens=True)
                self._text_tokens = n
            if not self.finished:
                # The last tokens may end inside a character, which decodes to U+FFFD (one, or
                # one per byte token with byte fallback) until a later token completes it: held
                # back, as the incremental detokenizer holds it, so that the text so far leads
                # to the final one.
                return self._text.rstrip("\ufffd")
        return self._text

    def _visible_text(self) -> str:
        """The text without its longest tail that is a proper prefix of a stop string."""
        text = self._decoded()
        if self.finished or not self.params.stop or self.params.include_stop_str_in_output:
            return text  # a stop string that stays in the text needs no part held back
        stops = self._sorted_stops
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            # The stop strings that begin with `tail` sort together, first among those >= it.
            i = bisect.bisect_left(stops, tail)
            if i < len(stops) and stops[i].startswith(tail):
                return text[:-n]
        return text

    def gaps_since(self, num_tokens: int) -> tuple[float, ...]:
        """The waited gaps (`waited_gaps`) ending at output tokens past the first
        `num_tokens`: what a step that brought those tokens adds to the ITL histogram."""
        return waited_gaps(self._token_gaps[max(num_tokens - 1, 0):])

    def metrics(self) -> RequestMetrics:
        return RequestMetrics.from_token_times(
            self.arrival_s, self.token_times, len(self.prompt_token_ids), self.finished,
            num_cached_tokens=self.num_cached_tokens, num_preemptions=self.num_preemptions,
            gaps=self._token_gaps)

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids),
                             text=self._visible_text(), token_ids=list(self.output_ids),
                             finished=self.finished, finish_reason=self.finish_reason,
                             metrics=self.metrics(), seed=self.params.seed,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             stop_reason=self.stop_reason)
