"""Sampling parameters of one request, validated on the host. Plain Python: the scheduler, the
request and a server import them without loading JAX (`infer.sampling` turns them into the
device's per-row arrays)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import secrets

import numpy as np

OUTPUT_KINDS = ("cumulative", "final")


def is_integer(x: object) -> bool:
    """An int or numpy integer, but not a bool (True is an int in Python: max_tokens=True is a
    mistake, not 1 token)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))

def is_real(x: object) -> bool:
    """A real number (int, float, numpy float or integer, Fraction), but not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))

def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False

def _as_tuple(x: object, field: str) -> tuple:
    try:
        return tuple(x)
    except TypeError:
        raise ValueError(f"invalid SamplingParams: {field} must be a sequence, got {x!r}") from None

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one
# overflows float32 to inf, and the draw then picks the first of the infinite logits rather
# than the largest.
SAMPLING_EPS = 1e-5

# The most top logprobs a request may ask for per token (vLLM's --max-logprobs default): the
# compiled logprobs variant always computes this many, each row keeps its own k.
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output (vLLM's `structured_outputs`): exactly one of a JSON
    schema, any JSON object, a regular expression (the whole output matches it), a choice
    among strings, or a grammar (llguidance's Lark dialect, or GBNF). Compiled by
    `infer.structured`; a schema given as a dict is kept as its JSON text, so params hash."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.json, dict):
            # Key order kept: a schema's property order is the order the output follows.
            try:
                object.__setattr__(self, "json", json.dumps(self.json))
            except (TypeError, ValueError) as e:
                problems.append(f"json must be a JSON schema (a dict JSON can encode): {e}")
        if isinstance(self.choice, str):
            # A string is a sequence too: taken as one, "positive" would allow "p", "o", "s"...
            problems.append(f"choice must be a sequence of strings, got the string "
                            f"{self.choice!r} (one choice is [{self.choice!r}])")
        elif self.choice is not None:
            object.__setattr__(self, "choice", _as_tuple(self.choice, "choice"))
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if not isinstance(self.json_object, (bool, np.bool_)):
            problems.append(f"json_object must be a bool, got {self.json_object!r}")
        elif self.json_object:
            given.append("json_object")
        if len(given) != 1:
            problems.append(f"exactly one of json, json_object, regex, choice and grammar must "
                            f"be given, got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                problems.append(f"{name} must be a non-empty string, got {value!r}")
        if isinstance(self.choice, tuple) and not (self.choice and all(
                isinstance(c, str) and c for c in self.choice)):
            problems.append(f"choice must be non-empty strings, at least one, got {self.choice!r}")
        if problems:
            raise ValueError("invalid StructuredOutput: " + "; ".join(problems))
        object.__setattr__(self, "json_object", bool(self.json_object))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters. A temperature below SAMPLING_EPS (0 included) is
    greedy; top_k 0 (or -1, as vLLM takes it; stored as 0) and top_p 1 disable them, as does a
    top_k of the vocabulary's size or more.

    seed None (the default) means a fresh seed per request, as in vLLM: two unseeded requests
    draw independent noise. The engine fixes it when the request is created
    (`with_resolved_seed`) and reports it on the output; an explicit seed reproduces.
    Numeric fields take Python or numpy numbers (stored as Python int / float), never bools.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Keep the stop string that matched, or the text of the stop token (a stop token id or
    # end-of-sequence) that ended the request, in its text, as vLLM's field of this name; the
    # token itself is in token_ids either way.
    include_stop_str_in_output: bool = False
    # Report each output token's logprob (the model's raw distribution, before temperature and
    # top-k/top-p as vLLM's default; also before any structured-output mask, which vLLM V1
    # applies first) and this many top alternatives: 0 for the chosen token's alone, None for
    # none.
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    # What a step hands back for this request, as vLLM's RequestOutputKind: "cumulative", its
    # output so far at every step that gives it a token; "final", only its finished output
    # (LLM.generate's: nothing is built per token that no one reads, and without stop strings
    # the text is decoded once, at the end).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        problems = []
        if not (is_real(self.temperature) and _finite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if is_integer(self.top_k) and self.top_k == -1:
            # vLLM's older "all tokens" (long its default): params written for it mean
            # off, and one spelling of off keeps equal params equal.
            object.__setattr__(self, "top_k", 0)
        if not (is_integer(self.top_k) and self.top_k >= 0):
            problems.append(f"top_k must be an int >= 0, or -1 (0 and -1 disable it), got "
                            f"{self.top_k!r}")
        if not (is_integer(self.max_tokens) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**32)):
            problems.append(f"seed must be None (a fresh seed per request) or an int in "
                            f"[0, 2**32), got {self.seed!r}")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(is_integer(t) and t >= 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (self.logprobs is None or (is_integer(self.logprobs)
                                          and 0 <= self.logprobs <= MAX_LOGPROBS)):
            problems.append(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                            f"got {self.logprobs!r}")
        if not (self.structured is None or isinstance(self.structured, StructuredOutput)):
            problems.append(f"structured must be a StructuredOutput or None, got "
                            f"{self.structured!r}")
        if self.output_kind not in OUTPUT_KINDS:
            problems.append(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        # Plain Python values, so params hash, compare and serialize alike however they were
        # spelled (np.int64(5) == 5, but json.dumps rejects it).
        ints = ("top_k", "max_tokens") + tuple(
            name for name in ("seed", "logprobs") if getattr(self, name) is not None)
        for name in ints:
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        object.__setattr__(self, "include_stop_str_in_output",
                           bool(self.include_stop_str_in_output))

    @property
    def streams(self) -> bool:
        """Every step that gives it a token hands back its output (not only the last)."""
        return self.output_kind == "cumulative"

    @property
    def greedy(self) -> bool:
        """Picks the most likely token: the one rule, which the device arrays follow (a greedy
        row's temperature is 0 there)."""
        return self.temperature < SAMPLING_EPS

    @property
    def plain_steps_only(self) -> bool:
        """Its tokens come one at a time, as plain decoding samples them: a structured-output
        mask and logprobs hold for one position, so the engine drafts none for such a row
        (its batch-mates still speculate)."""
        return self.logprobs is not None or self.structured is not None

    def with_resolved_seed(self) -> "SamplingParams":
        """These params with a concrete seed: itself when seeded, else a copy with a fresh
        32-bit seed from the OS's entropy (not `random`, whose state a user may have seeded)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(32))
