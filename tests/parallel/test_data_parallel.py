"""Data parallelism as engine replicas behind one front (`infer.parallel.replicas`), on virtual
CPU devices: routing, ids, outputs in prompt order, and one device's tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.llm import LLM
from infer.model.llama import Llama
from infer.parallel.replicas import ReplicatedEngine
from infer.sampling_params import SamplingParams
from tests.parallel.test_tensor_parallel import ENGINE, GROUPED, _prompts, _sampled


@pytest.fixture(scope="module")
def grouped() -> Llama:
    return Llama(GROUPED, jnp.float32, nnx.Rngs(5))


@pytest.mark.parametrize("parallel", [dict(data_parallel_size=2),
                                      dict(tensor_parallel_size=3, data_parallel_size=2)])
def test_replicas_give_one_device_tokens_in_prompt_order(grouped, parallel):
    prompts = _prompts(7, n=7)
    expected = _sampled(LLM.from_loaded(GROUPED, grouped, None, **ENGINE), prompts)
    llm = LLM.from_loaded(GROUPED, grouped, None, **ENGINE, **parallel)
    assert isinstance(llm.engine, ReplicatedEngine)
    devices = [set(r.runner.device_steps.params[0].devices()) for r in llm.engine.replicas]
    assert not devices[0] & devices[1]  # each replica on its own device group
    assert _sampled(llm, prompts) == expected


@pytest.mark.parametrize("method", ["self_draft", "ngram"])
def test_replicas_speculate_as_one_device(grouped, method):
    """Each replica's weights sit on one device, each weight with its own spec over that
    device's one-device mesh: a model-based proposer goes beside them. Seeded draws (which
    depend on the drafts verified) equal one engine's with the same proposer. The proposer once
    counted the weights' shardings rather than their devices and refused the replicas."""
    spec = {"method": method, "num_tokens": 2, "self_draft_layers": 1}
    prompts = _prompts(3, n=5)
    expected = _sampled(LLM.from_loaded(GROUPED, grouped, None, **ENGINE, speculative=spec),
                        prompts)
    llm = LLM.from_loaded(GROUPED, grouped, None, **ENGINE, speculative=spec,
                          data_parallel_size=2)
    assert _sampled(llm, prompts) == expected
    parts = [r.speculative_stats() for r in llm.engine.replicas]
    assert all(p["proposed"] > 0 for p in parts)
    whole = llm.engine.speculative_stats()  # the front's: every replica's verify steps
    for count in ("verify_steps", "rows", "proposed", "accepted"):
        assert whole[count] == sum(p[count] for p in parts)
    assert whole["acceptance_rate"] == whole["accepted"] / whole["proposed"]


def test_least_loaded_routing_spreads_requests(grouped):
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=3, **ENGINE)
    front = llm.engine
    ids = [front.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=2))
           for p in _prompts(3, n=7)]
    assert len(set(ids)) == 7  # the front's ids, unique across replicas
    assert sorted(len(r.scheduler.seqs) for r in front.replicas) == [2, 2, 3]
    aborted = front.abort(ids[0])
    assert aborted is not None and aborted.finished
    assert front.output(ids[0]).finished
    front.run_until_done()
    assert all(front.output(i).finished for i in ids)


def test_prefix_routing_follows_the_cached_prefix(grouped):
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2,
                          enable_prefix_caching=True, dp_routing="prefix", **ENGINE)
    front, rng = llm.engine, np.random.default_rng(11)
    shared = rng.integers(0, GROUPED.vocab_size, 40).tolist()
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=0)
    front.add_request(prompt_token_ids=shared + [1, 2], params=sp)
    front.run_until_done()  # replica 0 now caches the shared prefix
    busy = front.add_request(prompt_token_ids=[5, 6, 7], params=sp)  # replica 0 busier
    assert busy in front.replicas[0].scheduler.seqs
    follower = front.make_request(prompt_token_ids=shared + [3], params=sp)
    assert front.route(follower) == 0  # least loaded would say 1
    front.submit(follower)
    front.run_until_done()
    one = LLM.from_loaded(GROUPED, grouped, None, **ENGINE)
    assert front.output(follower.request_id).token_ids == _sampled(one, [shared + [3]], 3)[0]
    # Every replica's cache emptied, not the first one's alone; routing then has no prefix.
    for _ in range(2):  # fresh prompts, queued together: one per replica
        front.add_request(prompt_token_ids=rng.integers(0, GROUPED.vocab_size, 20).tolist(),
                          params=sp)
    front.run_until_done()
    assert all(len(r.prefix_cache) for r in front.replicas)
    assert llm.reset_prefix_cache()
    assert not any(len(r.prefix_cache) for r in front.replicas)
    assert all(r.prefix_cache.cached_tokens(shared) == 0 for r in front.replicas)


@pytest.mark.parametrize("seed", range(3))
def test_prefix_routing_never_queues_on_a_full_replica_while_one_has_room(grouped, seed):
    """Random requests, most sharing a cached prefix (as a chat template's): a request goes to
    a full replica only when every replica is full, and to the replica caching most of its
    prompt among those with room. Before, the cache holder took every request sharing it."""
    rng = np.random.default_rng(seed)
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=3,
                          enable_prefix_caching=True, dp_routing="prefix", **ENGINE)
    front = llm.engine
    slots = front.config.max_num_seqs
    shared = rng.integers(0, GROUPED.vocab_size, 33).tolist()
    sp = SamplingParams(max_tokens=2, temperature=1.0, seed=0)
    front.add_request(prompt_token_ids=shared + [1], params=sp)
    front.run_until_done()  # one replica caches the shared prefix
    for _ in range(int(rng.integers(2 * slots, 4 * slots))):
        tail = rng.integers(0, GROUPED.vocab_size, int(rng.integers(1, 4))).tolist()
        prompt = (shared if rng.random() < 0.8 else []) + tail
        request = front.make_request(prompt_token_ids=prompt, params=sp)
        loads = [len(r.scheduler.seqs) for r in front.replicas]
        cached = [r.prefix_cache.cached_tokens(prompt[:-1]) for r in front.replicas]
        chosen = front.route(request)
        room = [i for i in range(3) if loads[i] < slots]
        if room:
            assert chosen in room, (loads, chosen)
            assert cached[chosen] == max(cached[i] for i in room)
        front.submit(request)
    front.run_until_done()


def test_static_replicas_fill_one_batch_at_a_time(grouped):
    """Under the static policy a replica starts a batch when it is full: four requests for
    batches of four start at once on one replica, where spread two and two neither would."""
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, scheduler="static",
                          **ENGINE)
    front = llm.engine
    sp = SamplingParams(max_tokens=2)
    for prompt in _prompts(5, n=ENGINE["max_num_seqs"] + 1):
        front.add_request(prompt_token_ids=prompt, params=sp)
    assert [len(r.scheduler.waiting) for r in front.replicas] == [4, 1]
    assert front.seconds_until_work() == 0.0
    front.run_until_done()


@pytest.mark.parametrize("how", ["raises", "aborts"])
def test_a_request_aborted_by_its_callback_leaves_the_front(grouped, how: str):
    """A replica aborts a request whose stream callback raised, or the callback aborts it
    itself; the front sees it end too: its id is free again and the front holds nothing
    unfinished. (A callback's own abort came back from step() unfinished, so the front kept
    the id in use.)"""
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, **ENGINE)
    front = llm.engine

    def bad(out) -> None:
        if how == "raises":
            raise RuntimeError("consumer bug")
        if len(out.token_ids) == 2 and not out.finished:
            front.abort(out.request_id)

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rng = np.random.default_rng()
    for request_id in ("x", "y"):
        front.add_request(prompt_token_ids=rng.integers(3, 100, 5).tolist(), params=params,
                          request_id=request_id, callback=bad)
    ends = [out for out in front.stream() if out.finished]
    assert sorted(o.request_id for o in ends) == ["x", "y"]
    assert {o.finish_reason.value for o in ends} == {"abort"}
    assert not front.has_unfinished()
    front.add_request(prompt_token_ids=[5, 6, 7], params=params, request_id="x")  # reusable
    front.run_until_done()
    assert front.output("x").finish_reason.value == "length"


def test_a_failing_replica_leaves_the_others_finished_requests_retired(grouped, monkeypatch):
    """Replica 0 finishes "a" in the front step in which replica 1's step raises: "a" was
    left live in the front, its id refused for good, its output only reachable there."""
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, **ENGINE)
    front = llm.engine
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    front.add_request(prompt_token_ids=[1, 2, 3], params=one, request_id="a")  # replica 0
    front.add_request(prompt_token_ids=[4, 5, 6], params=one, request_id="b")  # replica 1

    def failing() -> list:
        raise RuntimeError("replica 1: device error")

    monkeypatch.setattr(front.replicas[1], "step", failing)
    with pytest.raises(RuntimeError, match="device error"):
        front.step()
    monkeypatch.undo()
    assert front.output("a").finished and len(front.output("a").token_ids) == 1
    front.run_until_done()
    front.add_request(prompt_token_ids=[7, 8], params=one, request_id="a")  # free again
    front.run_until_done()
    assert not front.has_unfinished() and front.output("b").finished


def test_front_rejects_bad_configurations(grouped):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, dp_routing="prefix",
                        **ENGINE)
    with pytest.raises(ValueError, match="routing must be one of"):
        LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, dp_routing="random",
                        **ENGINE)


def test_front_numbered_ids_skip_the_ids_callers_chose(grouped):
    """The front numbers requests across replicas; a number a caller took (live, or finished
    with its output kept) is never handed out again."""
    llm = LLM.from_loaded(GROUPED, grouped, None, data_parallel_size=2, **ENGINE)
    front, rng = llm.engine, np.random.default_rng()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(4):
        chosen = {str(front._ids.next_number + int(k)) for k in rng.integers(0, 6, 3)}
        for i in chosen:
            front.add_request(prompt_token_ids=[1, 2], params=params, request_id=i)
        if rng.random() < 0.5:
            front.run_until_done()
        fresh = [front.add_request(prompt_token_ids=[3], params=params)
                 for _ in range(int(rng.integers(1, 6)))]
        assert len(set(fresh)) == len(fresh) and not set(fresh) & chosen
        front.run_until_done()
        for i in chosen:
            assert front.output(i).prompt_token_ids == [1, 2]
