"""The OpenAI wire format: request bodies checked and turned into engine requests, and outputs
turned into response bodies and stream chunks. No HTTP here (that is `app.py`), and no engine
state: everything is a function of the body, the served model and the outputs.

Defaults are OpenAI's (temperature 1.0, completions' max_tokens 16), not `SamplingParams`'.
Fields infer does not implement are accepted at their neutral value and refused with 400
otherwise: a silently ignored penalty would give wrong results without any sign."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Callable, Mapping, Sequence

from infer.engine.request import Request, RequestOutput, TokenLogprob
from infer.io.tokenizer import Tokenizer, join_text_parts
from infer.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput, is_integer

log = logging.getLogger("infer")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's


class ApiError(Exception):
    """An error answered with OpenAI's envelope: `{"error": {message, type, param, code}}`."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    # A message quotes the value it refuses: bounded, so that a 30 MB stop list or logit_bias
    # is not sent back whole (rendering it held the event loop for seconds).
    MAX_MESSAGE_CHARS = 2000

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        if len(message) > self.MAX_MESSAGE_CHARS:
            message = (f"{message[:self.MAX_MESSAGE_CHARS]}... ({len(message):,} characters, "
                       f"cut)")
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the protocol needs to know of the model behind the server."""

    name: str
    root: str  # the preset, file or directory it was loaded from
    max_model_len: int
    max_num_seqs: int
    tokenizer: Tokenizer
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # OpenAI's system_fingerprint of every response (`infer.serve.app.system_fingerprint`);
    # None: the server computes it from its engine.
    fingerprint: str | None = None
    # Each id decoded once: a logprobs response names every token and up to 20 alternatives
    # per position, and the same few thousand ids come back request after request.
    _token_pieces: dict[int, tuple[str, bytes]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "infer",
                "root": self.root, "parent": None, "max_model_len": self.max_model_len}

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs name it: its text, the tokenizer's decode of that id alone (a
        byte-level token that is part of a UTF-8 character decodes to U+FFFD, as in vLLM), and
        its own bytes, which joined spell such a character (OpenAI's `bytes`)."""
        piece = self._token_pieces.get(token_id)
        if piece is None:
            piece = self._token_pieces[token_id] = (self.tokenizer.decode([token_id]),
                                                    self.tokenizer.token_bytes(token_id))
        return piece


@dataclasses.dataclass
class Job:
    """One HTTP request: its engine requests, choice by choice (n per prompt)."""

    kind: str  # "completion" or "chat"
    response_id: str
    model: str
    created: int
    requests: list[Request]  # choice index i is requests[i]: prompt i // n, its draw i % n
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    # Set when the request asked for logprobs: the text and bytes each token is reported as.
    token_piece: Callable[[int], tuple[str, bytes]] | None = None
    # stream_options.continuous_usage_stats (with include_usage): every event carries its
    # choice's usage so far, as vLLM's do.
    continuous_usage: bool = False
    system_fingerprint: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt, not once per choice (OpenAI's usage)."""
        return sum(len(r.prompt_token_ids) for r in self.requests[::self.n])


# Fields infer lacks, with the values that mean "off": any other value is refused.
_NEUTRAL: dict[str, tuple] = {
    "echo": (None, False),
    "prompt_logprobs": (None,), "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "suffix": (None, ""), "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "skip_special_tokens": (None, True), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"),
    "continue_final_message": (None, False),
    "chat_template_kwargs": (None, {}), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    # vLLM's extensions that change the tokens or the text: unknown fields are ignored, and
    # these would then give other results than a client asked for, without a sign.
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
}
# vLLM's structured-output fields before 0.12, which removed them for `structured_outputs`: a
# client still sending them expects a constraint, so they are refused, with the new spelling.
_REMOVED_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar", "guided_decoding_backend": None,
                   "guided_whitespace_pattern": None}
# Fields that each carry one output constraint, in the order a conflict is reported in.
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "json_schema", "regex", "ebnf")
# Fields read below, or harmless to ignore (`user` only tags requests for OpenAI's abuse checks),
# on both endpoints; then each endpoint's own (max_completion_tokens is chat's alone, as in
# OpenAI's and vLLM's APIs: a completion client sending it gets the log line, not a silent 16).
_KNOWN = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "seed", "stop",
          "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "stream", "stream_options",
          "return_token_ids", "request_id", "user", "add_special_tokens", "logprobs",
          "top_logprobs"} | set(_NEUTRAL) | set(_REMOVED_GUIDED) | set(_CONSTRAINT_FIELDS)
_ENDPOINT_FIELDS = {"completion": {"prompt"},
                    "chat": {"messages", "max_completion_tokens", "add_generation_prompt",
                             "parallel_tool_calls"}}


class _UnknownFields:
    """Logs each field name unknown to an endpoint once per process, then ignores it."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, body: Mapping, endpoint: str) -> None:
        known = _KNOWN | _ENDPOINT_FIELDS[endpoint]
        for name in sorted(set(body) - known):
            if (endpoint, name) not in self.seen:
                self.seen.add((endpoint, name))
                log.info("ignoring the request field %r (not a field infer reads in a %s "
                         "request)", name, endpoint)


warn_unknown = _UnknownFields()


def _refuse_unsupported(body: Mapping) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(_same(body[name], v) for v in neutral):
            raise ApiError(400, f"{name}={body[name]!r} is not supported by infer (yet): only "
                                f"{', '.join(repr(v) for v in neutral)} is accepted", name)
    for name, key in _REMOVED_GUIDED.items():
        if body.get(name) is not None:
            instead = f'structured_outputs={{"{key}": ...}}' if key else "structured_outputs"
            raise ApiError(400, f"{name} was removed in vLLM 0.12 and infer does not read it: "
                                f"use {instead}", name)


def _same(a: object, b: object) -> bool:
    """JSON equality that keeps true apart from 1 and false from 0."""
    return type(a) is type(b) and a == b or (
        not isinstance(a, bool) and not isinstance(b, bool)
        and isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", name)
    return value


def _int(body: Mapping, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_integer(value):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
    return int(value)


def _number(body: Mapping, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise ApiError(400, f"{name} is out of range, got {value!r:.40}", name) from None


def _stop(body: Mapping) -> tuple[str, ...] | None:
    stop = body.get("stop")
    if stop is None or stop == []:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {stop!r}",
                       "stop")
    return tuple(stop)


def _stop_token_ids(body: Mapping) -> tuple[int, ...]:
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(is_integer(t) and t >= 0 for t in ids):
        raise ApiError(400, f"stop_token_ids must be a list of ints >= 0, got {ids!r}",
                       "stop_token_ids")
    return tuple(int(t) for t in ids)


def _response_format(value: object) -> dict | None:
    """OpenAI's response_format as StructuredOutput's fields; None for plain text."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        # `name` and `strict` change nothing here: the schema always constrains strictly.
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON "
                                f"schema object, got {spec!r:.80}", "response_format")
        return {"json": dict(schema)}
    raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": "
                        "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                        f"{{\"name\", \"schema\"}}}}, got {value!r:.80}", "response_format")


def _structured_outputs(value: object) -> dict:
    """vLLM's structured_outputs: exactly one of its constraints (null ones not counted)."""
    keys = ("json", "regex", "choice", "grammar", "json_object")
    if not isinstance(value, Mapping):
        raise ApiError(400, f"structured_outputs must be an object, got {value!r:.80}",
                       "structured_outputs")
    others = sorted(k for k, v in value.items() if k not in keys and v is not None)
    if others:
        # Its options (backend, whitespace, fallback) would be silently ignored otherwise.
        raise ApiError(400, f"structured_outputs: {', '.join(others)} not supported by infer; "
                            f"it reads {', '.join(keys)}", "structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and not (
        k == "json_object" and v is False)}
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs must give exactly one of {', '.join(keys)}, "
                            f"got {sorted(given) or 'none'}", "structured_outputs")
    if not isinstance(given.get("choice", []), list):  # a string would be split into letters
        raise ApiError(400, f"structured_outputs.choice must be a list of strings, got "
                            f"{given['choice']!r:.80}", "structured_outputs")
    return given


def structured_output(body: Mapping) -> tuple[StructuredOutput | None, str | None]:
    """The body's output constraint and the field it came from: OpenAI's response_format,
    vLLM's structured_outputs or SGLang's json_schema (a JSON string), regex and ebnf. At most
    one constraint; more is refused naming the later field in `_CONSTRAINT_FIELDS`' order."""
    found: list[tuple[str, dict]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name, key in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar")):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ApiError(400, f"{name} must be a string, got {value!r:.80}", name)
            found.append((name, {key: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint may be given, got "
                            f"{', '.join(name for name, _ in found)}", found[-1][0])
    name, spec = found[0]
    try:
        return StructuredOutput(**spec), name
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"{name}: {e}", name) from None


def _logprobs_count(value: object, name: str) -> int:
    if not (is_integer(value) and 0 <= value <= MAX_LOGPROBS):
        raise ApiError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
                       name)
    return int(value)


def completion_logprobs(body: Mapping) -> int | None:
    """Completions' logprobs: how many alternatives per token (null or false: none)."""
    value = body.get("logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "top_logprobs is a chat field: completions take logprobs=k",
                       "top_logprobs")
    if value is None or value is False:  # vLLM's benchmark client sends null
        return None
    return _logprobs_count(value, "logprobs")


def chat_logprobs(body: Mapping) -> int | None:
    """Chat's logprobs (a bool) and top_logprobs (how many alternatives; needs logprobs)."""
    wanted = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if not wanted:
        return None
    return 0 if top is None else _logprobs_count(top, "top_logprobs")


def sampling_params(body: Mapping, max_tokens: int, logprobs: int | None = None,
                    structured: StructuredOutput | None = None,
                    max_tokens_field: str = "max_tokens") -> SamplingParams:
    """The body's sampling fields with OpenAI's defaults; bad values raise ApiError naming the
    field (SamplingParams' own checks, whose problems each start with the field's name).
    `logprobs` and `structured` come parsed: their fields differ between endpoints;
    `max_tokens_field` is the field the client gave max_tokens in."""
    top_k = _int(body, "top_k", 0)
    if top_k == -1:  # SGLang's "off"; vLLM's is 0
        top_k = 0
    kwargs = dict(temperature=_number(body, "temperature", 1.0),
                  top_p=_number(body, "top_p", 1.0), top_k=top_k, max_tokens=max_tokens,
                  seed=_int(body, "seed", None), stop=_stop(body),
                  stop_token_ids=_stop_token_ids(body),
                  ignore_eos=_bool(body, "ignore_eos", False),
                  include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False))
    try:
        return SamplingParams(**kwargs, logprobs=logprobs, structured=structured)
    except ValueError as e:
        first = str(e).removeprefix("invalid SamplingParams: ").split(";")[0]
        name = first.split(" ", 1)[0]
        if name == "max_tokens":
            first, name = max_tokens_field + first.removeprefix(name), max_tokens_field
        raise ApiError(400, first, name if name in (*kwargs, max_tokens_field) else None
                       ) from None


def _check_common(body: Mapping, served: ServedModel,
                  endpoint: str) -> tuple[int, bool, bool, bool]:
    """model, n, best_of, stream and stream_options: (n, stream, include_usage,
    continuous_usage); vLLM's continuous_usage_stats counts only with include_usage."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    warn_unknown(body, endpoint)
    model = body.get("model")
    if model is not None and model != served.name:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    _refuse_unsupported(body)
    n = _int(body, "n", 1)
    if not 1 <= n <= served.max_num_seqs:
        raise ApiError(400, f"n must be in [1, {served.max_num_seqs}] (max_num_seqs), got {n}",
                       "n")
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise ApiError(400, f"best_of must equal n ({n}) when given, got {best_of}: infer does "
                            f"not rank candidates", "best_of")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       "stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise ApiError(400, f"stream_options must be an object, got {options!r}",
                       "stream_options")
    include_usage = bool(options and _bool(options, "include_usage", False))
    continuous = include_usage and _bool(options, "continuous_usage_stats", False)
    return n, stream, include_usage, continuous


def _response_id(body: Mapping, prefix: str) -> str:
    given = body.get("request_id")
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(given, str) or not given:
        raise ApiError(400, f"request_id must be a non-empty string, got {given!r}",
                       "request_id")
    return given


MakeRequest = Callable[..., Request]  # Engine.make_request's signature


def _requests(make_request: MakeRequest, response_id: str, prompts: Sequence[dict],
              params: SamplingParams, n: int, arrival_s: float, param: str,
              structured_param: str | None, stream: bool) -> list[Request]:
    """n requests per prompt, choice i of a seeded request drawing with seed + i (vLLM's
    rule), each id unique: `{response_id}-{prompt}.{choice}`. A constraint llguidance refuses
    (a bad regex, schema or grammar) is the fault of `structured_param`, not of the prompt.
    A response sent whole needs only its requests' final outputs."""
    params = dataclasses.replace(params, output_kind="cumulative" if stream else "final")
    out = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % 2**32
            try:
                out.append(make_request(params=dataclasses.replace(params, seed=seed),
                                        request_id=f"{response_id}-{p}.{i}",
                                        arrival_s=arrival_s, **prompt))
            except ValueError as e:
                # GrammarCompiler.constraint's refusals start so; any other is the prompt's.
                bad_constraint = str(e).startswith("invalid structured output")
                raise ApiError(400, str(e), structured_param if bad_constraint and
                               structured_param else param) from None
    return out


def _context_check(num_prompt: int, max_tokens: int, served: ServedModel, param: str,
                   max_tokens_field: str | None = "max_tokens") -> None:
    """A prompt (in field `param`) and its completion within the context; the error names the
    field that asked for the completion's length (None: the prompt alone is too long)."""
    if num_prompt + max_tokens > served.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {served.max_model_len} "
                            f"tokens. However, you requested {num_prompt + max_tokens} tokens "
                            f"({num_prompt} in the {param}, {max_tokens} in the completion). "
                            f"Please reduce the length of the {param} or completion.",
                       max_tokens_field or param)


def _prompts(body: Mapping, tokenizer: Tokenizer) -> list[list[int]]:
    """`prompt` as token ids: a string, a list of strings, a list of ids or a list of lists."""
    prompt = body.get("prompt")

    def ids(x: object) -> list[int] | None:
        if isinstance(x, list) and x and all(is_integer(t) and not isinstance(t, bool)
                                             for t in x):
            return [int(t) for t in x]
        return None

    if isinstance(prompt, str):
        prompts = [prompt]
    elif (single := ids(prompt)) is not None:
        return [single]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and None not in (lists := [ids(p) for p in prompt]):
        return lists
    else:
        raise ApiError(400, "prompt must be a non-empty string, list of strings, list of token "
                            f"ids or list of lists of them, got {prompt!r:.80}", "prompt")
    if not all(prompts):
        raise ApiError(400, "prompt is empty", "prompt")
    add_bos = _add_special_tokens(body)
    return [tokenizer.encode(p, add_bos=add_bos) for p in prompts]


def _add_special_tokens(body: Mapping) -> bool | None:
    """vLLM's `add_special_tokens`: whether to add BOS; unset, the tokenizer's own setting."""
    value = body.get("add_special_tokens")
    return None if value is None else _bool(body, "add_special_tokens", True)


def parse_tokenize(body: Mapping) -> tuple[str, bool | None]:
    """/tokenize's prompt and whether to add BOS (None: the tokenizer's own setting), checked
    as the completion fields of the same names are ("no" is not true)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", "prompt")
    return prompt, _add_special_tokens(body)


def parse_detokenize(body: Mapping) -> list[int]:
    """/detokenize's token ids: a list of ints, as a prompt's ids are (not floats, which int()
    would truncate, nor booleans)."""
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(is_integer(t) for t in tokens)):
        raise ApiError(400, f"tokens must be a list of token ids (ints), got {tokens!r:.80}",
                       "tokens")
    return [int(t) for t in tokens]


def parse_completion(body: Mapping, served: ServedModel, make_request: MakeRequest,
                     arrival_s: float) -> Job:
    n, stream, include_usage, continuous_usage = _check_common(body, served, "completion")
    max_tokens = _int(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) >= served.max_model_len and is_integer(prompt[0]):
        # Ids past the context, refused by their count before each is checked (25M ids: 36 s
        # of the event loop, every other client waiting).
        _context_check(len(prompt), max(max_tokens or 0, 1), served, "prompt")
    prompts = _prompts(body, served.tokenizer)
    structured, structured_param = structured_output(body)
    params = sampling_params(body, max_tokens, completion_logprobs(body), structured)
    for ids in prompts:
        _context_check(len(ids), max_tokens, served, "prompt")
    response_id = _response_id(body, "cmpl")
    requests = _requests(make_request, response_id, [dict(prompt_token_ids=p) for p in prompts],
                         params, n, arrival_s, "prompt", structured_param, stream)
    return Job("completion", response_id, served.name, int(time.time()), requests, n, stream,
               include_usage, _bool(body, "return_token_ids", False),
               served.token_piece if params.logprobs is not None else None,
               continuous_usage=continuous_usage, system_fingerprint=served.fingerprint)


# Message fields of an assistant turn that infer cannot render (tools are refused): an empty
# value, as OpenAI's SDK echoes back in a returned message, is no call.
_MESSAGE_CALLS = ("tool_calls", "function_call")


def chat_messages(messages: object) -> list[dict[str, str]]:
    """OpenAI messages as the chat template's: content a string, or a list of text parts
    joined (what `vllm bench serve --backend openai-chat` sends); any other part is refused.
    A participant's `name` goes to the template, as vLLM passes it; tool calls are refused."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with role system, user or "
                                f"assistant, got {m!r:.80}", "messages")
        try:
            content = join_text_parts(m.get("content"), f"messages[{i}].content")
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text "
                                f"parts, got {content!r:.80}", "messages")
        for field in _MESSAGE_CALLS:
            if m.get(field):
                raise ApiError(400, f"messages[{i}].{field}: tool and function calls are not "
                                    "supported", "messages")
        message = {"role": m["role"], "content": content}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ApiError(400, f"messages[{i}].name must be a string, got "
                                    f"{m['name']!r:.80}", "messages")
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_chat(body: Mapping, served: ServedModel, make_request: MakeRequest,
               arrival_s: float) -> Job:
    n, stream, include_usage, continuous_usage = _check_common(body, served, "chat")
    if not isinstance(body.get("messages"), list):
        raise ApiError(400, "messages is required: a list of {role, content}", "messages")
    messages = chat_messages(body["messages"])
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    try:
        text = served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        # The template refused these messages (its raise_exception: roles out of the order it
        # takes, say) or the model has none: the request's to change, a 400 as in vLLM, not
        # an internal error a client would retry.
        raise ApiError(400, str(e), "messages") from None
    # As LLM.chat does: the rendered template is the prompt, its special tokens the template's
    # own; vLLM's chat adds none unless add_special_tokens is true (and then no second BOS).
    prompt_ids = served.tokenizer.encode(text, add_bos=bool(_add_special_tokens(body)))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, name, None)
    if max_tokens is None:  # OpenAI's chat default: as long as the context allows
        max_tokens = served.max_model_len - len(prompt_ids)
        _context_check(len(prompt_ids), 1, served, "messages", None)
    structured, structured_param = structured_output(body)
    params = sampling_params(body, max_tokens, chat_logprobs(body), structured, name)
    _context_check(len(prompt_ids), max_tokens, served, "messages", name)
    response_id = _response_id(body, "chatcmpl")
    requests = _requests(make_request, response_id, [dict(prompt_token_ids=prompt_ids)],
                         params, n, arrival_s, "messages", structured_param, stream)
    return Job("chat", response_id, served.name, int(time.time()), requests, n, stream,
               include_usage, _bool(body, "return_token_ids", False),
               served.token_piece if params.logprobs is not None else None,
               continuous_usage=continuous_usage, system_fingerprint=served.fingerprint)


# -- responses -----------------------------------------------------------------------------

def usage(job: Job, outputs: Sequence[RequestOutput]) -> dict:
    prompt = job.num_prompt_tokens
    completion = sum(len(o.token_ids) for o in outputs)
    # Over the prompts counted once, as prompt_tokens is: each prompt's first choice.
    cached = sum(o.metrics.num_cached_tokens for o in outputs[::job.n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# What a -inf logprob (a token the model cannot emit) is reported as: JSON has no infinity.
# vLLM's value, so clients that sum or compare logprobs see what they see there.
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    # `>=` so that a NaN, never expected, is floored too instead of making the JSON invalid.
    return float(value) if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs_body(token_piece: Callable[[int], tuple[str, bytes]],
                             entries: Sequence[TokenLogprob],
                             cursor: LogprobCursor | None = None) -> dict:
    """Completions' logprobs of `entries`: each token's text, logprob, the top alternatives as
    {text: logprob} (OpenAI's legacy format: the chosen token is always among them, so up to
    k + 1) and each token's text offset, vLLM's: the summed lengths of the token texts before
    it, carried on from `cursor` (a character several tokens spell counts one U+FFFD each).
    Alternatives whose texts coincide (partial UTF-8 bytes all decode to U+FFFD) keep the
    likeliest."""
    cursor = LogprobCursor() if cursor is None else cursor
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = token_piece(entry.token_id)[0]
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(token_piece(token_id)[0], _logprob(logprob))
        top.setdefault(text, _logprob(entry.logprob))
        tokens.append(text)
        token_logprobs.append(_logprob(entry.logprob))
        tops.append(top)
        offsets.append(cursor.text_offset)
        cursor.text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_token(piece: tuple[str, bytes], logprob: float) -> dict:
    return {"token": piece[0], "logprob": _logprob(logprob), "bytes": list(piece[1])}


def chat_logprobs_body(token_piece: Callable[[int], tuple[str, bytes]],
                       entries: Sequence[TokenLogprob]) -> dict:
    """Chat's logprobs of `entries`: per token its text, logprob and own bytes (a character
    that several tokens spell: each its part, where each text is U+FFFD), and the top k
    alternatives alike."""
    return {"content": [
        _chat_token(token_piece(e.token_id), e.logprob)
        | {"top_logprobs": [_chat_token(token_piece(t), lp) for t, lp in e.top]}
        for e in entries]}


@dataclasses.dataclass
class LogprobCursor:
    """How far one choice's logprobs have gone: entries sent, and the text offset of the next
    token (completions count offsets over the whole choice)."""

    tokens: int = 0
    text_offset: int = 0


def _logprobs_of(job: Job, out: RequestOutput, cursor: LogprobCursor | None = None
                 ) -> dict | None:
    """The logprobs of `out`'s tokens past `cursor` (all of them without one), advancing it.

    They cover every token of `token_ids`, as the engine reports them, also when a stop string
    cut the text short of the last tokens (as vLLM reports the logprobs of generated tokens):
    lengths then agree with token_ids and usage, not with the text."""
    if job.token_piece is None:
        return None
    entries = out.logprobs or []
    cursor = LogprobCursor() if cursor is None else cursor
    new = entries[cursor.tokens:]
    cursor.tokens = len(entries)
    if job.kind == "chat":
        return chat_logprobs_body(job.token_piece, new)
    return completion_logprobs_body(job.token_piece, new, cursor)


def _choice(job: Job, index: int, out: RequestOutput, logprobs: dict | None) -> dict:
    """A choice's fields other than its text; the finish reason once it has finished (a
    FinishReason's value is OpenAI's string)."""
    choice: dict = {"index": index, "logprobs": logprobs,
                    "finish_reason": out.finish_reason.value if out.finished else None,
                    "stop_reason": out.stop_reason if out.finished else None, "seed": out.seed}
    if job.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
        choice["prompt_token_ids"] = list(out.prompt_token_ids)
    return choice


def _object(job: Job, chunk: bool) -> str:
    if job.kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def response(job: Job, outputs: Sequence[RequestOutput]) -> dict:
    """The whole non-streamed answer, once every choice has finished."""
    return {"id": job.response_id, "object": _object(job, False), "created": job.created,
            "model": job.model, "system_fingerprint": job.system_fingerprint,
            "choices": [_choice(job, i, o, _logprobs_of(job, o))
                        | ({"message": {"role": "assistant", "content": o.text}}
                           if job.kind == "chat" else {"text": o.text})
                        for i, o in enumerate(outputs)],
            "usage": usage(job, outputs)}


def chunk(job: Job, index: int, out: RequestOutput, delta: str, first: bool,
          cursor: LogprobCursor | None = None) -> dict:
    """One stream event of one choice: its new text since the last event (possibly "" when a
    token ends inside a UTF-8 character). A chat stream's first delta names the role. With
    logprobs, the event carries those of the tokens past `cursor` (one per choice, advanced
    here; None: all so far), in the endpoint's format, so that the events' lists concatenate
    to the whole answer's."""
    choice = _choice(job, index, out, _logprobs_of(job, out, cursor))
    if job.kind == "chat":
        choice["delta"] = ({"role": "assistant", "content": delta} if first
                           else {"content": delta} if delta or not out.finished else {})
    else:
        choice["text"] = delta
    event = {"id": job.response_id, "object": _object(job, True), "created": job.created,
             "model": job.model, "system_fingerprint": job.system_fingerprint,
             "choices": [choice]}
    if job.continuous_usage:  # this choice's, as vLLM counts them
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        event["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}
    return event


def usage_chunk(job: Job, outputs: Sequence[RequestOutput]) -> dict:
    return {"id": job.response_id, "object": _object(job, True), "created": job.created,
            "model": job.model, "system_fingerprint": job.system_fingerprint, "choices": [],
            "usage": usage(job, outputs)}
