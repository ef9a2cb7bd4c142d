"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs (BOS/EOS ids, chat template).

Built either from a GGUF file's metadata (byte-level BPE, the only kind llama.cpp calls "gpt2")
or from a HF directory's tokenizer.json. Chat templates render with a sandboxed jinja2, as HF does.
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import os
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from infer.io.checkpoint import (Checkpoint, GGUFTokenizerData, HFTokenizerDir, TokenizerSource,
                                 read_gguf_tokenizer)

# Llama-3's split pattern (llama.cpp pre-tokenizer "llama-bpe"): digits in groups of up to three.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Chat models end a turn with these rather than (or as well as) their EOS token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, soft hyphen) for 256, 257, ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_LEVEL = _byte_level_bytes()
# Decoders whose pieces token_bytes reads as bytes. Fuse joins pieces; Strip trims the start of
# a whole text (a SentencePiece first token's space), not what a token adds to a text it
# continues, which is what token_bytes gives.
_PIECE_DECODERS = {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}


def _pre_tokenizer(pre: str | None, where: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "gpt2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"{where}: pre-tokenizer {pre!r} is not supported "
                     "(supported: 'smollm', 'gpt2', 'llama-bpe')")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON, and may pass
    # json.dumps' layout options, as HF's filter allows.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: training templates mark the assistant's text
    with it (HF uses the mark for assistant masks); rendering a prompt just keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def join_text_parts(content: Any, where: str) -> Any:
    """A message's content given as OpenAI text parts ([{"type": "text", "text": ...}]) as
    one string, the parts joined by newlines as vLLM joins them; any other content as it is.
    ValueError for a part that is not text."""
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise ValueError(f"{where}: only text parts are supported, got {part!r:.80}")
        texts.append(part["text"])
    return "\n".join(texts)


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        m = dict(m, content=join_text_parts(m.get("content"), f"messages[{i}].content"))
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string (content: or a list "
                                 f"of text parts), got {m.get(key)!r:.80}")
        checked.append(m)
    return checked


def hf_tokenizer_file(path: str | os.PathLike[str]) -> str:
    """The tokenizer.json of a HF checkpoint directory; FileNotFoundError when it has none."""
    tok_path = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"{os.fspath(path)}: directory has no tokenizer.json")
    return tok_path


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_id: int | None,
                 eos_ids: Sequence[int], add_bos: bool, chat_template: str | None,
                 unk_id: int | None = None, pad_id: int | None = None,
                 model_vocab_size: int | None = None) -> None:
        self._tok = tokenizer
        self._bos_id = bos_id
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))  # ordered, no duplicates
        self._add_bos = add_bos
        self._chat_template = chat_template
        self._unk_id, self._pad_id = unk_id, pad_id
        # Models often pad their embedding past the tokenizer's vocabulary (to a multiple of 64,
        # say) and can sample those ids: they decode to nothing, as in HF, rather than fail.
        self._num_ids = max(self.vocab_size, model_vocab_size or 0)
        self._special_ids = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: Checkpoint | GGUFTokenizerData | str | os.PathLike[str]) -> "Tokenizer":
        """From a GGUF checkpoint, its tokenizer metadata, or the path of a GGUF file."""
        if isinstance(source, Checkpoint):
            source = source.tokenizer_source
        if isinstance(source, (str, os.PathLike)):
            source = read_gguf_tokenizer(source)
        if not isinstance(source, GGUFTokenizerData):
            raise TypeError(f"expected a GGUF checkpoint or its tokenizer data, got {type(source)}")
        meta = source
        if meta.model != "gpt2":
            raise ValueError(f"{meta.path}: tokenizer model {meta.model!r} is not supported "
                             "(only byte-level BPE, 'gpt2')")
        if len(meta.token_types) != len(meta.tokens):
            raise ValueError(f"{meta.path}: {len(meta.tokens)} tokens but "
                             f"{len(meta.token_types)} token types")
        # llama.cpp names an empty token "[EMPTY_<id>]" and refuses a list where two ids share
        # a text (it asserts its text -> id map is as long as the list): one id each way.
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta.tokens)]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            first: dict[str, int] = {}
            i, tok = next((i, t) for i, t in enumerate(tokens) if first.setdefault(t, i) != i)
            raise ValueError(f"{meta.path}: token {tok!r} appears twice in the token list (ids "
                             f"{first[tok]} and {i}); llama.cpp refuses such a vocabulary too")
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        if any(len(m) != 2 for m in merges):
            raise ValueError(f"{meta.path}: malformed BPE merge (expected 'left right')")
        tok = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=meta.pre == "llama-bpe"))
        tok.pre_tokenizer = _pre_tokenizer(meta.pre, meta.path)
        tok.decoder = decoders.ByteLevel()
        # Control tokens are matched whole in text (so "<|im_start|>" is one id) and are what
        # skip_special_tokens drops; user-defined ones are matched whole but kept.
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, meta.token_types) if k == _GGUF_CONTROL])
        tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, meta.token_types) if k == _GGUF_USER_DEFINED])
        eos = [i for i in (meta.eos_id, *meta.extra_eos_ids) if i is not None]
        eos += [vocab[t] for t in _END_OF_TURN_TOKENS
                if t in vocab and meta.token_types[vocab[t]] == _GGUF_CONTROL]
        return cls(tok, bos_id=meta.bos_id, eos_ids=eos, add_bos=meta.add_bos,
                   chat_template=meta.chat_template, unk_id=meta.unk_id, pad_id=meta.pad_id)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str],
                    model_vocab_size: int | None = None) -> "Tokenizer":
        """From tokenizer.json, with tokenizer_config.json (and special_tokens_map.json, as
        transformers reads it) and generation_config.json (else config.json) for the special
        tokens, if present.
        `model_vocab_size`: the model's vocabulary, when larger than the tokenizer's (see
        `decode`)."""
        path = os.fspath(path)
        tok_path = hf_tokenizer_file(path)
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # the Rust side raises a bare Exception on bad files
            raise ValueError(f"{tok_path}: could not be loaded: {e}") from e
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        if "added_tokens_decoder" not in cfg:
            # Saves older than transformers 4.34 keep special tokens in special_tokens_map.json;
            # transformers reads it for such a config (one without added_tokens_decoder) and
            # lets its entries override the config's.
            special = _read_json(os.path.join(path, "special_tokens_map.json"))
            cfg = {**cfg, **{k: v for k, v in special.items()
                             if k in ("bos_token", "eos_token", "unk_token", "pad_token")}}
        gen_path = os.path.join(path, "generation_config.json")
        # Without generation_config.json, HF and vLLM take generation settings from config.json
        # (GenerationConfig.from_model_config), its eos_token_id list included.
        gen = _read_json(gen_path if os.path.isfile(gen_path) else os.path.join(path, "config.json"))

        def token_id(key: str) -> int | None:
            content = _token_content(cfg.get(key))
            return None if content is None else tok.token_to_id(content)

        bos_id = token_id("bos_token")
        eos = [i for i in (token_id("eos_token"),) if i is not None]
        gen_eos = gen.get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        added = tok.get_added_tokens_decoder()
        eos += [i for i, t in added.items() if t.special and t.content in _END_OF_TURN_TOKENS]

        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: Llama-3 style tokenizers add BOS in their post-processor.
            first = tok.encode("", add_special_tokens=True).ids
            add_bos = bool(first) and first[0] == bos_id
        return cls(tok, bos_id=bos_id, eos_ids=eos, add_bos=bool(add_bos),
                   chat_template=_hf_chat_template(path, cfg),
                   unk_id=token_id("unk_token"), pad_id=token_id("pad_token"),
                   model_vocab_size=model_vocab_size)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> "Tokenizer":
        source: TokenizerSource = checkpoint.tokenizer_source
        if isinstance(source, HFTokenizerDir):
            # A GGUF's vocabulary is its token list; a HF model's may be padded past it.
            return cls.from_hf_dir(source.path, model_vocab_size=checkpoint.hf_config["vocab_size"])
        return cls.from_gguf(source)

    def for_model(self, model_vocab_size: int) -> "Tokenizer":
        """This tokenizer for a model that samples `model_vocab_size` ids: the ids past its own
        vocabulary decode to "" (see `decode`). Itself where it covers them already."""
        if model_vocab_size <= self._num_ids:
            return self
        return Tokenizer(self._tok, bos_id=self._bos_id, eos_ids=self._eos_ids,
                         add_bos=self._add_bos, chat_template=self._chat_template,
                         unk_id=self._unk_id, pad_id=self._pad_id,
                         model_vocab_size=model_vocab_size)

    # -- properties ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def num_ids(self) -> int:
        """The ids `decode` takes: the vocabulary's, or the model's padded past it."""
        return self._num_ids

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the EOS token and the end-of-turn tokens."""
        return self._eos_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode` prepends BOS by default."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids. BOS is
        added (by default where the tokenizer's config says so) unless the text begins with it
        already, as a rendered chat template that writes `bos_token` does: never two."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self._add_bos if add_bos is None else add_bos) and not (
                ids and ids[0] == self._bos_id):
            if self._bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids.insert(0, self._bos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text, which decoding it alone can lose: a byte-level
        token holding part of a UTF-8 character (or a byte-fallback `<0xF0>`) decodes to U+FFFD,
        while its bytes joined with its neighbours' spell the character (OpenAI's logprob
        `bytes`). Tokenizers with other decoders give the UTF-8 of the token's text."""
        piece = None if token_id in self._added_ids else self._tok.id_to_token(token_id)
        if piece is None or self._piece_decoders is None:
            return self.decode([token_id]).encode()
        kinds = {kind for kind, _ in self._piece_decoders}
        if "ByteLevel" in kinds:
            if all(ch in _BYTE_LEVEL for ch in piece):
                return bytes(_BYTE_LEVEL[ch] for ch in piece)
            return self.decode([token_id]).encode()
        for kind, args in self._piece_decoders:
            if kind == "Replace":
                piece = piece.replace(*args)
            elif kind == "Metaspace":
                piece = piece.replace(args, " ")
        if "ByteFallback" in kinds and len(piece) == 6 \
                and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _piece_decoders(self) -> tuple[tuple[str, Any], ...] | None:
        """The decoder's steps that map a token's piece to its text, as (kind, argument) pairs;
        None when one of them is not read by `token_bytes`."""
        decoder = self._tok.decoder
        if decoder is None:
            return None
        state = json.loads(decoder.__getstate__())
        steps = state["decoders"] if state["type"] == "Sequence" else [state]
        out = []
        for step in steps:
            kind = step["type"]
            if kind not in _PIECE_DECODERS:
                return None
            if kind == "Replace":
                if "String" not in step["pattern"]:
                    return None  # a regex pattern: rare, and its text is decode's
                out.append((kind, (step["pattern"]["String"], step["content"])))
            elif kind == "Metaspace":
                out.append((kind, step.get("replacement", "\u2581")))
            else:
                out.append((kind, None))
        return tuple(out)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Ids of the model's padded vocabulary (past the tokenizer's, when it
        was built with a larger `model_vocab_size`) decode to ""; any other id outside the
        vocabulary raises ValueError, and an id that is not an integer (a float, a string)
        TypeError, as in HF, rather than being truncated or parsed into one."""
        ids = [operator.index(i) for i in ids]
        n = self._num_ids
        if ids and not (0 <= min(ids) and max(ids) < n):  # two C loops: this runs per token
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {n})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Renders a conversation with the model's template (a prompt string, not ids)."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        messages = _validate_messages(messages)

        # As HF passes them: a token the tokenizer lacks stays undefined (templates test
        # `pad_token is defined`), and templates with tool or document sections test these
        # for none.
        ids = {"bos_token": self._bos_id, "eos_token": self._eos_ids[0] if self._eos_ids else None,
               "unk_token": self._unk_id, "pad_token": self._pad_id}
        texts = {name: self._tok.id_to_token(i) for name, i in ids.items() if i is not None}
        # Compiled outside the try: a template that does not parse is the model's fault (a
        # server error), not the messages'.
        template = _compile_template(self._chat_template)
        try:
            return template.render(
                messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt,
                **{name: text for name, text in texts.items() if text is not None})
        except (jinja2.TemplateError, TypeError) as e:
            # The template failed on these messages (an index past the conversation, an
            # operation on a missing field): theirs to change, as its raise_exception is.
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from e


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            value = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _hf_chat_template(path: str, cfg: Mapping[str, Any]) -> str | None:
    # Newer transformers write the template to its own file, and read that file in preference
    # to tokenizer_config.json's entry (which an older save may have left behind).
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text pieces for streaming.

    Each `step` re-decodes only a short window: the ids since the last emitted piece plus the
    piece before it as context (so decoders that treat the first token specially, like
    SentencePiece's leading space, behave as in a full decode). Text that ends in an incomplete
    UTF-8 character decodes to U+FFFD; it is held back until the character completes. Ids that
    decode to nothing wherever they stand (special tokens when skipped, the model's padded ids
    past the vocabulary) never enter the window: a run of them, which a model at a high
    temperature or under ignore_eos can emit by the hundred, would otherwise grow it, and every
    step would decode the whole run again.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._vocab_size = tokenizer.vocab_size
        self._ids: list[int] = []  # the ids seen that can decode to text
        self._prefix = 0  # start of the context window in _ids
        self._read = 0    # _ids before this index are already emitted as text
        self._seen = 0    # ids of the running list taken in
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """New text completed by the latest ids (the whole running list is passed each time).

        With final=True everything left is emitted, incomplete characters included, so the
        concatenated pieces equal `decode(ids)`.
        """
        self._ids += self._new_text_ids(ids)
        self._seen = len(ids)
        piece = self._piece(self._ids, final)
        if piece is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(piece)
        return piece

    def peek(self, ids: Sequence[int]) -> str:
        """What `step(ids, final=True)` would emit, without emitting it: the held-back text
        and the new ids' text. The next `step` goes on as if this was not called."""
        return self._piece(self._ids + self._new_text_ids(ids), final=True) or ""

    def _new_text_ids(self, ids: Sequence[int]) -> list[int]:
        """The ids past those taken in, less those that decode to nothing. Any other id, a bad
        one included, is kept for `decode` to judge (and refuse)."""
        if len(ids) < self._seen:
            raise ValueError(f"ids shrank from {self._seen} to {len(ids)}; pass the running list")
        special, vocab, padded = self._skip, self._vocab_size, self._tokenizer.num_ids
        return [i for i in map(operator.index, ids[self._seen:])
                if not (vocab <= i < padded or (special and self._tokenizer.is_special(i)))]

    def _piece(self, ids: Sequence[int], final: bool) -> str | None:
        """The text `ids` (the window's list) add to what was emitted; None: nothing yet."""
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip)
        before = decode(ids[self._prefix:self._read])
        full = decode(ids[self._prefix:])
        if len(full) <= len(before) or (full.endswith("\ufffd") and not final):
            return None
        return full[len(before):]
