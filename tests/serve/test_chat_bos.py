"""The chat endpoint's prompt ids: the rendered template's own special tokens, as vLLM's."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from infer.io.tokenizer import Tokenizer
from infer.serve.protocol import ServedModel, parse_chat


def test_chat_adds_bos_only_when_asked() -> None:
    """vLLM's chat `add_special_tokens` defaults to false, whatever the tokenizer adds to plain
    text: a template that writes no BOS gets none, unless the body asks for special tokens."""
    backend = tokenizers.Tokenizer(models.BPE(
        {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    tok = Tokenizer(backend, bos_id=bos, eos_ids=[eos], add_bos=True,
                    chat_template="{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                                  "{% endfor %}")
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
