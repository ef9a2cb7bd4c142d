"""Data parallelism as engine replicas: one `Engine` per device group, each with its own
scheduler, page allocator and KV cache, behind one front with the engine's request API.

A request goes to one replica for its whole life (its KV lives there): the least loaded one
(fewest unfinished requests, ties to the lowest index), or with `routing="prefix"`, among the
replicas with a free slot, the one whose prefix cache holds the most of its prompt, load
breaking ties. Under the static policy a request first joins the fullest batch still forming.
Ids are the front's, so they are unique across replicas. `step()` steps every replica that has
work and returns their outputs together; `LLM.generate` puts them back in prompt order.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Sequence

from infer.engine.engine import Callback, Engine, check_request_id
from infer.engine.request import Request, RequestIds, RequestOutput
from infer.parallel.flags import check_routing
from infer.sampling_params import SamplingParams
from infer.spec.stats import SpeculationStats


class ReplicatedEngine:
    def __init__(self, replicas: Sequence[Engine], routing: str = "least_loaded") -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one engine replica")
        check_routing(routing, replicas[0].prefix_cache is not None)
        self.replicas = list(replicas)
        self.routing = routing
        self.config = replicas[0].config
        self.tokenizer = replicas[0].tokenizer
        self._home: dict[str, Engine] = {}  # live request id -> the replica serving it
        # Finished ones, as many as a replica keeps the outputs of.
        self._done: collections.OrderedDict[str, Engine] = collections.OrderedDict()
        self._ids = RequestIds()

    def make_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                     prompt_token_ids: Sequence[int] | None = None,
                     request_id: str | None = None,
                     arrival_s: float | None = None) -> Request:
        """A validated request (every replica has the same limits), with a front-wide id."""
        if request_id is None:
            request_id = self._ids.fresh(lambda i: i in self._home or i in self._done)
        return self.replicas[0].make_request(prompt, params, prompt_token_ids=prompt_token_ids,
                                             request_id=request_id, arrival_s=arrival_s)

    def route(self, request: Request) -> int:
        """The index of the replica `request` would go to now."""
        order = range(len(self.replicas))
        load = [len(r.scheduler.seqs) for r in self.replicas]
        slots = self.config.max_num_seqs
        if self.config.scheduler == "static":
            # A static replica starts a batch when it is full (or its oldest request has waited
            # static_max_wait_s): spread over replicas, requests wait for batches that one
            # replica's would have filled. Join the fullest batch still forming.
            waiting = [len(r.scheduler.waiting) for r in self.replicas]
            forming = [i for i in order if 0 < waiting[i] < slots]
            if forming:
                return min(forming, key=lambda i: (-waiting[i], load[i], i))
        if self.routing == "prefix":
            # The cache holder while it has a free slot: with every request sharing a prefix
            # (a chat template's), the first replica to cache it would otherwise take them all.
            free = [i for i in order if load[i] < slots] or list(order)
            ids = request.prompt_token_ids[:-1]  # as the scheduler matches them
            return min(free, key=lambda i: (-self.replicas[i].prefix_cache.cached_tokens(ids),
                                            load[i], i))
        return min(order, key=lambda i: (load[i], i))

    def submit(self, request: Request, callback: Callback | None = None) -> str:
        if request.request_id in self._home:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        replica = self.replicas[self.route(request)]
        replica.submit(request, callback)
        self._home[request.request_id] = replica
        self._done.pop(request.request_id, None)
        return request.request_id

    # make_request, then submit: the engine's own, over the front's two.
    add_request = Engine.add_request

    def abort(self, request_id: str) -> RequestOutput | None:
        check_request_id(request_id)
        replica = self._home.get(request_id)
        if replica is None:
            return None
        out = replica.abort(request_id)
        self._retire(request_id)
        return out

    def output(self, request_id: str) -> RequestOutput:
        replica = self._home.get(request_id) or self._done.get(request_id)
        if replica is None:
            raise KeyError(f"request {request_id!r} is unknown, or finished long ago")
        return replica.output(request_id)

    def _retire(self, request_id: str) -> None:
        replica = self._home.pop(request_id, None)
        if replica is not None:
            self._done[request_id] = replica
            while len(self._done) > self.config.max_finished_outputs:
                self._done.popitem(last=False)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def seconds_until_work(self) -> float:
        return min(r.seconds_until_work() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work; their outputs, replica by replica. When a
        replica's step raises, the requests the replicas before it finished in this call are
        still retired (their ids free, their outputs kept), as one engine's would be."""
        outputs = []
        try:
            for replica in self.replicas:
                if replica.has_unfinished():
                    outputs += replica.step()
        finally:
            for out in outputs:
                if out.finished:
                    self._retire(out.request_id)
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every queued request has finished, yielding outputs as tokens arrive."""
        for replica in self.replicas:
            replica.scheduler.draining = True
        try:
            while self.has_unfinished():
                yield from self.step()
        finally:  # as Engine.stream: the drain lasts this call only
            for replica in self.replicas:
                replica.scheduler.draining = False

    def run_until_done(self) -> None:
        for _ in self.stream():
            pass

    def warmup(self, progress: bool = False) -> int:
        return sum(r.warmup(progress) for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Every replica's (`Engine.reset_prefix_cache`): True when all are left empty."""
        return all([r.reset_prefix_cache() for r in self.replicas])

    def prefix_cache_stats(self) -> list[dict[str, float]]:
        """Each replica's prefix-cache stats."""
        return [r.prefix_cache_stats() for r in self.replicas]

    def speculative_stats(self) -> dict[str, float]:
        """`Engine.speculative_stats` over every replica's verify steps ({} without
        speculation): counts summed, rates of the sums."""
        if self.replicas[0].runner.proposer is None:
            return {}
        counts = [r.runner.spec_stats for r in self.replicas]
        return SpeculationStats(**{f.name: sum(getattr(c, f.name) for c in counts)
                                   for f in dataclasses.fields(SpeculationStats)}).summary()
