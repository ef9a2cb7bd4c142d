"""The chat endpoint's prompt: the rendered template's own special tokens, as vLLM's, the
message fields that reach the template, and messages it cannot render (the template refuses
them, or they carry tool calls) answered as the client's error."""

from __future__ import annotations

import functools
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from infer.io.tokenizer import Tokenizer
from infer.serve.protocol import ApiError, ServedModel, parse_chat

PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _tokenizer(chat_template: str | None) -> Tokenizer:
    """Byte-level, with BOS and EOS, and the given chat template."""
    backend = tokenizers.Tokenizer(models.BPE(
        {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_id=backend.token_to_id("<s>"),
                     eos_ids=[backend.token_to_id("</s>")], add_bos=True,
                     chat_template=chat_template)


def test_chat_adds_bos_only_when_asked() -> None:
    """vLLM's chat `add_special_tokens` defaults to false, whatever the tokenizer adds to plain
    text: a template that writes no BOS gets none, unless the body asks for special tokens."""
    tok = _tokenizer(PLAIN)
    bos = tok.bos_id
    served = ServedModel(name="m", root="m", max_model_len=64, max_num_seqs=1, tokenizer=tok)
    made: list[dict] = []

    def make_request(**kwargs) -> dict:
        made.append(kwargs)
        return kwargs

    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    text = tok.apply_chat_template(body["messages"])
    plain = tok.encode(text, add_bos=False)
    assert plain[0] != bos
    for extra, want in (({}, plain), ({"add_special_tokens": False}, plain),
                        ({"add_special_tokens": True}, [bos] + plain)):
        parse_chat(body | extra, served, make_request, 0.0)
        assert made[-1]["prompt_token_ids"] == want, extra


# Llama-2's and Mistral's rule, as their templates enforce it.
ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
               "{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("seed", range(4))
def test_messages_the_template_refuses_are_a_400(seed: int) -> None:
    """A template's raise_exception, or a model without a chat template, is the request's
    fault: a 400 naming messages (vLLM's answer), never an internal error a client retries.
    Conversations that keep the template's rule still render."""
    rng = random.Random(seed)
    made: list[dict] = []

    def make_request(**kwargs) -> dict:
        made.append(kwargs)
        return kwargs

    for _ in range(8):
        roles = [rng.choice(["user", "assistant"]) for _ in range(rng.randint(1, 4))]
        messages = [{"role": r, "content": f"m{i}"} for i, r in enumerate(roles)]
        alternate = all(r == ("user" if i % 2 == 0 else "assistant")
                        for i, r in enumerate(roles))
        body = {"messages": messages, "max_tokens": 1}
        for template in (ALTERNATING, None):
            served = ServedModel(name="m", root="m", max_model_len=64, max_num_seqs=1,
                                 tokenizer=_tokenizer(template))
            if template is not None and alternate:
                parse_chat(body, served, make_request, 0.0)
                continue
            with pytest.raises(ApiError) as e:
                parse_chat(body, served, make_request, 0.0)
            assert e.value.status == 400 and e.value.param == "messages", e.value.envelope()


NAMED = "{% for m in messages %}<|{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}|>" \
        "{{ m.content }}{% endfor %}"


@functools.cache
def _named() -> Tokenizer:
    return _tokenizer(NAMED)  # one: each build numbers the byte alphabet in its own order


def _parse(body: dict) -> dict:
    served = ServedModel(name="m", root="m", max_model_len=64, max_num_seqs=1,
                         tokenizer=_named())
    made: list[dict] = []
    parse_chat(body, served, lambda **kw: made.append(kw) or kw, 0.0)
    return made[-1]


def test_a_participants_name_reaches_the_template() -> None:
    """vLLM passes a message's `name` to the template; dropped, a template that renders it
    gave every speaker the same prompt."""
    tok = _named()
    messages = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "yes"}, {"role": "user", "content": "hi"}]
    made = _parse({"messages": messages, "max_tokens": 1})
    want = tok.encode("<|user:ann|>hi<|assistant|>yes<|user|>hi", add_bos=False)
    assert made["prompt_token_ids"] == want
    with pytest.raises(ApiError) as e:
        _parse({"messages": [{"role": "user", "content": "hi", "name": 3}], "max_tokens": 1})
    assert e.value.param == "messages"


@pytest.mark.parametrize("field,value", [
    ("tool_calls", [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]),
    ("function_call", {"name": "f", "arguments": "{}"})])
def test_an_assistants_tool_call_is_refused_and_an_empty_one_is_none(field, value) -> None:
    """Tools are refused, so a turn that made a call cannot be rendered: a 400, not a prompt
    without the call. OpenAI's SDK echoes a returned message with these fields null."""
    plain = _parse({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "ok"}], "max_tokens": 1})
    for empty in (None, []):
        echoed = _parse({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "ok", field: empty,
                                       "refusal": None}], "max_tokens": 1})
        assert echoed["prompt_token_ids"] == plain["prompt_token_ids"]
    with pytest.raises(ApiError) as e:
        _parse({"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "", field: value}],
                "max_tokens": 1})
    assert e.value.status == 400 and e.value.param == "messages" and field in str(e.value)


def test_the_deprecated_function_call_field_is_refused() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    _parse(body | {"function_call": "none"})
    with pytest.raises(ApiError) as e:
        _parse(body | {"function_call": {"name": "get_weather"}})
    assert e.value.param == "function_call"


@pytest.mark.parametrize("value", [0, -3, 1000])
def test_a_bad_max_completion_tokens_is_named_as_sent(value: int) -> None:
    """Chat takes max_completion_tokens for max_tokens: a bad value's error names the field the
    client sent, not one it never wrote."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_completion_tokens", "max_tokens"):
        with pytest.raises(ApiError) as e:
            _parse(body | {field: value})
        assert e.value.param == field, e.value.envelope()
        if value < 1:  # SamplingParams' message names the field; the context's is vLLM's text
            other = ({"max_completion_tokens", "max_tokens"} - {field}).pop()
            assert field in str(e.value) and other not in str(e.value)
    # No length asked for and a prompt that fills the context: the prompt is what is too long.
    with pytest.raises(ApiError) as e:
        _parse({"messages": [{"role": "user", "content": "x" * 80}]})
    assert e.value.param == "messages"


@pytest.mark.parametrize("template", ["{{ messages[1]['content'] }}",
                                      "{{ messages[0]['content'] + 1 }}"])
def test_a_template_failing_on_the_messages_is_a_400(template: str) -> None:
    """A template that fails on these messages otherwise than by raise_exception (jinja's
    UndefinedError, a TypeError) is the request's error too: vLLM answers 400; it was a 500."""
    served = ServedModel(name="m", root="m", max_model_len=64, max_num_seqs=1,
                         tokenizer=_tokenizer(template))
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    with pytest.raises(ApiError) as e:
        parse_chat(body, served, lambda **kwargs: kwargs, 0.0)
    assert e.value.status == 400 and e.value.param == "messages", e.value.envelope()
    assert "chat template" in e.value.envelope()["error"]["message"]


def test_text_parts_join_with_newlines_as_vllm_joins_them() -> None:
    """A message's content given as text parts is the parts joined by newlines (vLLM's
    string content format): the same prompt ids as that string."""
    tok = _tokenizer(PLAIN)
    served = ServedModel(name="m", root="m", max_model_len=64, max_num_seqs=1, tokenizer=tok)
    ids = []
    for content in ([{"type": "text", "text": "Line one."}, {"type": "text", "text": "Two."}],
                    "Line one.\nTwo."):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        parse_chat(body, served, lambda **kwargs: ids.append(kwargs["prompt_token_ids"]), 0.0)
    assert ids[0] == ids[1] == tok.encode("<|user|>Line one.\nTwo.", add_bos=False)
