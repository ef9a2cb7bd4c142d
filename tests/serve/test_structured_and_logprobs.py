"""Structured output and logprobs through the server and the real `openai` client: constrained
outputs parse and validate, greedy ones equal the LLM's, logprobs equal the engine's in
OpenAI's two formats, streamed ones concatenate to the whole answer's, and bad constraints or
logprob counts are 400s naming their field."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest

from infer import SamplingParams
from infer.engine.request import TokenLogprob
from infer.sampling_params import StructuredOutput
from infer.serve import protocol

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "smollm2-4l"
SCHEMA = {"type": "object",
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["happy", "sad", "calm"]}},
          "required": ["age", "mood"], "additionalProperties": False}
LABEL = r'\{"label": "(positive|negative|neutral)"\}'  # the lesson's classifier regex
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


def _json_schema_format() -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


# -- structured output ----------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)],
                         ids=["greedy", "seeded"])
def test_response_format_json_schema_validates(running, sampling) -> None:
    got = running.client().chat.completions.create(
        model=MODEL, messages=PERSON, max_tokens=64, response_format=_json_schema_format(),
        **sampling)
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_parses_to_an_object(running) -> None:
    # A prompt the 4-layer model closes an object on: free strings, under any JSON object,
    # let it ramble to max_tokens on most.
    got = running.client().completions.create(
        model=MODEL, prompt="Describe a person as JSON:", max_tokens=64, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].text), dict)


def test_response_format_text_is_no_constraint(running) -> None:
    free = running.llm.generate("The capital of France is",
                                SamplingParams(temperature=0, max_tokens=8))[0]
    got = running.client().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
        extra_body={"response_format": {"type": "text"}})
    assert got.choices[0].text == free.text


@pytest.mark.parametrize("fields,check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
     lambda t: t in ("yes", "no", "maybe so")),
    ({"structured_outputs": {"regex": LABEL}}, lambda t: re.fullmatch(LABEL, t)),
    ({"regex": LABEL}, lambda t: re.fullmatch(LABEL, t)),  # SGLang's spelling
    ({"json_schema": json.dumps(SCHEMA)},  # SGLang's: the schema as a JSON string
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
], ids=["regex", "choice", "label", "sglang-regex", "sglang-json-schema"])
def test_structured_outputs_hold_at_temperature_1(running, fields, check) -> None:
    got = running.client().completions.create(
        model=MODEL, prompt="Is this review positive? Great food.", max_tokens=64,
        temperature=1.0, seed=3, extra_body=fields)
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize("fields,spec", [
    ({"response_format": _json_schema_format()}, StructuredOutput(json=SCHEMA)),
    ({"structured_outputs": {"regex": LABEL}}, StructuredOutput(regex=LABEL)),
], ids=["json_schema", "regex"])
def test_greedy_constrained_output_equals_the_llms(running, fields, spec) -> None:
    prompt = "Review: the food was cold. Label:"
    want = running.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64,
                                                       structured=spec))[0]
    got = running.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=64, temperature=0,
        extra_body=fields | {"return_token_ids": True})
    choice = got.choices[0]
    assert choice.text == want.text and choice.model_extra["token_ids"] == want.token_ids
    assert choice.finish_reason == want.finish_reason.value == "stop"


# -- logprobs ---------------------------------------------------------------------------------

PROMPT = "The capital of France is"


def _expected(running, k: int, max_tokens: int = 8, **kw) -> object:
    return running.llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       logprobs=k, ignore_eos=True, **kw))[0]


def _text(running, token_id: int) -> str:
    return running.llm.tokenizer.decode([token_id])


def test_completion_logprobs_equal_the_engines(running) -> None:
    want = _expected(running, 3)
    got = running.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    n = got.usage.completion_tokens
    assert n == 8 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.tokens == [_text(running, e.token_id) for e in want.logprobs]
    assert "".join(lp.tokens) == got.choices[0].text == want.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n)]
    for chosen, top, entry in zip(lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert len(top) == 3
        assert chosen == max(top.values())  # greedy: the chosen token is the likeliest
        assert chosen == pytest.approx(entry.logprob, abs=1e-5)
        assert list(top) == [_text(running, t) for t, _ in entry.top]
        assert list(top.values()) == pytest.approx([v for _, v in entry.top], abs=1e-5)


def test_completion_logprobs_0_names_the_chosen_token_alone(running) -> None:
    got = running.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [v for top in lp.top_logprobs for v in top.values()] == lp.token_logprobs


def test_chat_logprobs_format(running) -> None:
    messages = [{"role": "user", "content": "Name a planet."}]
    want = running.llm.chat(messages, SamplingParams(temperature=0, max_tokens=8,
                                                     logprobs=2))[0]
    got = running.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == len(want.token_ids)
    for item, entry in zip(content, want.logprobs):
        assert item.token == _text(running, entry.token_id)
        assert item.bytes == list(running.llm.tokenizer.token_bytes(entry.token_id))
        assert item.logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.token for t in item.top_logprobs] == [_text(running, t) for t, _ in entry.top]
        assert [t.bytes for t in item.top_logprobs] == [
            list(running.llm.tokenizer.token_bytes(t)) for t, _ in entry.top]
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob
    plain = running.client().chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("answer", ["🦙猫", "a🦙 é"])
def test_logprob_bytes_spell_characters_that_span_tokens(running, answer: str) -> None:
    """Each byte-level token of a character several tokens spell decodes alone to U+FFFD:
    chat's `bytes` are each token's own, joined they are the answer (OpenAI's contract; vLLM
    encodes the U+FFFD); completions' tokens and text offsets (vLLM's: summed token texts)
    alike in whole and streamed answers."""
    forced = {"structured_outputs": {"choice": [answer]}}
    chat = running.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "An animal?"}], max_tokens=16,
        temperature=0, logprobs=True, top_logprobs=1, extra_body=forced)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == answer
    assert "\ufffd" in "".join(t.token for t in content)  # parts of characters: the test's point
    assert b"".join(bytes(t.bytes) for t in content) == answer.encode()

    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1,
              extra_body=forced)
    whole = running.client().completions.create(**kw).choices[0]
    streamed = [c.choices[0].logprobs for c in running.client().completions.create(
        stream=True, **kw) if c.choices[0].logprobs is not None]
    tokenizer = running.llm.tokenizer
    ids = tokenizer.encode(answer, add_bos=False)
    texts = [tokenizer.decode([i]) for i in ids]
    want = [sum(map(len, texts[:i])) for i in range(len(ids))]
    assert whole.text == answer and whole.logprobs.tokens == texts
    assert whole.logprobs.text_offset == want
    assert sum((c.text_offset for c in streamed), []) == want


def test_streamed_logprobs_concatenate_to_the_whole_answers(running) -> None:
    client = running.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)]
    assert len(chunks) > 1  # tokens arrive spread over the events, not at the end
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c, field) for c in chunks), []) == getattr(whole, field), field

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=10,
                temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [item for c in client.chat.completions.create(stream=True, **chat)
                for item in c.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in whole]


def test_logprobs_cover_the_tokens_when_a_stop_string_cuts_the_text(running) -> None:
    free = _expected(running, 1, max_tokens=12).text
    words = [w for w in free.split() if len(w) >= 3 and free.find(w) > 0]
    assert words, free
    stop = words[len(words) // 2]
    got = running.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1, stop=[stop],
        extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and choice.text == free[:free.find(stop)]
    # Every token the engine reports, the one that completed the stop string included: more
    # text than was returned, as many entries as token_ids and usage count.
    tokens = choice.logprobs.tokens
    assert len(tokens) == len(choice.model_extra["token_ids"]) == got.usage.completion_tokens
    assert "".join(tokens).startswith(choice.text) and stop in "".join(tokens)


def test_minus_infinity_is_reported_as_vllms_floor() -> None:
    pieces = {1: ("a", b"a"), 2: ("b", b"b"), 3: ("\ufffd", b"\xf0"),
              4: ("\ufffd", b"\x9f")}.__getitem__
    entries = [TokenLogprob(1, -math.inf, 5, ((2, -0.1), (3, -1.0), (4, -2.0)))]
    body = protocol.completion_logprobs_body(pieces, entries,
                                             protocol.LogprobCursor(text_offset=4))
    assert body == {"tokens": ["a"], "token_logprobs": [-9999.0],
                    "top_logprobs": [{"b": -0.1, "\ufffd": -1.0, "a": -9999.0}],
                    "text_offset": [4]}
    chat = protocol.chat_logprobs_body(pieces, entries)
    assert chat["content"][0]["logprob"] == -9999.0
    assert json.dumps(body, allow_nan=False) and json.dumps(chat, allow_nan=False)


# -- refusals ---------------------------------------------------------------------------------

CHAT = {"messages": PERSON, "max_tokens": 4}
COMPLETION = {"prompt": PROMPT, "max_tokens": 4}
BAD = [
    ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("completions", {"regex": "("}, "regex"),
    ("completions", {"json_schema": "{not json"}, "json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"},
              "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a+"}, "ebnf": "start: \"a\""}, "ebnf"),
    ("completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs"),
    ("completions", {"structured_outputs": {}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a+", "backend": "xgrammar"}},
     "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ("completions", {"guided_json": SCHEMA}, "guided_json"),
    ("chat", {"guided_regex": "a+"}, "guided_regex"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("endpoint,fields,param", BAD,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_constraints_and_logprobs_are_400_with_the_field(running, endpoint, fields,
                                                             param) -> None:
    client = running.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, extra_body=fields, **CHAT)
        else:
            client.completions.create(model=MODEL, extra_body=fields, **COMPLETION)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]
    if param.startswith("guided_"):
        assert "structured_outputs" in e.value.body["message"]
    assert httpx.get(f"{running.url}/health").status_code == 200


def test_null_constraints_and_logprobs_are_off(running) -> None:
    """What clients send when they set nothing: every field null (or false)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "logprobs": None, "response_format": None, "structured_outputs": None,
            "regex": None, "json_schema": None, "ebnf": None, "guided_json": None}
    r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
