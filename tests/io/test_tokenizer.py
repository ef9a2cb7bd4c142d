"""The GGUF-built tokenizer against HF transformers' tokenizer loaded from the same file."""

from __future__ import annotations

import os
import re
from pydoc_data.topics import topics

import numpy as np
import jinja2
import pytest
from tokenizers import models

from infer.io.checkpoint import read_gguf_tokenizer, smollm2_gguf_path
from infer.io.tokenizer import _BYTE_LEVEL, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "Héllo wörld, ça va? Ñandú Zürich façade",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "  leading and   multiple    spaces  ",
    "tabs\tand\nnewlines\n\n\r\n  \n end\t\t",
    "def f(x):\n    return x ** 2  # square\n\tif x != 0: print(f'{x!r}')\n",
    "1234567890 3.14159 1,000,000 v2.0.1 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<file_sep>b <reponame>c<|endoftext|>d<|im_end|>",
    topics["for"][:3000],
    topics["lambda"] + topics["string-methods"][:3000],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_tokenizer(gguf_path))


@pytest.fixture(scope="module")
def hf_tok(gguf_path: str):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text, add_bos=False) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == hf_tok.encode(text)  # both default to no BOS for SmolLM2


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_id == hf_tok.bos_token_id == 1
    assert hf_tok.eos_token_id in tok.eos_ids
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids
    assert tok.add_bos is False
    assert tok.is_special(0) and tok.is_special(2) and tok.is_special(16)
    assert not tok.is_special(tok.encode("hello")[0])
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([49152])



def test_decode_takes_integer_ids_only(tok: Tokenizer) -> None:
    """NumPy integers decode as ints; a float or a string raises (as HF's decode does) rather
    than being truncated or parsed into an id."""
    import numpy as np

    ids = tok.encode("ok done")
    assert tok.decode(np.array(ids)) == tok.decode([np.int32(i) for i in ids]) == "ok done"
    for bad in ([float(ids[0])], [ids[0] + 0.9], [np.float32(ids[0])], [str(ids[0])]):
        with pytest.raises(TypeError):
            tok.decode(bad)
        with pytest.raises(TypeError):
            IncrementalDetokenizer(tok).step(bad)

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Écris un haïku sur la mer 🌊"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke.\nA short one."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf_tok, messages, add_generation_prompt) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    ["hello"],
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [{"content": "hi"}],
    [{"role": None, "content": "hi"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
])
def test_chat_template_rejects_bad_messages(tok: Tokenizer, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_chat_content_as_text_parts_is_the_parts_joined_by_newlines(tok: Tokenizer) -> None:
    """OpenAI-style content parts reach the template as vLLM passes them (one string, the
    parts joined by newlines), for LLM.chat as for the server; they were refused."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "One."},
                                          {"type": "text", "text": "Two."}]}]
    joined = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "One.\nTwo."}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(joined)


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    strict = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                       chat_template="{% if messages[0]['role'] != 'user' %}"
                                     "{{ raise_exception('first message must be from the user') }}"
                                     "{% endif %}{{ messages[0]['content'] }}")
    assert strict.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "no"}])


@pytest.mark.parametrize("template, messages", [
    ("{{ messages[1]['content'] }}", [{"role": "user", "content": "only one"}]),
    ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "text"}]),
    ("{{ messages[0]['content'].missing() }}", [{"role": "user", "content": "text"}])])
def test_chat_template_failures_are_value_errors(tok: Tokenizer, template: str,
                                                 messages: list) -> None:
    """A template that fails on the messages it is given (an index past the conversation, an
    operation the content does not take) is the messages' error, as its raise_exception is: a
    ValueError naming the chat template (a 400 from the server), not jinja's own exception
    (a 500)."""
    custom = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                       chat_template=template)
    with pytest.raises(ValueError, match="chat template: "):
        custom.apply_chat_template(messages)
    # A template that does not parse is the model's fault, not the messages': not a ValueError
    # (the server's 400), jinja's own error.
    broken = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                       chat_template="{% if %}" + template)
    with pytest.raises(jinja2.TemplateSyntaxError):
        broken.apply_chat_template(messages)


def test_chat_template_sees_missing_special_tokens_as_undefined(tok: Tokenizer) -> None:
    """As transformers passes them: a special token the tokenizer lacks is undefined in the
    template, not an empty string that `is defined` takes for a token."""
    template = ("{% if pad_token is defined %}[pad {{ pad_token }}]{% endif %}"
                "{% if unk_token is defined %}[unk {{ unk_token }}]{% endif %}"
                "{{ bos_token }}{{ messages[0]['content'] }}")
    message = [{"role": "user", "content": "hi"}]
    bos = tok.backend.id_to_token(tok.bos_id)
    bare = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                     chat_template=template)
    assert bare.apply_chat_template(message) == f"{bos}hi"
    padded = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                       chat_template=template, pad_id=tok.eos_ids[0], unk_id=0)
    pad, unk = tok.backend.id_to_token(tok.eos_ids[0]), tok.backend.id_to_token(0)
    assert padded.apply_chat_template(message) == f"[pad {pad}][unk {unk}]{bos}hi"


def test_bos_is_never_added_twice(tok: Tokenizer) -> None:
    """A tokenizer that adds BOS (Llama 3's) under a template that writes `bos_token`: the
    rendered chat gets one BOS, as a prompt without it gets one added."""
    llama3_like = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=True,
                            chat_template="{{ bos_token }}{% for m in messages %}"
                                          "{{ m['content'] }}\n{% endfor %}")
    chat = llama3_like.encode(llama3_like.apply_chat_template([{"role": "user", "content": "hi"}]))
    bos = tok.bos_id
    assert chat[0] == bos and chat[1] != bos
    assert chat[1:] == tok.encode("hi\n", add_bos=False)
    assert llama3_like.encode("hi") == [bos] + tok.encode("hi", add_bos=False)
    assert llama3_like.encode("hi", add_bos=False) == tok.encode("hi", add_bos=False)


@pytest.mark.parametrize("text", [
    "héllo 世界 🎉👍🏽 done",
    "👨‍👩‍👧🇫🇷 日本語のテキスト 中文 한국어 ∑∫√ ok",
    topics["for"][:500],
])
def test_incremental_detokenizer(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(ids[:n]) for n in range(1, len(ids) + 1)]
    assert not any("\ufffd" in p for p in pieces)  # nothing emitted before its character completes
    assert "".join(pieces) == detok.text == tok.decode(ids) == text


def test_incremental_detokenizer_final_flushes_incomplete_char(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    cut = ids[:-1]  # the emoji spans several byte-level tokens: this ends mid-character
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert [detok.step(cut[:n]) for n in range(1, len(cut) + 1)][-1] == ""
    detok.step(cut, final=True)
    assert detok.text == tok.decode(cut)
    with pytest.raises(ValueError, match="shrank"):
        detok.step(cut[:1])



def test_incremental_detokenizer_peek_emits_nothing(tok: Tokenizer) -> None:
    """peek(ids) is what step(ids, final=True) would emit (held-back text included), and the
    steps after it emit what they would have without it."""
    import random

    rng = random.Random(2)
    ids = tok.encode("ok 🎉 日本語 e\u0301 done")
    for trial in range(30):
        cut = rng.randint(1, len(ids))
        plain, peeked = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        for n in range(1, len(ids) + 1):
            if n == cut:
                flushed = IncrementalDetokenizer(tok)
                for m in range(1, n + 1):
                    flushed.step(ids[:m], final=m == n)
                assert peeked.text + peeked.peek(ids[:n]) == flushed.text == tok.decode(ids[:n])
            assert peeked.step(ids[:n]) == plain.step(ids[:n])
        assert peeked.text == plain.text == tok.decode(ids)

class _CountingTokenizer:
    """A tokenizer that records the longest id list `decode` was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self._tok, name)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenizer_window_stays_short_over_runs_of_nothing(tok: Tokenizer,
                                                                         seed: int) -> None:
    """Text ids (multi-byte characters among them) mixed with runs of up to 300 ids that decode
    to nothing (special tokens, skipped; a padded model's ids past the vocabulary), taken a few
    at a time: the pieces are the full decode, nothing is emitted before its character
    completes, and no decode call sees more than a few steps' ids, however long the runs
    (before, each step decoded the whole run since the last piece again)."""
    import random

    rng = random.Random(seed)
    padded = tok.for_model(tok.vocab_size + 64)
    specials = sorted(i for i in range(tok.vocab_size) if tok.is_special(i))
    nothing = specials + list(range(tok.vocab_size, tok.vocab_size + 64))
    words = ("héllo 世界 🎉👍🏽 日本語 e\u0301 fin " + topics["for"][:200]).split()
    for skip in (True, False):
        ids: list[int] = []
        for _ in range(12):
            ids += tok.encode(" " + " ".join(rng.choices(words, k=rng.randint(1, 4))))
            ids += [rng.choice(nothing if skip else nothing[len(specials):])
                    for _ in range(rng.choice([0, 1, 40, 300]))]
        counting = _CountingTokenizer(padded)
        detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
        n, pieces, most = 0, [], 0
        while n < len(ids):
            step = rng.randint(1, 4)
            n = min(len(ids), n + step)
            most = max(most, step)
            pieces.append(detok.step(ids[:n], final=n == len(ids)))
        assert "".join(pieces) == detok.text == padded.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces[:-1])
        # the context piece and the new ids, a character's bytes held back at most
        assert counting.longest <= 2 * most + 8, counting.longest


def test_from_hf_dir_matches_gguf(tok: Tokenizer, hf_tok, tmp_path) -> None:
    hf_tok.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert (from_dir.bos_id, from_dir.add_bos, from_dir.vocab_size) == (1, False, 49152)
    assert 2 in from_dir.eos_ids
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
    assert from_dir.apply_chat_template(CONVERSATIONS[0]) == tok.apply_chat_template(CONVERSATIONS[0])


def test_from_hf_dir_without_tokenizer_json(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi <there> & 'you'"},
            {"role": "assistant", "content": "Hello."}]


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m | tojson(sort_keys=True) }}{% endfor %}",
    "{% for m in messages %}{{ m | tojson(separators=(',', ':')) }}{% endfor %}",
    "{{ messages | tojson(indent=2, ensure_ascii=True) }}",
    # Training templates mark the assistant's text; a prompt keeps it as written.
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
    "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    # Mistral-style templates test the tool and document arguments HF passes (as none).
    "{% if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {% for m in messages %}{{ m.content }}{% endfor %}[/INST]",
    "{% if documents is not none %}<docs>{% endif %}{% for m in messages %}{{ m.content }}"
    "{% endfor %}",
])
def test_chat_template_features_match_hf(tok: Tokenizer, hf_tok, template: str) -> None:
    custom = Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False,
                       chat_template=template)
    assert custom.apply_chat_template(MESSAGES, add_generation_prompt=False) == \
        hf_tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)


def test_padded_model_vocabulary_decodes_to_nothing(hf_tok, tmp_path) -> None:
    """A model whose embedding is padded past the tokenizer's vocabulary can sample the padded
    ids: they decode to "" (as in HF), and only ids outside the model's vocabulary raise."""
    from infer.io.checkpoint import Checkpoint, HFTokenizerDir

    hf_tok.save_pretrained(tmp_path)
    n = hf_tok.vocab_size
    ckpt = Checkpoint(hf_config={"vocab_size": n + 64}, tensors={},
                      tokenizer_source=HFTokenizerDir(str(tmp_path)))
    padded = Tokenizer.from_checkpoint(ckpt)  # as the loader builds it
    assert padded.vocab_size == n
    ids = padded.encode("Hello world")
    with_pad = [ids[0], n, *ids[1:], n + 63]
    assert padded.decode(with_pad) == hf_tok.decode(with_pad) == "Hello world"
    detok = IncrementalDetokenizer(padded)
    for i in range(1, len(with_pad) + 1):
        detok.step(with_pad[:i], final=i == len(with_pad))
    assert detok.text == "Hello world"
    for bad in (n + 64, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary "
                                             rf"\[0, {n + 64}\)"):
            padded.decode([bad])


BOS_FREE_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def bos_adding_dir(tmp_path_factory) -> str:
    """A small byte-level tokenizer (ids within the tiny model's vocabulary) that adds BOS to
    what it encodes, with a Zephyr-style chat template that writes none."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = tokenizers.Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    path = tmp_path_factory.mktemp("bos_adding")
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "chat_template": BOS_FREE_TEMPLATE}))
    return str(path)


def test_chat_prompt_gets_no_bos_the_template_does_not_write(bos_adding_dir: str,
                                                            tiny_model) -> None:
    """HF's apply_chat_template(tokenize=True) and vLLM's chat add no special tokens to the
    rendered template; neither does LLM.chat, though the tokenizer adds BOS to plain text."""
    from infer.llm import LLM
    from infer.sampling_params import SamplingParams

    hf = transformers.AutoTokenizer.from_pretrained(bos_adding_dir)
    ours = Tokenizer.from_hf_dir(bos_adding_dir)
    assert ours.add_bos and ours.encode("hi") == hf.encode("hi") == [ours.bos_id] + hf.encode(
        "hi", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello"}]
    want = list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"])
    assert want[0] != ours.bos_id
    llm = LLM.from_loaded(tiny_model.config, tiny_model, ours, max_num_seqs=1,
                          max_model_len=64, page_size=4)
    out = llm.chat(messages, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == want
    assert out.prompt == ours.apply_chat_template(messages)


@pytest.mark.parametrize("with_generation_config", [False, True])
def test_from_hf_dir_eos_ids_of_config_json(tmp_path, with_generation_config: bool) -> None:
    """Without a generation_config.json, HF's generate and vLLM take the model's generation
    settings from config.json (`GenerationConfig.from_model_config`): its eos_token_id list
    (Llama-3.1's [<|end_of_text|>, <|eom_id|>, <|eot_id|>], say) ends generation too. With one,
    that file's list is the one they use."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = tokenizers.Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<|end|>", "<|stop|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    eos, end, stop = (backend.token_to_id(t) for t in ("</s>", "<|end|>", "<|stop|>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": [eos, end]}))
    if with_generation_config:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    want = transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id \
        if with_generation_config else transformers.GenerationConfig.from_model_config(
            transformers.AutoConfig.from_pretrained(tmp_path)).eos_token_id
    want = want if isinstance(want, list) else [want]
    got = Tokenizer.from_hf_dir(tmp_path).eos_ids
    assert set(want) <= set(got) and got[0] == eos
    assert (end in got) is not with_generation_config


@pytest.mark.parametrize("pre,flag,want", [("llama-bpe", None, True), ("llama-bpe", False, False),
                                           ("smollm", None, False), ("gpt2", True, True)])
def test_gguf_add_bos_default_follows_llama_cpp(tmp_path, pre: str, flag, want: bool) -> None:
    """llama.cpp adds BOS for the Llama-3 pre-tokenizer unless the file says otherwise (its
    llama-bpe arm sets add_bos; tokenizer.ggml.add_bos_token, when present, overrides): older
    Llama-3 GGUFs carry no flag, and their prompts would lack <|begin_of_text|>."""
    import gguf

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "<|begin_of_text|>"])
    writer.add_token_types([1, 1, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(2)
    if flag is not None:
        writer.add_add_bos_token(flag)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    meta = read_gguf_tokenizer(path)
    assert meta.add_bos is want
    assert Tokenizer.from_gguf(meta).encode("ab") == [2] * want + [0, 1]


def test_from_hf_dir_chat_template_file_wins_over_tokenizer_config(bos_adding_dir: str,
                                                                     tmp_path) -> None:
    """HF (and so vLLM) read chat_template.jinja in preference to tokenizer_config.json's
    chat_template: a directory holding both renders with the file's."""
    import shutil

    shutil.copytree(bos_adding_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    messages = [{"role": "user", "content": "Hello"}]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert want == "[user] Hello\n"
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(messages) == want


@pytest.mark.parametrize("config, special_map", [
    ({}, {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}),
    ({"eos_token": "<x>", "bos_token": None}, {"bos_token": "<s>", "eos_token": "</s>"}),
    ({"bos_token": "<s>", "eos_token": "<x>", "added_tokens_decoder": {}},
     {"bos_token": None, "eos_token": "</s>"}),
    ({"bos_token": "<s>"}, {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}),
])
def test_from_hf_dir_reads_special_tokens_map(tmp_path, config: dict, special_map: dict) -> None:
    """Older saves keep BOS/EOS in special_tokens_map.json only; transformers (so vLLM) reads
    it where tokenizer_config.json has no added_tokens_decoder, its entries winning."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = tokenizers.Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<x>", "<pad>", "<unk>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ pad_token }}|"
         "{{ unk_token }}"} | config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.bos_id == hf.bos_token_id
    assert list(ours.eos_ids[:1]) == [hf.eos_token_id]
    assert ours.encode("hi") == hf.encode("hi")
    messages = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)


def _byte_level_meta(tokens: list[str], types: list[int]):
    from infer.io.checkpoint import GGUFTokenizerData

    return GGUFTokenizerData(
        path="vocab.gguf", model="gpt2", pre="gpt2", tokens=tuple(tokens),
        token_types=tuple(types), merges=(), bos_id=None, eos_id=None, unk_id=None, pad_id=None,
        extra_eos_ids=(), add_bos=False, chat_template=None)


@pytest.mark.parametrize("seed", range(5))
def test_gguf_duplicate_token_text_is_refused_as_llama_cpp_does(seed: int) -> None:
    """llama.cpp asserts its text -> id map is as long as the token list; a text -> id dict
    here kept one id of a duplicated text, and the other decoded to an "outside the
    vocabulary" error mid-generation."""
    import random

    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab", "<|a|>", "<|b|>", "<|c|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    first = rng.randrange(len(tokens))
    second = rng.randrange(first + 1, len(tokens) + 1)
    tokens.insert(second, tokens[first])
    types.insert(second, types[first])
    with pytest.raises(ValueError, match=rf"vocab\.gguf: token {re.escape(repr(tokens[first]))} "
                                         rf"appears twice .*ids {first} and {second}"):
        Tokenizer.from_gguf(_byte_level_meta(tokens, types))


def test_gguf_empty_tokens_named_as_llama_cpp_does() -> None:
    """llama.cpp loads empty token texts as "[EMPTY_<id>]": two of them are no duplicate, and
    every id decodes."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["", "ab", ""]
    tok = Tokenizer.from_gguf(_byte_level_meta(tokens, [1] * len(tokens)))
    n = len(tokens)
    assert tok.vocab_size == n
    assert [tok.decode([i]) for i in (n - 3, n - 2, n - 1)] == [
        f"[EMPTY_{n - 3}]", "ab", f"[EMPTY_{n - 1}]"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(tok: Tokenizer, text: str) -> None:
    """OpenAI's logprob `bytes`: a token's own bytes, which joined spell the text also where
    one character spans several tokens (each of which decodes alone to U+FFFD)."""
    ids = tok.encode(text, add_bos=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_random_byte_runs(tok: Tokenizer) -> None:
    """Every byte value the vocabulary spells, through the byte-level alphabet: random byte
    strings (invalid UTF-8 too), cut into tokens by the tokenizer's own BPE over their
    byte-level spelling. (SmolLM2 has no token for 21 bytes, those UTF-8 never uses among them.)"""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    spelling = {b: ch for ch, b in _BYTE_LEVEL.items() if tok.token_to_id(ch) is not None}
    assert len(spelling) == 235
    values = np.array(sorted(spelling), np.uint8)
    for _ in range(20):
        raw = rng.choice(values, int(rng.integers(1, 40))).tobytes()
        pieces = tok.backend.model.tokenize("".join(spelling[b] for b in raw))
        joined = b"".join(tok.token_bytes(p.id) for p in pieces)
        assert joined == raw, (seed, raw)
        assert tok.decode([p.id for p in pieces]) == raw.decode("utf-8", "replace"), seed


def _byte_fallback_tokenizer(pieces: list[str]) -> Tokenizer:
    """Llama-2's and Mistral's kind: SentencePiece pieces with ▁ for space, bytes as <0xNN>."""
    import tokenizers
    from tokenizers import decoders, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_id=1, eos_ids=[2], add_bos=True, chat_template=None)


@pytest.mark.parametrize("text", TEXTS[1:6])
def test_token_bytes_of_a_byte_fallback_tokenizer(text: str) -> None:
    """Characters outside the vocabulary come as <0xNN> tokens, each its byte; ▁ is a space.
    Joined, the bytes are the text after the normalizer's leading ▁, which decode strips."""
    bpe = _byte_fallback_tokenizer(sorted(set("▁abcdefghijklmnopqrstuvwxyz,!.")))
    ids = bpe.encode(text, add_bos=False)
    assert any(bpe.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
    assert bpe.decode(ids) == text
    assert b"".join(bpe.token_bytes(i) for i in ids) == b" " + text.encode()
    assert bpe.token_bytes(1) == b"<s>"  # a special token: its text
