"""A request's text where it stops: a stop token's text is left out (as vLLM's detokenizer does)
unless include_stop_str_in_output, a stop string cuts the text whatever else ends the request at
the same token, and streamed texts always lead to the final one (SmolLM2's tokenizer alone)."""

from __future__ import annotations

import random

import pytest

from infer.engine.request import FinishReason, Request
from infer.io.tokenizer import Tokenizer
from infer.sampling_params import OUTPUT_KINDS, SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from infer.io.checkpoint import smollm2_gguf_path
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def words(tokenizer: Tokenizer) -> list[int]:
    """Ids whose text is whole characters: a random stream of them decodes piece by piece."""
    return [i for i in range(200, 3000) if not tokenizer.is_special(i)
            and "\ufffd" not in tokenizer.decode([i])]


def _feed(request: Request, ids: list[int]) -> list[str]:
    """Appends ids until the request finishes; the text it showed after each."""
    shown = []
    for token in ids:
        finished = request.append(token)
        shown.append(request.output().text)
        if finished:
            break
    return shown


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=False)


class _Ends:
    """Stands in for a structured-output matcher that is complete after `n` tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def consume(self, token: int) -> bool:
        self.n -= 1
        return True

    @property
    def done(self) -> bool:
        return self.n <= 0


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_a_stop_tokens_text_is_left_out_unless_asked(tokenizer, kind) -> None:
    ids = _ids(tokenizer, "Hello world. Bye")
    dot = ids[2]
    assert tokenizer.decode([dot]) == "."
    for include, text in ((False, "Hello world"), (True, "Hello world.")):
        r = Request("r", [1], SamplingParams(max_tokens=10, stop_token_ids=[dot], seed=0,
                                             output_kind=kind,
                                             include_stop_str_in_output=include),
                    tokenizer, tokenizer.eos_ids)
        shown = _feed(r, ids)
        out = r.output()
        assert (out.text, out.token_ids) == (text, ids[:3])  # the token stays in token_ids
        assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, dot)
        assert all(text.startswith(s) for s in shown)


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_a_stop_string_cuts_the_text_where_a_stop_token_completes_it(tokenizer, kind) -> None:
    """"d." ends at the stop token ".": the text is cut before the stop string, as without the
    stop token, not only before the stop token's text."""
    ids = _ids(tokenizer, "Hello world. Bye")
    for include, text in ((False, "Hello worl"), (True, "Hello world.")):
        r = Request("r", [1], SamplingParams(max_tokens=10, stop=["d."], stop_token_ids=[ids[2]],
                                             seed=0, output_kind=kind,
                                             include_stop_str_in_output=include),
                    tokenizer, tokenizer.eos_ids)
        shown = _feed(r, ids)
        assert (r.output().text, r.output().stop_reason) == (text, "d.")
        assert all(text.startswith(s) for s in shown)


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_a_stop_string_cuts_the_text_where_a_constraint_completes(tokenizer, kind) -> None:
    ids = _ids(tokenizer, "Hello world. Bye")
    params = SamplingParams(max_tokens=10, stop=["d."], seed=0, output_kind=kind,
                            structured=StructuredOutput(regex=".*"))
    r = Request("r", [1], params, tokenizer, tokenizer.eos_ids, constraint=_Ends(3))
    _feed(r, ids)
    out = r.output()
    assert (out.text, out.token_ids, out.stop_reason) == ("Hello worl", ids[:3], "d.")
    # Completed without a stop string, the constraint's last token is text like any other.
    r = Request("r", [1], params, tokenizer, tokenizer.eos_ids, constraint=_Ends(2))
    _feed(r, ids)
    assert (r.output().text, r.output().finish_reason) == ("Hello world", FinishReason.STOP)


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer) -> None:
    ids = _ids(tokenizer, "Hello world. Bye bye")
    for kind in OUTPUT_KINDS:
        r = Request("r", [1], SamplingParams(max_tokens=10, stop=["o w", "Bye"], seed=0,
                                             output_kind=kind, include_stop_str_in_output=True),
                    tokenizer, tokenizer.eos_ids)
        shown = _feed(r, ids)
        assert (r.output().text, r.output().stop_reason) == ("Hello w", "o w")
        assert all("Hello w".startswith(s) for s in shown)


def _expected(tokenizer: Tokenizer, ids: list[int], params: SamplingParams
              ) -> tuple[str, int, FinishReason]:
    """The text, token count and finish reason by their definition, from whole decodes: the
    request ends at the first token that is a stop id, completes a stop string or reaches
    max_tokens; its text is the shortest of the cuts that apply (before the stop string, or
    after it when included; without the stop token's text unless included)."""
    decode = lambda n: tokenizer.decode(ids[:n], skip_special_tokens=True)  # noqa: E731
    stops, include = params.stop or (), params.include_stop_str_in_output
    for k in range(1, min(len(ids), params.max_tokens) + 1):
        text = decode(k)
        hits = sorted((text.find(s), -len(s), s) for s in stops if s in text)
        stop_id = ids[k - 1] in params.stop_token_ids
        if not (hits or stop_id or k == params.max_tokens):
            continue
        cuts = [len(text)]
        if hits:
            at, _, s = hits[0]
            cuts.append(at + len(s) if include else at)
        if stop_id and not include:
            cuts.append(len(decode(k - 1)))
        reason = FinishReason.STOP if hits or stop_id else FinishReason.LENGTH
        return text[:min(cuts)], k, reason
    raise AssertionError("max_tokens ends every request")


def test_stop_texts_follow_their_definition_on_random_streams(tokenizer, words) -> None:
    """Random streams of whole-character tokens, random stop ids and stop strings (some that
    the stop token completes), either output kind, with and without include_stop_str_in_output:
    the final text is the definition's, and every streamed text a prefix of it."""
    rng = random.Random(5)
    for trial in range(300):
        ids = [rng.choice(words) for _ in range(rng.randint(1, 12))]
        text = tokenizer.decode(ids)
        stop_ids = (rng.choice(ids),) if rng.random() < 0.6 else ()
        stop = None
        if rng.random() < 0.7:
            at = rng.randrange(len(text))
            stop = tuple(text[a:a + rng.randint(1, 6)] for a in (at, rng.randrange(len(text))))
        params = SamplingParams(max_tokens=rng.randint(1, len(ids)), stop_token_ids=stop_ids,
                                stop=stop, include_stop_str_in_output=rng.random() < 0.3,
                                seed=0, output_kind=rng.choice(OUTPUT_KINDS))
        r = Request(str(trial), [1], params, tokenizer, tokenizer.eos_ids)
        shown = _feed(r, ids)
        out = r.output()
        want = _expected(tokenizer, ids, params)
        assert (out.text, len(out.token_ids), out.finish_reason) == want, (ids, params)
        assert all(out.text.startswith(s) for s in shown), (ids, params, shown)


def test_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Request("r", [1], SamplingParams(stop=["a"], seed=0), None)
    Request("r", [1], SamplingParams(stop_token_ids=[97], seed=0), None)  # ids need none


def test_texts_so_far_lead_to_the_final_text_when_tokens_split_characters(tokenizer) -> None:
    """Random streams of byte tokens, pieces of multi-byte characters (emoji, CJK, combining
    marks) and special tokens, either output kind: the text shown after every token is a prefix
    of the final text (a character a token leaves incomplete is never shown as U+FFFD, then
    replaced), and without stop strings the final text is the tokens' whole decode."""
    from tokenizers import pre_tokenizers

    rng = random.Random(11)
    byte_ids = [i for i in map(tokenizer.token_to_id, pre_tokenizers.ByteLevel.alphabet())
                if i is not None]
    pieces = [t for s in ("héllo 世界 🎉👍🏽 done", "e\u0301\u0302 a\u0308", "👨‍👩‍👧🇫🇷 日本語")
              for t in _ids(tokenizer, s)]
    special = [i for i in range(64) if tokenizer.is_special(i)]
    for trial in range(400):
        ids = [rng.choice(byte_ids) if (u := rng.random()) < 0.3 else rng.choice(special)
               if u < 0.4 else rng.choice(pieces) for _ in range(rng.randint(1, 12))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop = (text[(a := rng.randrange(len(text))):a + rng.randint(1, 4)],) if (
            text and rng.random() < 0.4) else None
        params = SamplingParams(max_tokens=rng.randint(1, len(ids)), stop=stop,
                                stop_token_ids=(rng.choice(ids),) if rng.random() < 0.4 else (),
                                include_stop_str_in_output=rng.random() < 0.3, seed=0,
                                output_kind=rng.choice(OUTPUT_KINDS))
        r = Request(str(trial), [1], params, tokenizer, tokenizer.eos_ids)
        shown = _feed(r, ids)
        out = r.output()
        assert all(out.text.startswith(s) for s in shown), (ids, params, shown)
        if stop is None:
            n = len(out.token_ids)
            last = out.token_ids[-1]
            silent = (last in params.stop_token_ids or last in tokenizer.eos_ids) and \
                not params.include_stop_str_in_output
            assert out.text == tokenizer.decode(ids[:n - silent], skip_special_tokens=True)


def test_a_stop_string_ending_in_a_character_a_stop_token_completes(tokenizer, words) -> None:
    """A character spelled in byte tokens whose last one is a stop token id, and a stop string
    that ends in that character: the stop string cuts the text (as it alone would), though
    the text without the stop token leaves that character incomplete."""
    rng = random.Random(3)
    alphabet = {b: tokenizer.token_to_id(c) for b, c in enumerate(_byte_level_chars())}
    for trial in range(100):
        char = rng.choice("é世🎉\u0301ж€")
        head = [rng.choice(words) for _ in range(rng.randint(0, 4))]
        ids = head + [alphabet[b] for b in char.encode()]
        text = tokenizer.decode(ids)
        assert text.endswith(char)
        at = rng.randrange(len(text))
        for kind in OUTPUT_KINDS:
            params = SamplingParams(max_tokens=20, stop=[text[at:]], stop_token_ids=[ids[-1]],
                                    seed=0, output_kind=kind)
            r = Request(str(trial), [1], params, tokenizer, tokenizer.eos_ids)
            _feed(r, ids)
            out = r.output()
            assert (out.text, out.stop_reason) == (text[:at], text[at:]), (ids, params)


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that spells each byte 0..255, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def test_streamed_text_holds_back_exactly_the_longest_tail_a_stop_string_begins_with(
        tokenizer, words) -> None:
    """What a stream shows, by its definition (the text less its longest tail that is a proper
    prefix of a stop string), on random streams with many stop strings sharing prefixes: the
    binary search over the sorted stops agrees with a pass over every stop at every length."""
    rng = random.Random(11)
    for trial in range(200):
        ids = [rng.choice(words) for _ in range(rng.randint(1, 10))]
        text = tokenizer.decode(ids)
        stops = set()
        for _ in range(rng.randint(1, 40)):
            a = rng.randrange(len(text))
            s = text[a:a + rng.randint(1, 8)]
            stops.add(s + rng.choice(["", "", "q", "zz", s[-1:] * 2]))
        params = SamplingParams(max_tokens=len(ids), stop=tuple(stops), ignore_eos=True, seed=0)
        r = Request(str(trial), [1], params, tokenizer, tokenizer.eos_ids)
        for k, token in enumerate(ids, 1):
            if r.append(token):
                break
            so_far = tokenizer.decode(ids[:k])
            held = max((n for n in range(1, len(so_far) + 1)
                        if any(s.startswith(so_far[-n:]) and s != so_far[-n:] for s in stops)),
                       default=0)
            assert r.output().text == so_far[:len(so_far) - held], (ids[:k], sorted(stops))
