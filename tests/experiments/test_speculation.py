"""Smoke test of experiments/speculation.py on the tiny model: both parts run end to end, the
JSONL rows carry their fields with sane values, greedy speculation changes no token, a method
without weights is skipped with a note, suffix decoding runs on its own (repetitive) prompts,
and a resumed run measures no point already written."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import speculation
from experiments.common import read_jsonl
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.spec.eagle_head import save_eagle
from infer.spec.tree_draft import TreeShape
from tests.spec.oracle import oracle_models

CONFIG = get_config("tiny")


def test_cost_model_matches_the_lesson() -> None:
    assert speculation.expected_tokens(0.0, 4) == 1.0
    assert speculation.expected_tokens(1.0, 4) == 5.0
    assert speculation.expected_tokens(0.5, 2) == pytest.approx(1.75)
    # Free drafts and a verify as cheap as a decode step: the speedup is E itself.
    assert speculation.predicted_speedup(0.5, 2, 0.0, 1.0) == pytest.approx(1.75)
    assert speculation.predicted_speedup(0.5, 2, 0.1, 1.2) == pytest.approx(1.75 / 1.4)
    # DeviceSteps where nothing was proposed are plain decode steps.
    assert speculation.predicted_speedup(0.5, 2, 0.0, 1.0, verify_fraction=0.0) == 1.0
    # A step that accepts all k drafts saw no rejection; one that accepted 1 of 3 saw one.
    assert speculation.alpha_mle([2, 1], [2, 3]) == pytest.approx(3 / 4)
    # A tree verifies 14 candidates but accepts at most its depth, 3: a step that accepted 3
    # saw no rejection (counted as one, alpha fell to accepted / (accepted + steps), and the
    # predicted tokens per verify step equalled the measured ones whatever happened).
    assert speculation.alpha_mle([3, 3, 0], [14, 14, 14], depth=3) == pytest.approx(6 / 7)
    tokens = speculation.predicted_speedup(6 / 7, 14, 0.0, 1.0, depth=3)
    assert tokens == pytest.approx(speculation.expected_tokens(6 / 7, 3)) and tokens <= 4


def test_experiment_rows_on_the_tiny_model(tmp_path, monkeypatch, capsys) -> None:
    model = Llama(CONFIG, jnp.float32, nnx.Rngs(0))
    # Small embeddings for varied greedy text (see tests/spec/test_tree.py).
    model.embed.set_value(model.embed.get_value() * 0.05)
    rng = np.random.default_rng(0)
    # Prompts that repeat themselves, so prompt lookup has something to propose.
    grounded = [np.tile(rng.integers(0, CONFIG.vocab_size, 12), 3).tolist() for _ in range(2)]
    chat = [rng.integers(0, CONFIG.vocab_size, 20).tolist() for _ in range(2)]
    repetitive = [rng.integers(0, CONFIG.vocab_size, 16).tolist()] * 2  # one answer, twice
    real_missing = speculation.missing_weights
    monkeypatch.setattr(speculation, "missing_weights",
                        lambda m, eagle_path="": "/nonexistent/draft.safetensors"
                        if m == "draft" else real_missing(m, eagle_path))
    out = str(tmp_path / "speculation.jsonl")
    prompts = {"grounded": grounded, "chat": chat, "repetitive": repetitive}
    rows = speculation.run(
        parts=["engine", "tree"], methods=["ngram", "draft", "suffix"], ks=[2],
        temperatures=[0.0], batch_sizes=[1, 2], num_prompts=2, max_tokens=12, snippet_chars=200,
        warmup="pass", tree_branches=2, tree_depth=1, tree_prompts=1, random_head=True, seed=0,
        out=out, loaded=(CONFIG, model, None), prompts=prompts,
        eagle_path=str(tmp_path / "no_eagle.safetensors"))
    printed = capsys.readouterr().out
    assert "skipping method 'draft'" in printed and "| method |" in printed
    assert (tmp_path / "speculation.png").exists()

    stored = read_jsonl(out)
    # Baselines per batch and prompt kind, ngram and suffix per batch, the tree part.
    assert len(stored) == len(rows) == 4 + 2 + 2 + 3
    assert all(r["method"] != "draft" for r in stored)
    assert {(r["method"], r["prompts"]) for r in stored if r["part"] == "engine"} == {
        ("none", "grounded"), ("none", "repetitive"), ("ngram", "grounded"),
        ("suffix", "repetitive")}
    # Timed passes built no program (a compile or a cache load would be in the timing).
    assert all(r["programs_built_while_timed"] == 0 for r in stored if r["part"] == "engine")
    spec = [r for r in stored if r["part"] == "engine" and r["method"] in ("ngram", "suffix")]
    assert {(r["method"], r["batch"]) for r in spec} == {(m, b) for m in ("ngram", "suffix")
                                                         for b in (1, 2)}
    for r in spec:
        for key in ("decode_tok_s", "baseline_decode_tok_s", "speedup", "acceptance_rate",
                    "alpha_mle", "tokens_per_verify", "draft_cost_ratio", "verify_cost_ratio",
                    "pred_speedup", "pred_speedup_mle", "env"):
            assert key in r, key
        assert r["greedy_identical"] == 1.0
        assert 0 < r["proposed"] and 0 <= r["accepted"] <= r["proposed"]
        assert 0.0 <= r["acceptance_rate"] <= r["alpha_mle"] <= 1.0
        assert 1.0 <= r["tokens_per_verify"] <= r["k"] + 1
        assert r["decode_tok_s"] > 0 and r["speedup"] > 0 and r["pred_speedup"] > 0
        assert r["draft_cost_ratio"] >= 0 and r["verify_cost_ratio"] > 0
        if "engine_stats" in r:  # the engine's own counters agree with the probe's
            assert r["engine_stats"]["proposed"] == r["proposed"]
            assert r["engine_stats"]["accepted"] == r["accepted"]
    tree = [r for r in stored if r["part"] == "tree"]
    assert [r["tree"] for r in tree] == ["none", "2x1", "1x1"]
    assert all(r["programs_built_while_timed"] == 0 for r in tree)  # every prompt warmed
    for r in tree[1:]:
        assert r["head"] == "random" and r["greedy_identical"] == 1.0
        assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["tokens_per_verify"] >= 1.0
        assert math.isfinite(r["pred_speedup"]) and r["decode_tok_s"] > 0

    # A resumed run over the same file measures nothing (every point's row is there) and
    # returns the same rows, a baseline's token ids included for its speculative points.
    def measured(*args, **kwargs):
        raise AssertionError("a resumed run measured a point that was already in the file")

    monkeypatch.setattr(speculation, "run_workload", measured)
    monkeypatch.setattr(speculation, "time_tree_pieces", measured)
    again = speculation.run(
        parts=["engine", "tree"], methods=["ngram", "draft", "suffix"], ks=[2],
        temperatures=[0.0], batch_sizes=[1, 2], num_prompts=2, max_tokens=12, snippet_chars=200,
        warmup="pass", tree_branches=2, tree_depth=1, tree_prompts=1, random_head=True, seed=0,
        out=out, loaded=(CONFIG, model, None), prompts=prompts,
        eagle_path=str(tmp_path / "no_eagle.safetensors"), resume=True)
    assert [r["key"] for r in again] == [r["key"] for r in rows]
    assert len(read_jsonl(out)) == len(rows)


def test_prompt_kinds() -> None:
    assert speculation.prompt_kind_of("ngram") == "grounded"
    assert speculation.prompt_kind_of("suffix") == "repetitive"
    assert speculation.prompt_kind_of("eagle") == "chat"
    assert speculation.prompt_kind_of("ngram", "repetitive") == "repetitive"


def test_repetitive_prompts_repeat_their_instruction() -> None:
    from experiments.workloads import RECORD_TEMPLATES, record_prompts

    texts = record_prompts(6)
    assert len(set(texts)) == 6 and texts == record_prompts(6)  # varied, and reproducible
    for i, text in enumerate(texts):
        instruction = RECORD_TEMPLATES[i % 2].split("\n\n")[0]
        assert text.startswith(instruction) and "{" not in text


def test_engine_trees_run_beside_the_chains(tmp_path) -> None:
    """--engine_trees: each tree runs through the serving engine as method eagle's row with a
    tree column, its greedy output the baseline's, its counts the engine's own."""
    target, head = oracle_models(CONFIG)
    path = str(tmp_path / "eagle.safetensors")
    save_eagle(head, path)
    rng = np.random.default_rng(1)
    chat = [rng.integers(0, CONFIG.vocab_size, 20).tolist() for _ in range(2)]
    rows = speculation.run(
        parts=["engine"], methods=["eagle"], ks=[1], engine_trees=["2x2", "3x3/6"],
        temperatures=[0.0], batch_sizes=[2], num_prompts=2, max_tokens=16, snippet_chars=200,
        warmup="pass", tree_branches=2, tree_depth=1, tree_prompts=1, random_head=True, seed=0,
        out=str(tmp_path / "speculation.jsonl"), loaded=(target.config, target, None),
        prompts={"chat": chat}, eagle_path=path)
    trees = {r["tree"]: r for r in rows if r.get("tree")}
    assert set(trees) == {"2x2", "3x3/6"}
    assert [r["k"] for r in trees.values()] == [6, 6]  # candidates verified at most
    for r in trees.values():
        assert r["greedy_identical"] == 1.0 and r["programs_built_while_timed"] == 0
        assert 1.0 < r["tokens_per_verify"] <= 1 + TreeShape.parse(r["tree"]).depth
        assert r["pred_tokens_per_verify_mle"] <= 1 + TreeShape.parse(r["tree"]).depth
        assert r["engine_stats"]["proposed"] == r["proposed"]
        assert r["engine_stats"]["accepted"] == r["accepted"]
    # The oracle head's 2x2 steps often accept the whole depth, which is no rejection: alpha
    # then exceeds accepted / (accepted + steps), which counts one in every step.
    r = trees["2x2"]
    assert r["alpha_mle"] > r["accepted"] / (r["accepted"] + r["verify_rows"])


def test_tree_rows_count_rejections_at_their_prefix_depth() -> None:
    """A row verifies a prefix of its tree, cut by its limit or the confidence stop, which can
    be shallower than the tree: a step that accepted all of that prefix's depth saw no
    rejection. Random trees in drafting order, random prefixes and acceptances through the
    probe and spec_row, against a count of the rejections the verifier saw."""
    import types

    rng = np.random.default_rng(0)
    rows, n, depth = 3, 16, 4

    class Proposer:  # the calls the engine makes for a tree: propose_tree, then commit
        config = types.SimpleNamespace(tree=TreeShape(3, depth, n - 1))
        out = None

        def propose(self, *args, **kwargs):
            raise AssertionError("a tree proposer's chain was called")

        def commit(self, seqs, emitted, *args):
            pass

        def propose_tree(self, seqs, limits, rows):
            return self.out

    proposer = Proposer()
    probe = speculation.ProposerProbe(proposer)
    accepted = judged = reached = verifying = 0
    for _ in range(60):
        parents = np.full((rows, n), -1, np.int32)
        levels = np.zeros((rows, n), np.int64)
        for r in range(rows):
            for j in range(1, n):  # parents first; at most `depth` levels below the root
                parents[r, j] = rng.choice([i for i in range(j) if levels[r, i] < depth])
                levels[r, j] = levels[r, parents[r, j]] + 1
        counts = rng.integers(0, n, rows)
        counts[0] = max(counts[0], 1)  # every step verifies
        emitted = []
        for r in range(rows):
            reach = int(levels[r, 1:counts[r] + 1].max()) if counts[r] else 0
            a = int(rng.integers(0, reach + 1))
            emitted.append([7] * (a + 1))
            if counts[r]:
                accepted += a
                judged += a + (a < reach)  # the first rejection, unless it took the prefix whole
                reached += reach
                verifying += 1
        proposer.out = (jnp.zeros((rows, n - 1), jnp.int32), jnp.asarray(parents), counts)
        proposer.propose_tree([None] * rows, [n - 1] * rows, rows)
        proposer.commit([None] * rows, emitted)
    spec = {"probe": probe.summary(), "verify_step_s": 0.02, "decode_row_steps": 200,
            "decode_steps": 80,
            "decode_tok_s": 50.0}
    row = speculation.spec_row({"decode_step_s": 0.01, "decode_tok_s": 40.0}, spec, n - 1, depth)
    assert row["accepted"] == accepted and row["verify_rows"] == verifying
    assert row["alpha_mle"] == pytest.approx(accepted / judged)
    assert row["reach_per_verify"] == pytest.approx(reached / verifying)
    assert row["pred_tokens_per_verify_mle"] == pytest.approx(
        speculation.expected_tokens(accepted / judged, reached / verifying))


def test_batch_rows_without_drafts_ride_in_the_verify_step() -> None:
    """At batch > 1 a step verifies when any row has drafts, and a row without rides in it at
    the verify step's cost: the cost model charges plain steps only for the steps that verified
    nothing. Random batches, against the tokens/s the cost model's own assumptions give when
    the steps are simulated one by one."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        batch, k = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        c, v = rng.uniform(0.0, 0.3), rng.uniform(0.9, 2.0)
        base_step, steps = 0.01, int(rng.integers(20, 60))
        drafting = [rng.random(batch) < rng.uniform(0.2, 0.9) for _ in range(steps)]
        verify = [d.any() for d in drafting]
        rows = sum(int(d.sum()) for d in drafting)
        accepted = rng.integers(0, k + 1, rows).tolist()
        alpha = speculation.alpha_mle(accepted, [k] * rows)
        # Each verifying row emits E tokens, every other row one; a verify step costs
        # k c + v baseline steps, a plain one a baseline step.
        tokens = rows * speculation.expected_tokens(alpha, k) + (batch * steps - rows)
        seconds = base_step * sum((k * c + v) if ver else 1.0 for ver in verify)
        base_tok_s = batch / base_step
        probe = {"verify_steps": sum(verify), "verify_rows": rows, "proposed": k * rows,
                 "accepted": sum(accepted), "accepted_counts": accepted,
                 "proposed_counts": [k] * rows,
                 "propose_s": sum(verify) * k * c * base_step, "propose_calls": sum(verify),
                 "drafting_propose_s": sum(verify) * k * c * base_step,
                 "drafting_calls": sum(verify)}
        spec = {"probe": probe, "verify_step_s": (k * c + v) * base_step,
                "decode_steps": steps, "decode_row_steps": batch * steps,
                "decode_tok_s": 1.0}
        row = speculation.spec_row({"decode_step_s": base_step, "decode_tok_s": base_tok_s},
                                   spec, k)
        assert row["draft_cost_ratio"] == pytest.approx(c)
        assert row["verify_cost_ratio"] == pytest.approx(v)
        assert row["pred_speedup_mle"] == pytest.approx(tokens / seconds / base_tok_s)


def test_calls_that_draft_nothing_cost_the_plain_steps_not_c_and_v(monkeypatch) -> None:
    """A verify step holds one drafting call: c is that call's time per draft and v the rest of
    the step. Calls that drafted nothing (n-gram without a match, a confidence stop) run in
    plain steps at any cost, cheaper or dearer than a drafting call; they must not move either
    (averaged over every call, they lowered c and raised v by the difference), and the plain
    steps that held them cost that much more. Random mixes of calls through the probe, on a
    clock each call advances by its own cost."""
    rng = np.random.default_rng()
    now = [0.0]
    monkeypatch.setattr(speculation.time, "perf_counter", lambda: now[0])
    for _ in range(20):
        k, base_step = int(rng.integers(1, 9)), 0.01
        c, v = rng.uniform(0.01, 0.3), rng.uniform(0.9, 2.0)
        idle_cost = rng.uniform(0.0, 2 * k * c) * base_step

        class Proposer:  # a chain proposer: propose, then commit
            config = None

            def propose(self, seqs, limits, rows, k, drafting=True):
                now[0] += k * c * base_step if drafting else idle_cost
                return None, np.array([k if drafting else 0]), None

            def commit(self, seqs, emitted, *args):
                pass

        proposer = Proposer()
        probe = speculation.ProposerProbe(proposer)
        calls = rng.random(int(rng.integers(2, 40))) < 0.5
        calls[:2] = True, False  # both kinds, in a random mix
        rng.shuffle(calls)
        for drafting in calls:
            proposer.propose([None], [k], 1, k, drafting=bool(drafting))
            proposer.commit([None], [[7] * (1 + int(drafting))])
        spec = {"probe": probe.summary(), "verify_step_s": (k * c + v) * base_step,
                "decode_steps": len(calls), "decode_row_steps": len(calls),
                "decode_tok_s": 1.0}
        row = speculation.spec_row({"decode_step_s": base_step, "decode_tok_s": 1.0}, spec, k)
        assert row["verify_rows"] == calls.sum()
        assert row["draft_cost_ratio"] == pytest.approx(c)
        assert row["verify_cost_ratio"] == pytest.approx(v)
        # ... and the plain steps, which held them, cost 1 + their time: the prediction prices
        # those steps so (at 1, a confidence stop's run was predicted 1.5x its measured speed).
        fs = calls.mean()
        plain = 1 + idle_cost / base_step
        assert row["plain_step_cost"] == pytest.approx(plain)
        tokens = fs * speculation.expected_tokens(1 / k, k) + (1 - fs)
        assert row["pred_speedup"] == pytest.approx(
            tokens / (fs * (k * c + v) + (1 - fs) * plain))
