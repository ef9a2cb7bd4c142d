"""The OpenAI-compatible HTTP surface (Starlette): routes, JSON in and out, Server-Sent Events,
and client disconnects turned into aborts. Request bodies are checked in `protocol`, the engine
is stepped by `worker`'s thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import time
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import jax
from flax import nnx

from infer.engine.engine import Engine
from infer.engine.request import RequestOutput
from infer.parallel.replicas import ReplicatedEngine
from infer.platform import git_revision
from infer.serve import protocol
from infer.serve.metrics import CONTENT_TYPE, ServerMetrics
from infer.serve.protocol import ApiError, Job, ServedModel
from infer.serve.worker import EngineDied, EngineWorker, replicas_of

log = logging.getLogger("infer")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.envelope(), status_code=error.status)


class Server:
    """One engine behind the OpenAI API. `app` is the ASGI application."""

    def __init__(self, engine: Engine | ReplicatedEngine, served: ServedModel,
                 warmup: bool = True) -> None:
        if any(r.config.scheduler == "static" and r.config.static_max_wait_s == float("inf")
               for r in replicas_of(engine)):
            raise ValueError("a server never knows that no more requests will come: the static "
                             "scheduler needs a finite static_max_wait_s")
        self.served = (served if served.fingerprint is not None else
                       dataclasses.replace(served, fingerprint=system_fingerprint(engine)))
        self.engine = engine
        self.metrics = ServerMetrics(served.name)
        self.worker = EngineWorker(engine, self.metrics, warmup=warmup)
        # Request ids of the jobs being answered, checked here so that a clash is a 400 before
        # a stream's 200 goes out (the engine thread would refuse it only later).
        self._live_ids: set[str] = set()
        routes = [
            Route("/health", self.health), Route("/v1/health", self.health),
            Route("/v1/models", self.models), Route("/v1/models/{model_id:path}", self.model),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/metrics", self.prometheus),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers={
            HTTPException: self._http_error, ApiError: self._api_error,
            ClientDisconnect: self._client_gone, Exception: self._internal_error})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        with self.metrics:
            self.worker.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                await asyncio.to_thread(self.worker.stop)

    # -- errors --------------------------------------------------------------------------------

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> JSONResponse:
        status = exc.status_code if exc.status_code in ApiError.TYPES else 400
        if exc.status_code == 404:
            return error_response(ApiError(404, f"no route {request.url.path}"))
        return JSONResponse(ApiError(status, str(exc.detail)).envelope(),
                            status_code=exc.status_code)

    async def _api_error(self, request: HttpRequest, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def _client_gone(self, request: HttpRequest, exc: ClientDisconnect) -> Response:
        # Gone while sending its body: nothing was queued, and no one is listening.
        log.debug("client left %s before its body arrived", request.url.path)
        return Response(status_code=499)

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path)
        return error_response(ApiError(500, f"internal error: {exc!r}"))

    # -- small routes --------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        if self.worker.error is not None:
            raise ApiError(503, f"the engine stopped: {self.worker.error!r}")
        if not self.worker.ready.is_set():
            raise ApiError(503, "warming up: compiling the engine's programs")
        return JSONResponse({"status": "ok"})

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.served.card()]})

    async def model(self, request: HttpRequest) -> Response:
        if request.path_params["model_id"] != self.served.name:
            raise ApiError(404, f"The model `{request.path_params['model_id']}` does not exist.",
                           "model")
        return JSONResponse(self.served.card())

    async def prometheus(self, request: HttpRequest) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def version(self, request: HttpRequest) -> Response:
        return JSONResponse({"version": git_revision()})

    async def tokenize(self, request: HttpRequest) -> Response:
        prompt, add_bos = protocol.parse_tokenize(await _json_body(request))
        tokens = self.served.tokenizer.encode(prompt, add_bos=add_bos)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": self.served.max_model_len})

    async def detokenize(self, request: HttpRequest) -> Response:
        tokens = protocol.parse_detokenize(await _json_body(request))
        try:
            text = self.served.tokenizer.decode(tokens)
        except ValueError as e:  # an id outside the vocabulary
            raise ApiError(400, f"tokens: {e}", "tokens") from None
        return JSONResponse({"prompt": text})

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, protocol.parse_completion)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, protocol.parse_chat)

    async def _generate(self, request: HttpRequest, parse) -> Response:
        arrival_s = time.perf_counter()  # server-side TTFT includes the inbox wait
        if not self.worker.ready.is_set() or self.worker.error is not None:
            raise ApiError(503, "the engine is not ready")
        body = await _json_body(request)
        header_id = request.headers.get("x-request-id")
        if header_id and "request_id" not in body:
            body = {**body, "request_id": header_id}
        job = parse(body, self.served, self.engine.make_request, arrival_s)
        ids = [r.request_id for r in job.requests]
        if any(i in self._live_ids for i in ids):
            # The client's id, not the per-choice ids made from it (`{id}-{prompt}.{choice}`).
            raise ApiError(400, f"request id {job.response_id!r} is already in use",
                           "request_id")
        stream = _JobStream(job)
        self._live_ids.update(ids)
        try:
            self.worker.submit(job.requests, stream.put)
        except EngineDied as e:
            self._live_ids.difference_update(ids)
            raise ApiError(503, str(e)) from None
        if job.stream:
            return StreamingResponse(self._events(job, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._whole(job, stream, request)
        finally:
            self._live_ids.difference_update(ids)

    async def _whole(self, job: Job, stream: "_JobStream", request: HttpRequest) -> Response:
        """Waits for every choice; a client that goes away aborts them."""
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            while not stream.done:
                got = asyncio.ensure_future(stream.next())
                await asyncio.wait({got, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return Response(status_code=499)  # nobody is listening
                stream.raise_error(got.result())
        finally:
            disconnect.cancel()
            if not stream.done:
                self.worker.abort([r.request_id for r in job.requests], stream.put)
        return JSONResponse(protocol.response(job, stream.finals()))

    async def _events(self, job: Job, stream: "_JobStream") -> AsyncIterator[str]:
        """One event per choice per engine step that gave it tokens; usage; [DONE]. If the
        client disconnects, Starlette cancels this generator and the finally aborts."""
        sent = [""] * len(job.requests)
        cursors = [protocol.LogprobCursor() for _ in job.requests]
        try:
            while not stream.done:
                item = await stream.next()
                if isinstance(item, BaseException):
                    yield _sse({"error": _api_error_of(item).envelope()["error"]})
                    break
                for out in item:
                    i = stream.index[out.request_id]
                    text = out.text
                    if not text.startswith(sent[i]):  # never happens; a stream cannot unsay
                        log.warning("request %s: its text changed under the stream",
                                    out.request_id)
                        text = sent[i]
                    yield _sse(protocol.chunk(job, i, out, text[len(sent[i]):],
                                              first=stream.first_event(i), cursor=cursors[i]))
                    sent[i] = text
            else:
                if job.include_usage:
                    yield _sse(protocol.usage_chunk(job, stream.finals()))
            yield "data: [DONE]\n\n"
        finally:
            if not stream.done:
                self.worker.abort([r.request_id for r in job.requests], stream.put)
            self._live_ids.difference_update(r.request_id for r in job.requests)


class _JobStream:
    """The outputs of one job's requests, as the engine thread delivers them."""

    def __init__(self, job: Job) -> None:
        self.index = {r.request_id: i for i, r in enumerate(job.requests)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._final: dict[int, RequestOutput] = {}
        self._started: set[int] = set()
        self.failed = False  # an error was read: none of the job's requests runs any more

    def put(self, item: list[RequestOutput] | BaseException) -> None:
        if not isinstance(item, BaseException):
            for out in item:
                if out.finished:
                    self._final[self.index[out.request_id]] = out
        self._queue.put_nowait(item)

    async def next(self) -> list[RequestOutput] | BaseException:
        item = await self._queue.get()
        self.failed |= isinstance(item, BaseException)
        return item

    @property
    def done(self) -> bool:
        """Every choice's final output, or an error, has been read. (An error counted when it
        arrived, not when read, ended a stream that failed mid-way as if it were whole.)"""
        return self.failed or len(self._final) == len(self.index) and self._queue.empty()

    def finals(self) -> list[RequestOutput]:
        return [self._final[i] for i in range(len(self.index))]

    def first_event(self, i: int) -> bool:
        first = i not in self._started
        self._started.add(i)
        return first

    @staticmethod
    def raise_error(item: list[RequestOutput] | BaseException) -> None:
        if isinstance(item, BaseException):
            raise _api_error_of(item)


def _api_error_of(error: BaseException) -> ApiError:
    """What the engine thread delivered instead of outputs, as the client hears it."""
    if isinstance(error, ValueError):  # the engine refused the job (a duplicate id)
        return ApiError(400, str(error), "request_id")
    return ApiError(500, str(error))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _json_body(request: HttpRequest) -> dict:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(400, f"the body must be application/json, got {kind or 'no type'!r}")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: both
        raise ApiError(400, f"the body is not valid JSON (or nested too deeply): {e!r:.200}"
                       ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # JSON may escape half of a surrogate pair ("\ud800"): valid JSON, no Unicode text. The
    # tokenizer then raised TypeError and a 404's rendering UnicodeEncodeError (500s), so it is
    # refused here; only a body with such an escape at all is walked.
    if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
        raise ApiError(400, "the body holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF "
                            "without its pair), which is not Unicode text")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _holds_lone_surrogate(value: object) -> bool:
    """Whether any string in the decoded JSON `value` (keys included) is not valid Unicode."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def _disconnected(request: HttpRequest) -> None:
    """Returns once the client has gone (the body is read already, so receive() waits)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def system_fingerprint(engine: Engine | ReplicatedEngine) -> str:
    """OpenAI's `system_fingerprint`: "infer-<commit>-<digest>", the digest over what decides
    the outputs besides the request, each replica's engine config (KV format, scheduler,
    speculation...), model config, weight dtypes and the devices its weights span. Equal
    fingerprints and a seed: the same tokens."""
    described = []
    for replica in replicas_of(engine):
        weights = jax.tree.leaves(nnx.state(replica.model))
        devices = max((len(w.sharding.device_set) for w in weights if isinstance(w, jax.Array)),
                      default=1)
        described.append((replica.config, replica.model_config,
                          sorted({str(w.dtype) for w in weights}), devices))
    digest = hashlib.sha256(repr(described).encode()).hexdigest()[:12]
    return f"infer-{git_revision()}-{digest}"
