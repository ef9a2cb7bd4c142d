"""The timing experiments refuse bad flags before any work: at parse time (absl bounds, list and
output validators), or at the top of `run` where flags meet (no model load, no timing)."""

from __future__ import annotations

import pytest

from experiments import (attention_cpu, decode_speed, dense_cpu, device_check, engine_overhead,
                         int4_keys, kv_dtypes, profile_step, roofline, sampler_cost,
                         structured_cost, verify_cost)
from tests.experiments.flags_util import parses, refusal

MODULES = [attention_cpu, decode_speed, dense_cpu, device_check, engine_overhead, int4_keys,
           kv_dtypes, profile_step, roofline, sampler_cost, structured_cost, verify_cost]


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_defaults_parse(mod) -> None:
    parses(mod.FLAGS)


@pytest.fixture
def a_file(tmp_path) -> str:
    path = tmp_path / "file"
    path.write_text("")
    return str(path)


# (module, argv, the flag the message must name)
REFUSED = [
    (attention_cpu, ["--contexts=0"], "--contexts"),
    (attention_cpu, ["--batch_sizes=0"], "--batch_sizes"),
    (attention_cpu, ["--queries=0"], "--queries"),
    (attention_cpu, ["--layers=0"], "--layers"),
    (attention_cpu, ["--page_size=0"], "--page_size"),
    (attention_cpu, ["--calls=0"], "--calls"),
    (attention_cpu, ["--repeats=0"], "--repeats"),
    (attention_cpu, ["--dtypes=float32,bflaot16"], "--dtypes"),
    (dense_cpu, ["--layers=0"], "--layers"),
    (dense_cpu, ["--rows=0"], "--rows"),
    (dense_cpu, ["--calls=0"], "--calls"),
    (dense_cpu, ["--repeats=0"], "--repeats"),
    (sampler_cost, ["--repeats=0"], "--repeats"),
    (sampler_cost, ["--calls=0"], "--calls"),
    (sampler_cost, ["--batch_sizes=0"], "--batch_sizes"),
    (sampler_cost, ["--temperature=0"], "--temperature"),
    (sampler_cost, ["--temperature=-0.5"], "--temperature"),
    (sampler_cost, ["--vocab_size=0"], "--vocab_size"),
    (decode_speed, ["--tokens=0"], "--tokens"),
    (decode_speed, ["--prompt_len=0"], "--prompt_len"),
    (decode_speed, ["--batch_sizes=0"], "--batch_sizes"),
    (decode_speed, ["--repeats=0"], "--repeats"),
    (roofline, ["--batch_sizes=0", "--prefill_lengths="], "--batch_sizes"),
    (roofline, ["--prefill_lengths=0"], "--prefill_lengths"),
    (roofline, ["--prefill_batch=0"], "--prefill_batch"),
    (roofline, ["--context=-1"], "--context"),
    (roofline, ["--repeats=0"], "--repeats"),
    (roofline, ["--steps_per_sample=0"], "--steps_per_sample"),
    (kv_dtypes, ["--decode_tokens=0"], "--decode_tokens"),
    (kv_dtypes, ["--eval_tokens=0"], "--eval_tokens"),
    (kv_dtypes, ["--chunk=0"], "--chunk"),
    (kv_dtypes, ["--page_size=0"], "--page_size"),
    (kv_dtypes, ["--batch_sizes=0"], "--batch_sizes"),
    (int4_keys, ["--eval_tokens=0"], "--eval_tokens"),
    (int4_keys, ["--calibration_tokens=0"], "--calibration_tokens"),
    (verify_cost, ["--ks=0"], "--ks"),
    (verify_cost, ["--context=-1"], "--context"),
    (verify_cost, ["--window=0"], "--window"),
    (verify_cost, ["--repeats=0"], "--repeats"),
    (structured_cost, ["--repeats=0"], "--repeats"),
    (structured_cost, ["--batch_sizes=0"], "--batch_sizes"),
    (structured_cost, ["--constraints=none,yaml"], "--constraints"),
    (structured_cost, ["--tokens=3"], "--tokens"),
    (structured_cost, ["--prompt_len=0"], "--prompt_len"),
    (structured_cost, ["--layers=-1"], "--layers"),
    (profile_step, ["--tokens=0"], "--tokens"),
    (profile_step, ["--batch=0"], "--batch"),
    (profile_step, ["--prompt_len=0"], "--prompt_len"),
    (engine_overhead, ["--batch_sizes="], "--batch_sizes"),
    (engine_overhead, ["--batch_sizes=0"], "--batch_sizes"),
    (engine_overhead, ["--dtypes="], "--dtypes"),
    (engine_overhead, ["--dtypes=float16"], "--dtypes"),
    (engine_overhead, ["--tokens=3"], "--tokens"),
    (engine_overhead, ["--prompt_len=0"], "--prompt_len"),
    (engine_overhead, ["--repeats=0"], "--repeats"),
    (device_check, ["--quick", "--repeats=0"], "--repeats"),
    (device_check, ["--quick", "--copy_mb=0"], "--copy_mb"),
    (device_check, ["--quick", "--matmul_n=0"], "--matmul_n"),
]


@pytest.mark.parametrize("mod, argv, flag", REFUSED,
                         ids=[f"{m.__name__.split('.')[-1]}:{' '.join(a)}" for m, a, _ in REFUSED])
def test_bad_flag_refused_at_parse(mod, argv, flag) -> None:
    assert flag in refusal(mod.FLAGS, *argv)


OUT_FLAGS = [attention_cpu, dense_cpu, sampler_cost, decode_speed, roofline, kv_dtypes,
             int4_keys, verify_cost, structured_cost, engine_overhead]


@pytest.mark.parametrize("mod", OUT_FLAGS, ids=lambda m: m.__name__.split(".")[-1])
def test_out_below_a_file_refused_at_parse(mod, a_file) -> None:
    assert "--out" in refusal(mod.FLAGS, f"--out={a_file}/x.jsonl")


@pytest.mark.parametrize("mod", OUT_FLAGS, ids=lambda m: m.__name__.split(".")[-1])
def test_out_a_directory_refused_at_parse(mod, tmp_path) -> None:
    assert "--out" in refusal(mod.FLAGS, f"--out={tmp_path}")


def test_roofline_one_sweep_may_be_empty() -> None:
    parses(roofline.FLAGS, "--prefill_lengths=")
    parses(roofline.FLAGS, "--batch_sizes=")


# run()-level checks where flags meet: refused before any model load or timing.


@pytest.fixture(autouse=True)
def no_work(monkeypatch) -> None:
    """Any model load, engine, ceiling or timing fails the test: a refusal must come first."""
    import experiments.common
    import infer.io.loader

    def work(*args, **kwargs):
        raise AssertionError("work began before the flags were refused")

    for module, name in [(infer.io.loader, "load"), (infer.io.loader, "load_on_host"),
                         (experiments.common, "measure_ceilings"),
                         (experiments.common, "interleaved_medians"),
                         (experiments.common, "one_engine")]:
        monkeypatch.setattr(module, name, work)


def _attention(tmp_path, **kw):
    args = dict(batch_sizes=["1"], contexts=["128"], queries=["1"], dtypes=["float32"],
                layers=1, page_size=16, calls=1, repeats=1, out=str(tmp_path / "a.jsonl"))
    return attention_cpu.run(**{**args, **kw})


@pytest.mark.parametrize("page_size, contexts", [(48, ["128"]), (256, ["64"]),
                                                 (48, ["64", "1024"])])
def test_attention_cpu_refuses_a_window_of_partial_pages(tmp_path, page_size, contexts) -> None:
    with pytest.raises(ValueError, match="--page_size must divide"):
        _attention(tmp_path, page_size=page_size, contexts=contexts)
    assert not (tmp_path / "a.jsonl").exists()


def test_roofline_refuses_both_sweeps_empty(tmp_path) -> None:
    with pytest.raises(ValueError, match="--batch_sizes and --prefill_lengths"):
        roofline.run(batch_sizes=[], prefill_lengths=[], prefill_batch=1, context=128,
                     dtype="float32", kv_dtype="float32", repeats=1, steps_per_sample=1,
                     knee_factor=1.5, out=str(tmp_path / "r.jsonl"))


def _verify(tmp_path, **kw):
    args = dict(dtype="float32", ks=["1"], context=200, window=256, repeats=1, engine=False,
                hlo=False, out=str(tmp_path / "v.jsonl"))
    return verify_cost.run(**{**args, **kw})


@pytest.mark.parametrize("ks, context, window", [(["1"], 1000, 128), (["1", "4"], 252, 256)])
def test_verify_cost_refuses_a_context_past_the_window(tmp_path, ks, context, window) -> None:
    with pytest.raises(ValueError, match=r"--context \+ max\(--ks\) \+ 1 must be <= --window"):
        _verify(tmp_path, ks=ks, context=context, window=window)


def test_verify_cost_checks_its_output_path_first(a_file) -> None:
    with pytest.raises(ValueError, match="which is a file"):
        verify_cost.run(dtype="float32", ks=["1"], context=200, window=256, repeats=1,
                        engine=False, hlo=False, out=f"{a_file}/x.jsonl")


def test_structured_cost_refuses_zero_repeats(tmp_path) -> None:
    with pytest.raises(ValueError, match="repeats"):
        structured_cost.run(batch_sizes=[1], constraints=["none"], tokens=5, prompt_len=16,
                            repeats=0, layers=2, out=str(tmp_path / "s.jsonl"))


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(copy_mb=0), dict(matmul_n=0)])
def test_device_check_refuses_before_any_device_call(tmp_path, bad) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(bad))}=0"):
        device_check.run(quick=True, out_dir=str(tmp_path), **bad)
    assert not list(tmp_path.iterdir())


def test_device_check_refuses_an_out_dir_below_a_file(a_file) -> None:
    with pytest.raises(ValueError, match="which is a file"):
        device_check.run(quick=True, out_dir=f"{a_file}/results")
