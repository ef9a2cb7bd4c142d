"""The simulated-workload and arithmetic experiments (fragmentation, memory_budget, scaling,
prefix_cache) refuse bad flags before any work: at parse time (absl bounds, list and output
validators), or at the top of `run` where flags meet (no model load, no row written)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import fragmentation, memory_budget, prefix_cache, scaling
from experiments.workloads import poisson_pareto
from tests.experiments.flags_util import parses, refusal

MODULES = [fragmentation, memory_budget, scaling, prefix_cache]


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_defaults_parse(mod) -> None:
    parses(mod.FLAGS)


# (module, argv, the flag the message must name)
REFUSED = [
    (fragmentation, ["--num_requests=0"], "--num_requests"),
    (fragmentation, ["--page_sizes=0"], "--page_sizes"),
    (fragmentation, ["--page_sizes=16,x"], "--page_sizes"),
    (fragmentation, ["--output_cap=0"], "--output_cap"),
    (fragmentation, ["--output_scale=-20"], "--output_scale"),
    (fragmentation, ["--output_scale=0"], "--output_scale"),
    (fragmentation, ["--output_shape=0"], "--output_shape"),
    (fragmentation, ["--prompt_median=0"], "--prompt_median"),
    (fragmentation, ["--prompt_median=-5"], "--prompt_median"),
    (fragmentation, ["--prompt_sigma=-1"], "--prompt_sigma"),
    (fragmentation, ["--rate=0"], "--rate"),
    (fragmentation, ["--prompt_min=0"], "--prompt_min"),
    (fragmentation, ["--kv_tokens=0"], "--kv_tokens"),
    (fragmentation, ["--seed=-1"], "--seed"),
    (memory_budget, ["--gpus=0"], "--gpus"),
    (memory_budget, ["--overhead_fraction=1.5"], "--overhead_fraction"),
    (memory_budget, ["--overhead_fraction=1"], "--overhead_fraction"),
    (memory_budget, ["--overhead_fraction=-0.1"], "--overhead_fraction"),
    (memory_budget, ["--gpu_memory_gb=-80"], "--gpu_memory_gb"),
    (memory_budget, ["--contexts="], "--contexts"),
    (memory_budget, ["--contexts=0"], "--contexts"),
    (memory_budget, ["--models="], "--models"),
    (memory_budget, ["--models=llama-3-8b,llama-9"], "--models"),
    (memory_budget, ["--kv_formats="], "--kv_formats"),
    (memory_budget, ["--kv_formats=float16,int3"], "--kv_formats"),
    (memory_budget, ["--weight_dtype=foo"], "--weight_dtype"),
    (scaling, ["--measure=none", "--tensor_parallel=1,2", "--data_parallel=0"],
     "--data_parallel"),
    (scaling, ["--tensor_parallel=0"], "--tensor_parallel"),
    (scaling, ["--batch=-64"], "--batch"),
    (scaling, ["--context=0"], "--context"),
    (scaling, ["--measure_rows=0"], "--measure_rows"),
    (scaling, ["--models=foo"], "--models"),
    (scaling, ["--kv_formats=int3"], "--kv_formats"),
    (scaling, ["--weight_dtype=foo"], "--weight_dtype"),
    (scaling, ["--overhead_fraction=1"], "--overhead_fraction"),
    (scaling, ["--measure=tiny:0:1:int8"], "--measure"),
    (scaling, ["--measure=tiny:2:1"], "--measure"),
    (scaling, ["--measure=tiny:two:1:int8"], "--measure"),
    (scaling, ["--measure=llama-9:2:1:int8"], "--measure"),
    (scaling, ["--measure=tiny:2:1:int3"], "--measure"),
    (prefix_cache, ["--alone_shared_fraction=-0.5"], "--alone_shared_fraction"),
    (prefix_cache, ["--alone_shared_fraction=1.5"], "--alone_shared_fraction"),
    (prefix_cache, ["--alone_requests=0"], "--alone_requests"),
    (prefix_cache, ["--alone_page_size=0"], "--alone_page_size"),
    (prefix_cache, ["--alone_prefixes=0"], "--alone_prefixes"),
    (prefix_cache, ["--alone_prefix_tokens=128,64"], "--alone_prefix_tokens"),
    (prefix_cache, ["--alone_prefix_tokens=-10,0"], "--alone_prefix_tokens"),
    (prefix_cache, ["--alone_prefix_tokens=64"], "--alone_prefix_tokens"),
    (prefix_cache, ["--alone_prefix_tokens=64,128,256"], "--alone_prefix_tokens"),
    (prefix_cache, ["--alone_suffix_tokens=256,16"], "--alone_suffix_tokens"),
    (prefix_cache, ["--alone_suffix_tokens=-1,16"], "--alone_suffix_tokens"),
    (prefix_cache, ["--alone_suffix_tokens=16"], "--alone_suffix_tokens"),
    (prefix_cache, ["--alone_max_pages=-1"], "--alone_max_pages"),
    (prefix_cache, ["--parts=alone,sytem"], "--parts"),
    (prefix_cache, ["--parts="], "--parts"),
    (prefix_cache, ["--system_requests=0"], "--system_requests"),
    (prefix_cache, ["--system_prompt_tokens=0"], "--system_prompt_tokens"),
    (prefix_cache, ["--system_rate=0"], "--system_rate"),
    (prefix_cache, ["--chat_conversations=0"], "--chat_conversations"),
    (prefix_cache, ["--chat_turns=0"], "--chat_turns"),
    (prefix_cache, ["--max_tokens=0"], "--max_tokens"),
    (prefix_cache, ["--seed=-1"], "--seed"),
]


@pytest.mark.parametrize("mod, argv, flag", REFUSED,
                         ids=[f"{m.__name__.split('.')[-1]}{' '.join(a)}" for m, a, _ in REFUSED])
def test_bad_flags_are_refused_at_parse(mod, argv, flag) -> None:
    assert flag in refusal(mod.FLAGS, *argv)


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_an_output_path_that_is_a_directory_is_refused(mod, tmp_path) -> None:
    assert "--out" in refusal(mod.FLAGS, f"--out={tmp_path}")


# Valid values at the edges of the new bounds still parse.
ACCEPTED = [
    (fragmentation, ["--prompt_sigma=0", "--page_sizes=1", "--seed=0"]),
    (memory_budget, ["--overhead_fraction=0", "--weight_dtype=bf16", "--gpu_memory_gb=0",
                     "--kv_formats=fp8,int4_kivi,bfloat16", "--contexts=1"]),
    (scaling, ["--measure=none", "--models=tiny-3kv,tiny"]),
    # No analytic sweep: the measured points alone (test_scaling runs it so).
    (scaling, ["--measure=tiny:2:1:int8", "--models=", "--tensor_parallel=", "--data_parallel="]),
    (fragmentation, ["--page_sizes="]),  # the contiguous reservation alone
    (scaling, ["--measure=tiny-3kv:8:1:bfloat16,tiny:2:2:fp8", "--weight_dtype=float32"]),
    (prefix_cache, ["--alone_shared_fraction=0", "--alone_suffix_tokens=0,0",
                    "--alone_prefix_tokens=8,8", "--alone_max_pages="]),
    (prefix_cache, ["--alone_shared_fraction=1", "--alone_max_pages=0,500", "--parts=chat"]),
]


@pytest.mark.parametrize("mod, argv", ACCEPTED,
                         ids=[f"{m.__name__.split('.')[-1]}{' '.join(a)}" for m, a in ACCEPTED])
def test_valid_edges_parse(mod, argv) -> None:
    parses(mod.FLAGS, *argv)


FRAGMENTATION = dict(num_requests=40, rate=2.0, prompt_dist="uniform", prompt_min=8,
                     prompt_max=64, prompt_median=32, prompt_sigma=1.0, output_shape=1.5,
                     output_scale=8, output_cap=64, max_model_len=128, seed=0)


@pytest.mark.parametrize("kv_tokens, page_sizes", [(100, [8]), (130, [8, 100])])
def test_fragmentation_refuses_a_pool_short_of_one_request_before_any_row(
        tmp_path, kv_tokens, page_sizes) -> None:
    # 130 slots hold one 128-token request contiguously, but only one page of 100.
    out = tmp_path / "fragmentation.jsonl"
    with pytest.raises(ValueError, match="--kv_tokens .* --max_model_len"):
        fragmentation.run(**FRAGMENTATION, kv_tokens=kv_tokens, page_sizes=page_sizes,
                          out=str(out))
    assert not out.exists()


def test_prefix_cache_refuses_a_system_prompt_longer_than_the_engine_holds(tmp_path) -> None:
    out = tmp_path / "prefix_cache.jsonl"
    with pytest.raises(ValueError, match="--system_prompt_tokens \\+ --max_tokens"):
        prefix_cache.run(parts=["alone", "system"], alone_requests=10, alone_shared_fraction=0.5,
                         alone_prefixes=2, alone_prefix_tokens=(4, 8),
                         alone_suffix_tokens=(4, 8), alone_page_size=4, alone_max_pages=[8],
                         system_requests=2, system_prompt_tokens=2040, system_rate=1.0,
                         chat_conversations=1, chat_turns=1, max_tokens=16, seed=0,
                         out=str(out))
    assert not out.exists()


WORKLOAD = dict(num_requests=10, rate=1.0, prompt_min=8, prompt_max=64, output_shape=1.5,
                output_scale=10, output_cap=100)


@pytest.mark.parametrize("change, name", [
    (dict(output_cap=0), "output_cap"),
    (dict(output_scale=-20), "output_scale"),
    (dict(output_scale=0), "output_scale"),
    (dict(output_shape=0), "output_shape"),
    (dict(prompt_dist="lognormal", prompt_median=0, prompt_sigma=1.0), "prompt_median"),
    (dict(prompt_dist="lognormal", prompt_median=-5, prompt_sigma=1.0), "prompt_median"),
    (dict(prompt_dist="lognormal", prompt_median=32, prompt_sigma=-1.0), "prompt_sigma"),
])
def test_poisson_pareto_refuses_lengths_it_would_clamp(change, name) -> None:
    """Shared with serve.py: the old code clamped these to 1-token outputs or prompt_min-token
    prompts, or failed inside numpy."""
    with pytest.raises(ValueError, match=name):
        poisson_pareto(np.random.default_rng(0), **{**WORKLOAD, **change},
                       max_model_len=128)


def test_scaling_without_dp_1_writes_its_rows_and_draws_no_plot(tmp_path) -> None:
    """A valid sweep whose plot (DP = 1 alone) has no rows: the old code's matplotlib error
    came after its rows were written."""
    out = tmp_path / "scaling.jsonl"
    rows = scaling.run(models=["tiny"], tensor_parallel=[1, 2], data_parallel=[2],
                       kv_formats=["bfloat16"], weight_dtype="bfloat16", gpu_memory_gb=80.0,
                       overhead_fraction=0.1, context=64, batch=4, measure=["none"],
                       measure_rows=4, virtual_devices=8, out=str(out))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert out.exists() and not out.with_suffix(".png").exists()
