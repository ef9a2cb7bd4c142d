"""The engine thread: the only code that touches the engine. HTTP handlers reach it through a
queue of commands; each engine step's outputs go back to the event loop in one call.

  event loop                              engine thread
  submit(requests, sink) ── inbox ──►     engine.submit(...)           (between steps)
                                          engine.step()
  sink(outputs of this step) ◄── one call_soon_threadsafe per step
  abort(ids) ── inbox ──►                 engine.abort(id): its pages are freed

XLA runs outside the GIL, so the event loop keeps answering while a step runs on the device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Callable, Sequence

from infer.engine.engine import Engine
from infer.engine.request import Request, RequestOutput
from infer.parallel.replicas import ReplicatedEngine
from infer.serve.metrics import ServerMetrics

log = logging.getLogger("infer")

Sink = Callable[[list[RequestOutput]], None]  # called on the event loop's thread


@dataclasses.dataclass(frozen=True)
class _Submit:
    requests: Sequence[Request]
    sink: Sink


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_ids: Sequence[str]
    sink: Sink  # only requests delivering to it are aborted: an id may be another job's


def replicas_of(engine: Engine | ReplicatedEngine) -> list[Engine]:
    """The engines doing the work: a data-parallel front's replicas, or the engine itself."""
    return engine.replicas if isinstance(engine, ReplicatedEngine) else [engine]


class EngineDied(RuntimeError):
    """The engine thread stopped on an error: every request in flight gets this."""


class EngineWorker:
    """Owns `engine` on its own thread: warms it up, then steps it while it has work and
    blocks on its inbox while it has none."""

    def __init__(self, engine: Engine | ReplicatedEngine, metrics: ServerMetrics,
                 warmup: bool = True) -> None:
        self.engine = engine
        self.metrics = metrics
        self.warmup = warmup
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Orders submits against the thread's death: a submit either sees `error` or is in
        # the inbox by the time the dying thread empties it (and answers it with the error).
        self._submit_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sinks: dict[str, Sink] = {}  # live request id -> where its outputs go
        self._submitting: Sink | None = None  # the job between the inbox and `_sinks`
        self._stopping = False
        self.replicas = replicas_of(engine)

    # -- the event loop's side ----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, requests: Sequence[Request], sink: Sink) -> None:
        with self._submit_lock:
            if self.error is not None:
                raise EngineDied(f"the engine stopped: {self.error!r}")
            self._inbox.put(_Submit(list(requests), sink))

    def abort(self, request_ids: Sequence[str], sink: Sink) -> None:
        """Aborts those of `request_ids` that deliver to `sink`: a job refused for a duplicate
        id never aborts the request that holds the id."""
        self._inbox.put(_Abort(list(request_ids), sink))

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.warmup:
                start = time.perf_counter()
                programs = self.engine.warmup()
                log.info("warm-up: %d programs in %.1f s", programs,
                         time.perf_counter() - start)
            self.metrics.warmed_up()
            self.ready.set()
            while not self._stopping:
                # Wait for commands while no step would compute anything (a static batch
                # filling up waits out its deadline here, not in idle steps).
                self._take_commands(timeout=self.engine.seconds_until_work())
                if self.engine.seconds_until_work() == 0:
                    self._step()
        except BaseException as e:  # noqa: B902 - every waiting client must hear of it
            log.exception("the engine thread stopped")
            with self._submit_lock:
                self.error = e
            self._fail_all(e)
        finally:
            for replica in self.replicas:  # a stopped server frees every request's pages
                for request_id in list(replica.scheduler.seqs):
                    self._abort(replica, request_id)
            self.metrics.engine_state(self.replicas)  # /metrics outlives the thread

    def _take_commands(self, timeout: float) -> None:
        """Runs the commands queued, waiting up to `timeout` seconds (inf: for ever) for the
        first."""
        while True:
            try:
                if timeout <= 0:
                    command = self._inbox.get(block=False)
                else:
                    command = self._inbox.get(timeout=None if math.isinf(timeout) else timeout)
            except queue.Empty:
                return
            timeout = 0.0
            if command is None:
                self._stopping = True
                return
            if isinstance(command, _Submit):
                self._submit(command)
            else:
                for request_id in command.request_ids:
                    if self._sinks.get(request_id) == command.sink:  # bound methods: ==
                        del self._sinks[request_id]
                        self._abort(self.engine, request_id)
                self.metrics.engine_state(self.replicas)  # an abort frees without a step

    def _abort(self, engine: Engine | ReplicatedEngine, request_id: str) -> None:
        """Aborts the request, counted as ended in the metrics when it was still live."""
        out = engine.abort(request_id)
        if out is not None:
            self.metrics.finished(out)

    def _submit(self, command: _Submit) -> None:
        taken: list[str] = []
        # Out of the inbox, not yet in `_sinks`: were the engine to fail here, `_fail_all`
        # would otherwise tell every job but this one.
        self._submitting = command.sink
        try:
            for request in command.requests:
                self.engine.submit(request)
                taken.append(request.request_id)
        except ValueError as e:  # a duplicate id: undo the job's other choices
            for request_id in taken:
                self.engine.abort(request_id)
            self._deliver(command.sink, e)
        else:
            for request_id in taken:
                self._sinks[request_id] = command.sink
        self._submitting = None

    def _step(self) -> None:
        since = [r.num_steps for r in self.replicas]
        outputs = self.engine.step()
        for replica, first in zip(self.replicas, since):
            self.metrics.steps(replica.step_records(first))
        self.metrics.engine_state(self.replicas)
        by_sink: dict[int, tuple[Sink, list[RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
                self.metrics.finished(out)
            by_sink.setdefault(id(sink), (sink, []))[1].append(out)
        if by_sink:
            self._loop.call_soon_threadsafe(_deliver_all, list(by_sink.values()))

    def _deliver(self, sink: Sink, item: list[RequestOutput] | BaseException) -> None:
        self._loop.call_soon_threadsafe(_deliver_all, [(sink, item)])

    def _fail_all(self, error: BaseException) -> None:
        """Every job still waiting hears of `error`: those with requests in the engine, and
        those whose submit sits in the inbox, queued while the step that failed ran (no more
        can come: `submit` sees `error` now)."""
        sinks = {id(s): s for s in self._sinks.values()}
        if self._submitting is not None:
            sinks[id(self._submitting)] = self._submitting
        self._sinks.clear()
        while True:
            try:
                command = self._inbox.get(block=False)
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                sinks[id(command.sink)] = command.sink
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(
                _deliver_all, [(s, EngineDied(f"the engine stopped: {error!r}"))
                               for s in sinks.values()])


def _deliver_all(items: list[tuple[Sink, list[RequestOutput] | BaseException]]) -> None:
    for sink, outputs in items:
        sink(outputs)
