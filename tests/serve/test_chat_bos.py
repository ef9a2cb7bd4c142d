"""The chat endpoint's prompt: the rendered template's own special tokens, as vLLM's, and
messages the template refuses answered as the client's error."""

from __future__ import annotations

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
