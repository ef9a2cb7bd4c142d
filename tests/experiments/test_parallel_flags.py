"""The parallel flags (`infer.parallel.flags`) on every experiment that builds engines: each
defines them and its `run` takes them (startup and bench_serve pass them to LLM and to
infer's server); the ones that time one engine's steps refuse
data_parallel_size != 1, and the comparisons that run on one device refuse a split engine, all
in one line before any model loads. The runs under a mesh are in test_structured_cost.py."""

from __future__ import annotations

import pytest

import infer.io.loader
from experiments import (bench_serve, common, engine_overhead, prefix_cache, serve, speculation,
                         startup, structured_cost)

PARALLEL_FLAGS = ("tensor_parallel_size", "data_parallel_size", "pad_heads", "dp_routing")


class Loaded(AssertionError):
    pass


@pytest.fixture
def no_load(monkeypatch) -> None:
    """Loading the model fails the test: a refusal must come before it."""
    def load(*args, **kwargs):
        raise Loaded("the model loaded before the flags were checked")

    monkeypatch.setattr(infer.io.loader, "load_on_host", load)
    monkeypatch.setattr(infer.io.loader, "load", load)


def serve_run(out: str, **parallel) -> None:
    serve.run(num_requests=2, rate=1.0, prompt_min=4, prompt_max=8, output_shape=1.5,
              output_scale=2.0, output_cap=4, max_num_seqs=2, max_prefill_tokens=16,
              max_model_len=64, dtype="float32", kv_cache_dtype="auto", policies=["static"],
              peers=["none"], seed=0, out=out, **parallel)


def engine_overhead_run(out: str, **parallel) -> None:
    engine_overhead.run(batch_sizes=[1], dtypes=["float32"], tokens=4, prompt_len=16, repeats=1,
                        peers=["none"], plain=False, out=out, **parallel)


def prefix_cache_run(out: str, **parallel) -> None:
    prefix_cache.run(parts=["system"], alone_requests=10, alone_shared_fraction=0.5,
                     alone_prefixes=2, alone_prefix_tokens=(4, 8), alone_suffix_tokens=(4, 8),
                     alone_page_size=4, alone_max_pages=[8], system_requests=2,
                     system_prompt_tokens=32, system_rate=1.0, chat_conversations=1,
                     chat_turns=1, max_tokens=2, seed=0, out=out, **parallel)


def structured_cost_run(out: str, **parallel) -> None:
    structured_cost.run(batch_sizes=[1], constraints=["none"], tokens=4, prompt_len=16,
                        repeats=1, layers=2, out=out, **parallel)


def speculation_run(out: str, **parallel) -> None:
    speculation.run(parts=["engine"], methods=["ngram"], ks=[2], temperatures=[0.0],
                    batch_sizes=[1], num_prompts=1, max_tokens=4, snippet_chars=100,
                    warmup="pass", tree_branches=2, tree_depth=1, tree_prompts=1,
                    random_head=True, seed=0, out=out, **parallel)


RUNS = {"serve": (serve, serve_run), "engine_overhead": (engine_overhead, engine_overhead_run),
        "prefix_cache": (prefix_cache, prefix_cache_run),
        "structured_cost": (structured_cost, structured_cost_run),
        "speculation": (speculation, speculation_run)}


# Experiments whose engines run through LLM or infer's server, where data parallelism is the
# front's: they pass the flags on, and refuse nothing.
PASSED_ON = {"startup": startup, "bench_serve": bench_serve}


@pytest.mark.parametrize("name", sorted(RUNS) + sorted(PASSED_ON))
def test_every_engine_experiment_takes_the_parallel_flags(name: str) -> None:
    module = RUNS[name][0] if name in RUNS else PASSED_ON[name]
    assert set(PARALLEL_FLAGS) <= set(module.FLAGS)
    taken = common.flag_kwargs(module.run, module.FLAGS)
    assert {"tensor_parallel_size", "data_parallel_size"} <= set(taken)
    assert taken["tensor_parallel_size"] == 1 and taken["data_parallel_size"] == 1


@pytest.mark.parametrize("name", sorted(RUNS))
def test_data_parallel_is_refused_before_any_work(name: str, tmp_path, no_load) -> None:
    out = tmp_path / "o.jsonl"
    with pytest.raises(ValueError, match=f"^{name} measures one engine's step records"):
        RUNS[name][1](str(out), data_parallel_size=2)
    assert not out.exists()


def test_speculation_refuses_a_split_engine_naming_why(tmp_path, no_load) -> None:
    with pytest.raises(ValueError, match="speculative decoding runs on one device"):
        speculation_run(str(tmp_path / "o.jsonl"), tensor_parallel_size=3)


def test_engine_overhead_refuses_one_device_comparisons_with_a_split_engine(tmp_path,
                                                                           no_load) -> None:
    args = dict(batch_sizes=[1], dtypes=["float32"], tokens=4, prompt_len=16, repeats=1,
                out=str(tmp_path / "o.jsonl"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pass --noplain --peers=none to time the engine"):
        engine_overhead.run(peers=["hf"], **args)
    with pytest.raises(ValueError, match="pass --peers=none to time the engine"):
        engine_overhead.run(peers=["hf"], plain=False, **args)
    with pytest.raises(ValueError, match="pass --noplain to time the engine"):
        engine_overhead.run(peers=["none"], **args)
    with pytest.raises(Loaded):  # both off: the engine alone is measured
        engine_overhead.run(peers=["none"], plain=False, **args)


def test_one_engine_checks_devices_and_heads_and_keys_one_device_rows_as_before(no_load) -> None:
    with pytest.raises(ValueError, match="needs 999 devices"):
        common.one_engine("x", tensor_parallel_size=999)
    # SmolLM2's 3 KV heads do not split over 2 devices without padding: said before loading.
    with pytest.raises(ValueError, match="pad_heads"):
        common.one_engine("x", tensor_parallel_size=2)
    assert common.one_engine("x", tensor_parallel_size=2, pad_heads=True).point == {
        "tensor_parallel_size": 2, "pad_heads": True}
    single = common.one_engine("x")
    assert single.point == {} and single.parallel.is_single_device


@pytest.mark.parametrize("module", ["infer.cli", "infer.serve"])
def test_help_lists_the_parallel_flags(module: str) -> None:
    """absl's --help lists the main module's key flags only; the parallel flags are defined in
    infer.parallel.flags, so without being adopted they showed under --helpfull alone."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, check=False).stdout
    assert "--model" in out, out[:300]
    for name in PARALLEL_FLAGS:
        assert f"--{name}" in out or f"--[no]{name}" in out, (module, name)
