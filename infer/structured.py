"""Structured output: a request's `StructuredOutput` compiled by llguidance into a matcher that
says, before each sampled token, which tokens keep the output inside the constraint's language.

The host side of constrained decoding, as vLLM's guidance backend does it: before every step
that samples for constrained requests the engine fills their rows of an int32 bitmask (bit t
of word t // 32: token t allowed) in one call (`fill_bitmask`), and feeds each request's
`TokenConstraint` the tokens it emits.
The device side is `infer.sampling`'s mask, which only programs given a bitmask contain.

llguidance is imported when the first constrained request arrives (the `structured` extra);
its tokenizer, built once per engine from the model's own `tokenizer.json`, takes about 0.3 s.
"""

from __future__ import annotations

import json
import os
import re
import re._constants as sre
import re._parser
import threading
import warnings
from typing import TYPE_CHECKING, Sequence

import numpy as np

from infer.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from infer.io.tokenizer import Tokenizer


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return -(-vocab_size // 32)


# JSON as json.dumps writes it, whitespace fixed (vLLM's --structured-outputs-config
# disable_any_whitespace): with llguidance's default, any run of whitespace between tokens, a
# model at temperature 1 (or a weak one) can emit blanks until max_tokens.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(spec: StructuredOutput) -> str:
    """The llguidance grammar of one constraint. A choice is a regex alternation of the escaped
    strings (vLLM's construction); any JSON object is the schema {"type": "object"}."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.json is not None:
        return matcher.grammar_from_json_schema(_object_schema(spec.json), defaults=JSON_FORMAT)
    if spec.json_object:
        return matcher.grammar_from_json_schema(json.dumps({"type": "object"}),
                                                defaults=JSON_FORMAT)
    if spec.regex is not None:
        # llguidance writes the regex into a Lark /.../ literal and drops a trailing lone
        # backslash there, where a regex engine refuses the incomplete escape: "ab" and one
        # backslash would constrain to "ab", a backslash alone to the empty string.
        if (len(spec.regex) - len(spec.regex.rstrip("\\"))) % 2:
            raise ValueError(f"regex {spec.regex!r} ends in an incomplete escape (a lone "
                             f"backslash); a literal backslash is written \\\\")
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    return llguidance.grammar_from("grammar", spec.grammar)


def _object_schema(schema: str) -> str:
    """A JSON schema as llguidance takes it with format options: an object. The boolean schemas
    are written as objects ({} admits any value); `false`, which admits none, is refused, and
    so is what llguidance would compile into a grammar admitting values the schema does not
    (`check_schema_for_llguidance`)."""
    try:
        value = json.loads(schema)
    except ValueError:
        return schema  # llguidance's own message says where it is not JSON
    if value is True:
        return "{}"
    if value is False:
        raise ValueError("the JSON schema false admits no value")
    check_schema_for_llguidance(value)
    return schema


EXACT_INTEGERS = 2 ** 53  # llguidance reads a schema's numbers as float64
_CONSTRAINING_NUMBERS = ("const", "enum", "minimum", "maximum", "exclusiveMinimum",
                         "exclusiveMaximum", "multipleOf")
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not subschemas


def check_schema_for_llguidance(schema: object, where: str = "schema") -> None:
    """ValueError naming the keyword for what llguidance (1.9) accepts and then constrains
    wrongly, so that no output can break its schema silently:
    - an integer beyond +-2^53 in const, enum or a numeric bound: read as float64 and rounded,
      so {"const": 1234567890123456789} gave 1234567890123456768;
    - a `pattern` (or patternProperties key) whose negated class excludes '"' or '\\': the
      JSON escapes \\" and \\\\ pass it, so "^[^\"]*$" admitted the string a"b."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_for_llguidance(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        at = f"{where}.{key}"
        big = _inexact_integer(value) if key in _CONSTRAINING_NUMBERS else None
        if big is not None:
            raise ValueError(f"JSON schema {at}: the integer {big} is beyond +-2^53, which the "
                             "grammar compiler reads as a float and rounds")
        if key in _DATA_KEYWORDS:
            continue
        if key == "pattern" and isinstance(value, str):
            _check_pattern(value, at)
        if key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                _check_pattern(pattern, f"{at} key")
        check_schema_for_llguidance(value, at)


def _inexact_integer(value: object) -> int | None:
    """The first integer in a JSON value that float64 cannot hold exactly, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) > EXACT_INTEGERS else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((big for big in map(_inexact_integer, items) if big is not None), None)


def _check_pattern(pattern: str, where: str) -> None:
    try:
        with warnings.catch_warnings():  # Python's future set syntax ([[:alpha:]]) warns
            warnings.simplefilter("ignore")
            tree = re._parser.parse(pattern)
    except re.error:
        return  # a dialect Python does not read (llguidance's is Rust's): left to llguidance
    for ch in ('"', "\\"):
        if _negated_class_excludes(tree, ord(ch)):
            raise ValueError(f"JSON schema {where} {pattern!r}: a negated character class "
                             f"excluding {ch!r} is not enforced by the grammar compiler (the "
                             f"JSON escape of {ch!r} passes it); spell the allowed characters "
                             "out instead")


def _negated_class_excludes(tree: object, code: int) -> bool:
    """Whether a parsed regex holds a negated class ([^...]) that excludes character `code`."""
    categories = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D",
                  sre.CATEGORY_SPACE: r"\s", sre.CATEGORY_NOT_SPACE: r"\S",
                  sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}

    def member(item: tuple) -> bool:
        op, arg = item
        if op == sre.LITERAL:
            return arg == code
        if op == sre.RANGE:
            return arg[0] <= code <= arg[1]
        if op == sre.CATEGORY and arg in categories:
            return re.fullmatch(categories[arg], chr(code)) is not None
        return False

    def walk(node: object) -> bool:
        if isinstance(node, tuple) and len(node) == 2 and node[0] == sre.NOT_LITERAL:
            return node[1] == code
        if (isinstance(node, tuple) and len(node) == 2 and node[0] == sre.IN and node[1]
                and node[1][0][0] == sre.NEGATE):
            return any(member(item) for item in node[1][1:])
        if isinstance(node, (list, tuple)) or hasattr(node, "data"):
            return any(walk(child) for child in getattr(node, "data", node))
        return False

    return walk(tree)


class TokenConstraint:
    """One request's matcher: its state follows the tokens the request has emitted."""

    def __init__(self, matcher: "llguidance.LLMatcher", executor: "llguidance.LLExecutor"
                 ) -> None:
        self._matcher = matcher
        self._executor = executor

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into row `row` of an int32 bitmask [B, words]."""
        fill_bitmask([(row, self)], bitmask)

    def consume(self, token: int) -> bool:
        """Advances past an emitted token; False when the matcher refuses it. Every constrained
        step samples under the mask, yet llguidance can allow a special token whose text a
        grammar spells out (`<|im_end|>` in a regex) and then refuse the token itself: the
        request must end there, not the step."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def error(self) -> str:
        """Why the matcher refused, after `consume` returned False."""
        return self._matcher.get_error()

    @property
    def done(self) -> bool:
        """The output is complete: nothing may follow (the end-of-sequence token was taken)."""
        return self._matcher.is_stopped()


def fill_bitmask(rows: Sequence[tuple[int, TokenConstraint]], bitmask: np.ndarray) -> None:
    """Writes each (row, constraint)'s allowed tokens into its row of an int32 bitmask
    [B, words], in one call on llguidance's thread pool. Measured here (2 cores, SmolLM2's
    vocabulary, 8 rows under a regex of letters): 3.5 ms a step on 2 threads, 6.8 ms row by
    row."""
    import llguidance.numpy

    if rows:
        llguidance.numpy.fill_next_token_bitmask_par(
            rows[0][1]._executor, [(c._matcher, row) for row, c in rows], bitmask)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary (the logits' width, which
    may exceed the tokenizer's: tokens past it are never allowed)."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._ll_tokenizer: "llguidance.LLTokenizer | None" = None
        self._executor: "llguidance.LLExecutor | None" = None
        self._lock = threading.Lock()  # a server's request threads may build it at once

    def _llg_tokenizer(self) -> "llguidance.LLTokenizer":
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    import llguidance
                except ImportError:
                    raise ValueError("structured output needs llguidance: pip install "
                                     "'infer[structured]'") from None
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_ids))
                # Every core: a constrained step waits for its masks (it is never planned
                # ahead), so nothing else runs meanwhile; llguidance's default takes 80%.
                self._executor = llguidance.LLExecutor(min(32, len(os.sched_getaffinity(0))))
            return self._ll_tokenizer

    def constraint(self, spec: StructuredOutput) -> TokenConstraint:
        """A fresh matcher for `spec`; ValueError with llguidance's message if it is invalid
        (a bad regex, schema or grammar), before any request state exists."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        try:
            source = grammar_source(spec)
        except ValueError as e:
            raise ValueError(f"invalid structured output: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(source, tokenizer)
        if error:
            raise ValueError(f"invalid structured output: {error.strip()}")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        constraint = TokenConstraint(matcher, self._executor)
        # A constraint whose language is empty (the regex "[a&&b]") only shows it once its first
        # mask is computed: the request would end at once, its output outside the language.
        first = np.zeros((1, mask_words(self.vocab_size)), np.int32)
        constraint.fill(first, 0)
        if matcher.is_error() or matcher.is_stopped() or not first.any():
            raise ValueError(f"invalid structured output: no output satisfies it "
                             f"({matcher.get_error() or 'nothing is allowed first'})")
        return constraint
