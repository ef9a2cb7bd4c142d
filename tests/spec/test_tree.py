"""EAGLE tree and chain speculation: greedy output equals plain greedy decoding, sampled output
honours the request's top-k, and the caches after a step are what plain passes over the
accepted tokens write.

"Plain greedy" is checked by one teacher-forced pass (every generated token is the target's
argmax after the tokens before it), which compiles one program per model where a decoding
loop compiles two: the compiles are most of this file's time. The tests share speculators
through a module fixture, each compiled once (nothing is cached per process)."""

from __future__ import annotations

import collections
import dataclasses
import gc
import types
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.device_steps import DeviceSteps
from infer.engine.simple_loop import generate
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams, StructuredOutput
from infer.spec.eagle_head import EagleHead, from_eagle1
from infer.spec.tree import TreeSpeculator, eagle_generate, tree_generate
from infer.spec.tree_draft import TreeShape, full_tree, select_nodes
from infer.spec.verify import tree_structure
from tests.spec.joint_law import chi_square_pvalue, exact_joint
from tests.spec.oracle import oracle_models

CONFIG = get_config("tiny")


@pytest.fixture(scope="module")
def tiny() -> tuple[Llama, EagleHead]:
    """A random target and head. Small embeddings: with the tied head, random layers otherwise
    leave each token's own embedding dominant and greedy text repeats one token."""
    target = Llama(CONFIG, jnp.float32, nnx.Rngs(0))
    target.embed.set_value(target.embed.get_value() * 0.05)
    return target, EagleHead(CONFIG, jnp.float32, nnx.Rngs(1))


@pytest.fixture(scope="module")
def oracle() -> tuple[Llama, EagleHead]:
    """A head that agrees with its target (`tests.spec.oracle`), so that most drafts are
    accepted and every part of a step (deep paths, compaction, the head's catch-up) runs."""
    return oracle_models(CONFIG)


@pytest.fixture(scope="module")
def device_steps(tiny, oracle) -> Callable[[str], DeviceSteps]:
    """device_steps(models): one DeviceSteps per target, shared by the plain baseline and every
    speculator over that target (which then binds it once)."""
    built: dict[str, DeviceSteps] = {}

    def get(models: str) -> DeviceSteps:
        if models not in built:
            built[models] = DeviceSteps((tiny if models == "random" else oracle)[0])
        return built[models]
    return get


@pytest.fixture(scope="module")
def speculators(tiny, oracle, device_steps) -> Callable[..., TreeSpeculator]:
    """speculators(models, branches, depth, budget=None, width=None): the module's
    TreeSpeculator over `tiny` ("random") or `oracle` models with caches of MAX_LEN, built on
    first use and then shared."""
    built: dict[tuple, TreeSpeculator] = {}

    def get(models: str, branches: int, depth: int, budget: int | None = None,
            width: int | None = None) -> TreeSpeculator:
        key = (models, branches, depth, budget, width)
        if key not in built:
            head = (tiny if models == "random" else oracle)[1]
            built[key] = TreeSpeculator(device_steps(models), head, branches, depth, MAX_LEN,
                                        budget, width)
        return built[key]
    return get


def test_full_tree_layout() -> None:
    assert full_tree(2, 3).tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert full_tree(1, 3).tolist() == [-1, 0, 1, 2]


PROMPT = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 11).tolist()
MAX_LEN = 128
_forward = nnx.jit(lambda model, *args: model(*args))


def _top_ranks(target: Llama, prompt: list[int], generated: list[int], width: int = 64
               ) -> np.ndarray:
    """The rank of each generated token in the target's logits after the tokens before it
    (0: the argmax), from one teacher-forced pass."""
    c, tokens = target.config, prompt + generated[:-1]
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(tokens)] = tokens
    cache = KVCache.create(c.num_layers, 1, width, c.num_kv_heads, c.head_dim)
    logits, _, _ = _forward(target, jnp.asarray(padded), cache,
                            AttentionMetadata.for_prefill([len(tokens)], width))
    logits = np.asarray(logits[0, len(prompt) - 1:len(tokens)])
    mine = logits[np.arange(len(generated)), generated]
    return (logits > mine[:, None]).sum(-1)


def _is_greedy(target: Llama, prompt: list[int], generated: list[int]) -> bool:
    """Whether each generated token is the target's argmax after all the tokens before it,
    i.e. plain greedy decoding, checked with one teacher-forced pass (one compile per model,
    where a decoding loop compiles two)."""
    return bool((_top_ranks(target, prompt, generated) == 0).all())


@pytest.mark.parametrize("models,branches,depth,budget",
                         [("random", 2, 3, None), ("oracle", 2, 3, None), ("oracle", 1, 3, None),
                          ("random", 3, 4, 9), ("oracle", 3, 4, 9)])
def test_greedy_tree_and_chain_equal_plain_greedy_tiny(tiny, oracle, speculators, device_steps,
                                                        models, branches, depth, budget) -> None:
    target = (tiny if models == "random" else oracle)[0]
    got, stats = tree_generate(speculators(models, branches, depth, budget), PROMPT, 40)
    assert len(got) == 40 and len(set(got)) > 10  # the check is not about one repeated token
    assert _is_greedy(target, PROMPT, got)
    # ... and equals the simple loop's greedy decoding on the same DeviceSteps.
    plain, _ = generate(device_steps(models), PROMPT, 40)
    assert got == plain
    # Steps emitted the 39 tokens after the first, the last step perhaps a few more.
    assert 0 <= stats["accepted"] + stats["verify_steps"] - 39 <= depth
    if models == "oracle":  # most drafts accepted: deep paths went through every part of a step
        assert stats["mean_accepted"] > 1.0


def test_an_eagle3_head_runs_in_the_tree(oracle, speculators) -> None:
    """Trees with an EAGLE-3 head (the target's steps then return its taps): widened with the
    pass-through fuse, the oracle's head gives the same tokens and acceptance as before; with
    a random fuse it still gives plain greedy decoding; steps without the taps are refused."""
    target, head = oracle
    base, base_stats = tree_generate(speculators("oracle", 2, 3), PROMPT, 24)
    widened = from_eagle1(head, (0,))
    got, stats = tree_generate(TreeSpeculator(target, widened, 2, 3, MAX_LEN), PROMPT, 24)
    assert got == base and stats["accepted"] == base_stats["accepted"]
    widened.fuse.set_value(jax.random.normal(jax.random.key(0), widened.fuse[...].shape) / 8)
    got, _ = tree_generate(TreeSpeculator(target, widened, 2, 3, MAX_LEN), PROMPT, 24)
    assert _is_greedy(target, PROMPT, got)
    with pytest.raises(ValueError, match="feature_layers"):
        TreeSpeculator(DeviceSteps(target), widened, 2, 3, MAX_LEN)


def test_plain_is_greedy_and_both_stop_at_eos(tiny, speculators, device_steps) -> None:
    got, stats = generate(device_steps("random"), PROMPT, 20)
    assert _is_greedy(tiny[0], PROMPT, got) and stats["verify_steps"] == 19
    stop = got.index(got[5]) + 1
    plain, _ = generate(device_steps("random"), PROMPT, 20, eos_ids=[got[5]])
    tree, _ = tree_generate(speculators("random", 2, 3), PROMPT, 20, eos_ids=[got[5]])
    assert tree == plain == got[:stop]


def test_the_functions_keep_nothing_alive() -> None:
    """`eagle_generate` and the simple loop's `generate` build their programs per call and drop
    them (and the models) after it: a process-wide cache kept every speculator, its models and
    their compiled programs alive for good."""
    config = CONFIG.replace(num_layers=1)
    target, head = Llama(config, jnp.float32, nnx.Rngs(4)), EagleHead(config, jnp.float32,
                                                                       nnx.Rngs(5))
    target.embed.set_value(target.embed.get_value() * 0.05)
    plain, _ = generate(target, PROMPT, 6)
    chain, _ = eagle_generate(target, head, PROMPT, 6, branches=1, depth=1, max_len=64)
    assert chain == plain
    alive = [weakref.ref(target), weakref.ref(head)]
    del target, head
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_sampled_at_low_temperature_is_greedy(oracle, speculators) -> None:
    """The sampled rule with a near-point-mass target emits the greedy tokens (a smoke test of
    the sampled path; its exactness is tested in test_speculative). The oracle's two best
    logits are 1.8e-5 apart at one of these positions: at temperature 1e-4 the runner-up has
    probability 0.45 there, at 1e-6 about 1e-8."""
    target, _ = oracle
    got, stats = tree_generate(speculators("oracle", 2, 3), PROMPT, 24,
                               SamplingParams(temperature=1e-6, seed=3))
    assert _is_greedy(target, PROMPT, got) and stats["mean_accepted"] > 1.0



def test_sampled_tree_honours_top_k(tiny, speculators) -> None:
    """At temperature 1 the random target is near uniform over 512 tokens: without top-k the
    tree's sampled output is almost never a top-2 token, with top_k=2 it always is (the first
    token from the prefill, the others from the sampled tree rule), over many seeds. The tree
    used to take a bare temperature and ignore top-k and top-p."""
    target, spec = tiny[0], speculators("random", 2, 2)
    ranks_free = np.concatenate([
        _top_ranks(target, PROMPT, tree_generate(spec, PROMPT, 8,
                                                 SamplingParams(temperature=1.0, seed=s))[0])
        for s in range(3)])
    assert (ranks_free >= 2).mean() > 0.5
    for seed in range(12):
        got, _ = tree_generate(spec, PROMPT, 8, SamplingParams(temperature=1.0, top_k=2,
                                                                seed=seed))
        assert (_top_ranks(target, PROMPT, got) < 2).all(), (seed, got)


@pytest.mark.parametrize("shape", [(2, 3), (3, 4, 9)])
def test_sampled_tree_with_top_k_1_is_greedy(oracle, speculators, shape) -> None:
    """top_k=1 makes the sampling distribution a point mass on the argmax: the sampled tree
    rule must then emit exactly the greedy tokens, at any temperature and seed."""
    spec = speculators("oracle", *shape)
    greedy, _ = tree_generate(spec, PROMPT, 16)
    for seed in range(3):
        got, _ = tree_generate(spec, PROMPT, 16, SamplingParams(temperature=5.0, top_k=1,
                                                                 seed=seed))
        assert got == greedy


def test_sampled_tree_first_token_is_the_simple_loops(speculators, device_steps) -> None:
    """The tree's prompt goes through `DeviceSteps.prefill_step`, drawing the first token from
    the token stream like plain sampling: the same seed gives the same first token."""
    spec = speculators("random", 2, 2)
    assert spec.params[0] is device_steps("random").params  # bound once
    for seed in range(4):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        tree, _ = tree_generate(spec, PROMPT, 1, params)
        plain, _ = generate(device_steps("random"), PROMPT, 1, params)
        assert tree == plain


def _plain_caches(target: Llama, head: EagleHead, tokens: list[int], max_len: int
                  ) -> tuple[KVCache, KVCache]:
    """Target cache of one prefill over tokens[:-1], and the head's over its true features,
    rows (h_s, x_{s+1}) for every s of that prefill."""
    c, n = target.config, len(tokens) - 1
    cache = KVCache.create(c.num_layers, 1, max_len, c.num_kv_heads, c.head_dim)
    _, hidden, cache = nnx.jit(lambda m, *a: m(*a))(
        target, jnp.asarray([tokens[:-1]]), cache, AttentionMetadata.for_prefill([n], n))
    _, head_cache = nnx.jit(lambda h, *a: h(*a))(
        head, hidden, jnp.asarray([tokens[1:]]), target.embed, head.create_cache(1, max_len),
        AttentionMetadata.for_prefill([n], n))
    return cache, head_cache


def _assert_slots_equal(got: KVCache, want: KVCache, slots: int) -> None:
    for a, b in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(np.asarray(a[:, :, :slots]), np.asarray(b[:, :, :slots]),
                                   rtol=1e-4, atol=1e-5)


def test_cache_after_a_step_equals_a_plain_pass(tiny, speculators) -> None:
    """A hand-built 2 x 3 tree whose greedy path runs through second children (nodes 2, 6, 14,
    in slots n+2, n+6, n+14): after verification the target's cache equals a plain prefill
    over the accepted tokens; after the next step's catch-up, so does the head's."""
    target, head = tiny
    # Greedy tokens (checked above): x_n, the three the tree holds, the bonus, ...
    spec = speculators("random", 2, 3)
    ref = tree_generate(spec, PROMPT, 12)[0]
    state = spec.prefill(PROMPT)
    assert int(state.root) == ref[0]
    state = dataclasses.replace(state, head_cache=spec.draft(state)[2])  # as `step` would
    fillers = [t for t in range(CONFIG.vocab_size) if t not in ref[:5]]  # never accepted
    tree = np.array([ref[0]] + fillers[:14])
    for node, token in ((2, ref[1]), (6, ref[2]), (14, ref[3])):
        tree[node] = token
    state, emitted, accepted = spec.verify(state, tree)
    assert int(accepted) == 3 and np.asarray(emitted).tolist() == ref[1:5]
    n = int(state.length)
    assert n == len(PROMPT) + 4
    want_target, want_head = _plain_caches(target, head, PROMPT + ref[:5], MAX_LEN)
    _assert_slots_equal(state.target_cache, want_target, n)
    state, emitted, accepted = spec.step(state)
    assert np.asarray(emitted)[:int(accepted) + 1].tolist() == ref[5:6 + int(accepted)]
    _assert_slots_equal(state.head_cache, want_head, n)


def test_a_step_past_max_len_raises(speculators) -> None:
    """A step writes the tree's 15 nodes after the cached tokens; with fewer than 15 slots left
    it raises instead of dropping their KV (and compacting onto clamped slots)."""
    spec = speculators("random", 2, 3)
    state = spec.prefill(PROMPT)
    full = dataclasses.replace(state, length=jnp.int32(MAX_LEN - spec.num_nodes + 1))
    for call in (spec.step, spec.draft, lambda s: spec.verify(s, np.zeros(spec.num_nodes))):
        with pytest.raises(ValueError, match=rf"slots \[{MAX_LEN - 14}, {MAX_LEN + 1}\)"):
            call(full)
    with pytest.raises(ValueError, match="deeper"):  # a chain of 14 below a 3-level tree
        spec.verify(state, np.zeros(spec.num_nodes), np.arange(-1, spec.num_nodes - 1))
    with pytest.raises(ValueError, match="parents must be"):
        spec.verify(state, np.zeros(spec.num_nodes), np.r_[-1, 2, np.zeros(13, int)])
    spec.step(dataclasses.replace(state, length=jnp.int32(MAX_LEN - spec.num_nodes)))  # fits


@pytest.mark.parametrize("params", [
    SamplingParams(stop_token_ids=[5]), SamplingParams(stop=["a"]), SamplingParams(logprobs=1),
    SamplingParams(structured=StructuredOutput(regex="[a-z]+"))],
    ids=["stop_token_ids", "stop", "logprobs", "structured"])
def test_tree_generation_refuses_what_the_plain_loop_refuses(speculators, device_steps,
                                                             params) -> None:
    """Tree generation runs outside the engine, as the plain loop does: stops, logprobs and
    structured output asked for in its params would be ignored, so both refuse them alike."""
    with pytest.raises(ValueError) as plain:
        generate(device_steps("random"), PROMPT, 4, params)
    with pytest.raises(ValueError) as tree:
        tree_generate(speculators("random", 2, 3), PROMPT, 4, params)
    assert str(tree.value) == str(plain.value)


def test_a_wide_dynamic_tree_needs_room_for_the_heads_rows(tiny, device_steps) -> None:
    """A 3x4/4 dynamic tree verifies 5 nodes but its head writes 9 rows (3 per level above the
    last) from the same slot: the room checks count the 9, not the 5. Host checks only: nothing
    here compiles."""
    spec = TreeSpeculator(device_steps("random"), tiny[1], 3, 4, MAX_LEN, budget=4)
    assert (spec.num_nodes, spec.shape.head_rows, spec.step_slots) == (5, 9, 9)
    near_end = MAX_LEN - 8  # room for the 5 nodes, not for the 9 head rows
    with pytest.raises(ValueError, match=rf"slots \[{near_end}, {MAX_LEN + 1}\)"):
        spec.draft(types.SimpleNamespace(length=np.int32(near_end)))
    with pytest.raises(ValueError, match="does not fit"):
        spec.prefill(list(range(near_end)))
    with pytest.raises(ValueError, match="9 slots exceed"):
        tree_generate(spec, PROMPT, near_end - len(PROMPT))


def test_smollm2_greedy_tree_and_chain_equal_plain_greedy(smollm2_4_layers) -> None:
    config, target, tokenizer = smollm2_4_layers
    head = EagleHead(config, jnp.float32, nnx.Rngs(0))
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}]))
    tree, _ = eagle_generate(target, head, prompt, 10, branches=2, depth=2)
    chain, _ = eagle_generate(target, head, prompt, 10, branches=1, depth=2)
    assert tree == chain and _is_greedy(target, prompt, tree)


# -- EAGLE-2's dynamic tree -------------------------------------------------------------------

def test_tree_structure_is_a_walk_to_the_root() -> None:
    """Depths and ancestor masks of random trees, from traced parents, against walking each
    node up to the root on the host (max_depth may exceed the deepest node)."""
    rng = np.random.default_rng()
    structure = jax.jit(tree_structure, static_argnums=1)
    for _ in range(40):
        n = int(rng.choice([1, 2, 7, 16]))
        parents = np.array([-1] + [rng.integers(0, i) for i in range(1, n)], np.int32)
        depth, mask = np.zeros(n, np.int64), np.eye(n, dtype=bool)
        for i in range(n):
            j = i
            while parents[j] >= 0:
                j = parents[j]
                depth[i] += 1
                mask[i, j] = True
        got_depth, got_mask = structure(jnp.asarray(parents), int(depth.max() + rng.integers(2)))
        assert got_depth.tolist() == depth.tolist()
        assert (np.asarray(got_mask) == mask).all()


def test_select_nodes_keeps_the_best_as_a_tree() -> None:
    """Random candidate sets in drafting order whose scores fall along each path, with exact
    ties (log p = 0 and repeated values): the chosen candidates are the `budget` best by score,
    the lower index first among ties (a brute-force sort); the set holds every chosen node's
    parent; and the returned parents name, for each node, its candidate's parent."""
    rng = np.random.default_rng()
    select = jax.jit(select_nodes, static_argnums=2)
    for _ in range(60):
        c = int(rng.choice([1, 5, 12, 30]))
        cand_parents = np.array([-1 if i == 0 or rng.random() < 0.3 else rng.integers(0, i)
                                 for i in range(c)], np.int32)
        logp = rng.choice(np.float32([0.0, -0.5, -1.0, -1.5, -2.0]), c)
        scores = np.zeros(c, np.float32)
        for i in range(c):
            base = np.float32(0) if cand_parents[i] < 0 else scores[cand_parents[i]]
            scores[i] = base + logp[i]
        budget = int(rng.integers(1, c + 1))
        sel, parents = select(jnp.asarray(scores), jnp.asarray(cand_parents), budget)
        sel, parents = np.asarray(sel), np.asarray(parents)
        want = sorted(sorted(range(c), key=lambda i: (-scores[i], i))[:budget])
        assert sel.tolist() == want
        chosen = set(want)
        assert all(cand_parents[i] < 0 or cand_parents[i] in chosen for i in want)
        assert parents[0] == -1 and len(parents) == budget + 1
        for node in range(1, budget + 1):
            up = cand_parents[sel[node - 1]]
            assert parents[node] == (0 if up < 0 else 1 + want.index(up))


def _paths(tokens: jax.Array, parents: jax.Array) -> set[tuple[int, ...]]:
    """Each non-root node as its tokens from the root's child down to it."""
    tokens, parents = np.asarray(tokens).tolist(), np.asarray(parents).tolist()
    paths = set()
    for node in range(1, len(tokens)):
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        paths.add(tuple(reversed(path)))
    return paths


def test_dynamic_drafts_are_nodes_of_the_full_tree(speculators) -> None:
    """The head's children of a node depend on the node's path only, so: with a width past
    the widest level and a budget of every candidate, the dynamic tree is the full tree (the
    same token paths); narrower, it drafts `budget` of the full tree's paths, closed under
    taking a path's prefix, after any number of steps."""
    full = speculators("random", 2, 3)
    every = speculators("random", 2, 3, 14, 4)
    narrow = speculators("random", 2, 3, 6)
    states = {spec: spec.prefill(PROMPT) for spec in (full, every, narrow)}
    for _ in range(3):
        want = _paths(*full.draft(states[full])[:2])
        assert len(want) == 14
        assert _paths(*every.draft(states[every])[:2]) == want
        got = _paths(*narrow.draft(states[narrow])[:2])
        assert len(got) == 6 and got <= want
        assert all(path[:-1] in got for path in got if len(path) > 1)
        states = {spec: spec.step(state)[0] for spec, state in states.items()}
        assert len({int(s.length) for s in states.values()}) == 1  # all greedy, in step


def _dense_children(target: Llama, head: EagleHead, prompt: list[int], root: int, k: int
                    ) -> Callable[[tuple[int, ...]], set[int]]:
    """children(path): the head's top-k tokens after the root and `path`, computed without any
    tree: the head runs densely over the prompt's true features (rows (h_s, x_{s+1}), the last
    one (h_{n-1}, root)), then one row per path token, each reading the previous row's output,
    at the positions the tree gives them."""
    c, n = target.config, len(prompt)
    cache = KVCache.create(c.num_layers, 1, MAX_LEN, c.num_kv_heads, c.head_dim)
    _, hidden, _ = _forward(target, jnp.asarray([prompt]), cache,
                            AttentionMetadata.for_prefill([n], n))
    pred, head_cache = _forward(head, head.features_in(hidden), jnp.asarray([prompt[1:] + [root]]),
                                target.embed, head.create_cache(1, MAX_LEN),
                                AttentionMetadata.for_prefill([n], n))
    states = {(): (pred[0, n - 1], head_cache)}

    def state(path: tuple[int, ...]):
        if path not in states:
            h, cache = state(path[:-1])
            pred, cache = _forward(head, h[None, None], jnp.asarray([[path[-1]]]), target.embed,
                                   cache, AttentionMetadata.for_prefill([1], 1,
                                                                        cached=[n + len(path) - 1]))
            states[path] = (pred[0, 0], cache)
        return states[path]

    def children(path: tuple[int, ...]) -> set[int]:
        _, top = jax.lax.top_k(target.logits(state(path)[0]), k)
        return set(np.asarray(top).tolist())
    return children


@pytest.mark.parametrize("shape", [(2, 3), (3, 3, 10)])
def test_drafted_children_are_the_heads_dense_top_k(tiny, speculators, shape) -> None:
    """Every drafted node is one of the head's top-`branches` tokens after its parent's path,
    the head run densely along that path (`_dense_children`); in the full tree a node's
    children are exactly those tokens."""
    target, head = tiny
    spec = speculators("random", *shape)
    state = spec.prefill(PROMPT)
    tokens, parents, _ = spec.draft(state)
    children = _dense_children(target, head, PROMPT, int(state.root), shape[0])
    tokens, parents = np.asarray(tokens).tolist(), np.asarray(parents).tolist()
    paths = {0: ()}
    for node in range(1, len(tokens)):
        paths[node] = paths[parents[node]] + (tokens[node],)
    kids: dict[int, set[int]] = collections.defaultdict(set)
    for node in range(1, len(tokens)):
        kids[parents[node]].add(tokens[node])
    for node, got in kids.items():
        want = children(paths[node])
        assert got == want if len(shape) == 2 else got <= want, paths[node]


@pytest.mark.parametrize("shape", [(2, 3), (3, 3, 10)])
def test_a_draft_vocabulary_maps_back_to_target_ids(tiny, device_steps, speculators, shape
                                                     ) -> None:
    """The whole vocabulary as a draft vocabulary, in a random order, drafts the same tree as
    no draft vocabulary (choices map back to target ids); a subset drafts only its own ids,
    and the output is still plain greedy decoding."""
    rng = np.random.default_rng()
    head, plain = tiny[1], speculators("random", *shape)
    state = plain.prefill(PROMPT)
    want = [np.asarray(a).tolist() for a in plain.draft(state)[:2]]
    permuted = TreeSpeculator(device_steps("random"), head, *shape[:2], MAX_LEN, *shape[2:],
                              draft_vocab=rng.permutation(CONFIG.vocab_size).astype(np.int32))
    assert [np.asarray(a).tolist() for a in permuted.draft(state)[:2]] == want
    subset = rng.choice(CONFIG.vocab_size, 24, replace=False).astype(np.int32)
    small = TreeSpeculator(device_steps("random"), head, *shape[:2], MAX_LEN, *shape[2:],
                           draft_vocab=subset)
    assert set(np.asarray(small.draft(state)[0])[1:].tolist()) <= set(subset.tolist())
    got, _ = tree_generate(small, PROMPT, 20)
    assert got == tree_generate(plain, PROMPT, 20)[0]
    with pytest.raises(ValueError, match="children"):
        TreeSpeculator(device_steps("random"), head, 3, 2, MAX_LEN, draft_vocab=subset[:2])


def test_sampled_dynamic_tree_keeps_the_joint_law(oracle, speculators) -> None:
    """The first three tokens of sampled dynamic-tree generation follow plain sampling's exact
    law (chi-square): the first comes from the prefill, the next two from the first verify
    step, where the oracle head's tree holds most but (a budget of 10 of 39 candidates) not
    all of the three tokens top-k allows at each level."""
    params = dict(temperature=1.0, top_k=3)
    law = exact_joint(oracle[0], PROMPT, SamplingParams(seed=0, **params), 3)
    spec = speculators("oracle", 3, 3, 10)
    counts = collections.Counter(
        tuple(tree_generate(spec, PROMPT, 3, SamplingParams(seed=seed, **params))[0])
        for seed in range(600))
    assert chi_square_pvalue(counts, law) > 1e-3


def test_tree_shapes_are_checked() -> None:
    assert TreeShape(2, 3).num_nodes == 15 and TreeShape(3, 4, 9).num_nodes == 10
    for shape in (TreeShape(2, 3), TreeShape(3, 4, 9), TreeShape(2, 3, 14, 4)):
        assert TreeShape.parse(str(shape)) == shape
    assert str(TreeShape(3, 4, 9)) == "3x4/9" and str(TreeShape(2, 3, 14, 4)) == "2x3w4/14"
    for bad in ("3x4/", "x4", "3x4/9w2", "3.0x4"):
        with pytest.raises(ValueError, match="BxD"):
            TreeShape.parse(bad)
    for bad in (dict(budget=0), dict(budget=15), dict(budget=2.5), dict(width=2)):
        with pytest.raises(ValueError):
            TreeShape(2, 3, **bad)
