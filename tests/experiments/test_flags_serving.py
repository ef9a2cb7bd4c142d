"""The serving experiments (serve, bench_serve, startup) refuse bad flags up front, naming the
flag: at parse time, or at the top of `run` for what several flags decide together, before any
model loads, server starts or measurement is made."""

from __future__ import annotations

import json
import time

import pytest

from experiments import bench_serve, serve, startup
from tests.experiments.flags_util import parses, refusal


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    return path


@pytest.mark.parametrize("mod", [serve, bench_serve, startup])
def test_the_defaults_parse(mod) -> None:
    parses(mod.FLAGS)


@pytest.mark.parametrize("argv, flag", [
    ("--num_requests=0", "--num_requests"),
    ("--rate=0", "--rate"),
    ("--rate=-1", "--rate"),
    ("--rate=nan", "--rate"),
    ("--prompt_min=0", "--prompt_min"),
    ("--prompt_max=0", "--prompt_max"),
    ("--output_shape=0", "--output_shape"),
    ("--output_scale=0.5", "--output_scale"),
    ("--output_cap=0", "--output_cap"),
    ("--max_num_seqs=0", "--max_num_seqs"),
    ("--max_prefill_tokens=0", "--max_prefill_tokens"),
    ("--max_model_len=0", "--max_model_len"),
    ("--seed=-1", "--seed"),
    ("--policies=static,contnuous", "--policies"),
    ("--peers=hf,llama", "--peers"),
])
def test_serve_refuses_at_parse(argv: str, flag: str) -> None:
    assert flag in refusal(serve.FLAGS, argv)


def test_serve_parses_what_it_serves() -> None:
    parses(serve.FLAGS, "--policies=continuous+mixed,static", "--peers=none", "--rate=inf",
           "--output_scale=1")
    parses(serve.FLAGS, "--policies=", "--peers=hf,llamacpp,llamaserver")


def test_serve_out_below_a_file_is_refused_at_parse(a_file) -> None:
    assert "which is a file" in refusal(serve.FLAGS, f"--out={a_file}/x.jsonl")


_SERVE = dict(num_requests=8, rate=8.0, prompt_min=16, prompt_max=128, output_shape=1.5,
              output_scale=20.0, output_cap=256, max_num_seqs=4, max_prefill_tokens=64,
              max_model_len=512, dtype="float32", kv_cache_dtype="auto",
              policies=["continuous"], peers=["none"], seed=0)


@pytest.mark.parametrize("change, match", [
    # A prompt of prompt_max tokens asking for output_cap: the engine's limit, met after warm-up.
    (dict(prompt_min=200, prompt_max=300, max_model_len=128),
     r"--prompt_max \+ --output_cap must be <= --max_model_len"),
    (dict(prompt_max=128, output_cap=385, max_model_len=512), r"128 \+ 385 > 512"),
    (dict(prompt_min=64, prompt_max=32), "--prompt_min must be <= --prompt_max"),
])
def test_serve_refuses_requests_that_cannot_fit_before_any_load(change, match,
                                                                 tmp_path) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        serve.run(**{**_SERVE, **change}, out=str(tmp_path / "serve.jsonl"))
    assert time.perf_counter() - start < 1.0
    assert not (tmp_path / "serve.jsonl").exists()


@pytest.mark.parametrize("argv, flag", [
    ("--servers=inprocess,infr", "--servers"),
    ("--servers=", "--servers"),
    ("--servers=url=", "--servers"),
    ("--num_prompts=0", "--num_prompts"),
    ("--request_rate=0", "--request_rate"),
    ("--request_rate=nan", "--request_rate"),
    ("--burstiness=0", "--burstiness"),
    ("--burstiness=inf", "--burstiness"),
    ("--max_concurrency=0", "--max_concurrency"),
    ("--random_input_len=0", "--random_input_len"),
    ("--random_output_len=0", "--random_output_len"),
    ("--random_range_ratio=1", "--random_range_ratio"),
    ("--random_range_ratio=-0.1", "--random_range_ratio"),
    ("--seed=-1", "--seed"),
    ("--metric_percentiles=50,101", "--metric_percentiles"),
    ("--metric_percentiles=p99", "--metric_percentiles"),
    ("--max_num_seqs=0", "--max_num_seqs"),
    ("--max_model_len=0", "--max_model_len"),
    ("--max_prefill_tokens=0", "--max_prefill_tokens"),
])
def test_bench_serve_refuses_at_parse(argv: str, flag: str) -> None:
    assert flag in refusal(bench_serve.FLAGS, argv)


def test_bench_serve_parses_what_it_serves() -> None:
    parses(bench_serve.FLAGS, "--servers=infer,llamaserver,inprocess,url=http://127.0.0.1:8000",
           "--request_rate=inf", "--metric_percentiles=", "--max_concurrency=1",
           "--random_range_ratio=0.5")
    parses(bench_serve.FLAGS, "--out=")  # no file: the table only, as run(out="") takes it


def test_serve_checks_lengths_only_where_a_server_limits_them(monkeypatch, tmp_path) -> None:
    """HF's generate has no max_model_len: a run of that peer alone with long outputs served
    before the length check and must still reach the model's load."""
    import experiments.common

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(experiments.common, "one_engine", load)
    with pytest.raises(Loaded):
        serve.run(**{**_SERVE, "output_cap": 1024, "policies": [], "peers": ["hf"]},
                  out=str(tmp_path / "serve.jsonl"))
    with pytest.raises(ValueError, match="--max_model_len"):
        serve.run(**{**_SERVE, "output_cap": 1024, "policies": [], "peers": ["llamacpp"]},
                  out=str(tmp_path / "serve.jsonl"))


def test_bench_serve_out_below_a_file_is_refused_at_parse_and_in_run(a_file) -> None:
    assert "which is a file" in refusal(bench_serve.FLAGS, f"--out={a_file}/x.jsonl")
    with pytest.raises(ValueError, match="which is a file"):
        bench_serve.run(["inprocess"], out=f"{a_file}/x.jsonl")


def _never(monkeypatch) -> None:
    """Every way of loading or benchmarking made to fail: for what must be refused first."""
    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    import infer.io.loader
    monkeypatch.setattr(bench_serve, "run_schedule", never)
    monkeypatch.setattr(bench_serve, "in_process", never)
    monkeypatch.setattr(bench_serve, "launched", never)
    monkeypatch.setattr(infer.io.loader, "load_on_host", never)


def test_bench_serve_refuses_an_unknown_server_before_any_other(monkeypatch) -> None:
    _never(monkeypatch)
    with pytest.raises(ValueError, match="unknown server 'infr'"):
        bench_serve.run(["inprocess", "infr"], out="")


@pytest.mark.parametrize("servers", [["infer"], ["inprocess"], ["llamaserver"]])
def test_bench_serve_refuses_lengths_past_its_servers_context(servers, monkeypatch) -> None:
    _never(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"--random_input_len \+ --random_output_len must be "
                                         r"<= --max_model_len"):
        bench_serve.run(servers, random_input_len=200, max_model_len=128, out="")
    # The range's top end counts: 64 * 1.5 + 32 * 1.5 = 144.
    with pytest.raises(ValueError, match=r"96 \+ 48 tokens"):
        bench_serve.run(servers, random_range_ratio=0.5, max_model_len=128, out="")
    assert time.perf_counter() - start < 1.0


def _replay(tmp_path, text: str) -> str:
    path = tmp_path / "replay.jsonl"
    path.write_text(text)
    return str(path)


def test_bench_serve_refuses_a_replayed_request_past_the_context(monkeypatch, tmp_path) -> None:
    _never(monkeypatch)
    schedule = [dict(offset_s=0.0, prompt="x", prompt_len=100, output_len=29)]
    path = _replay(tmp_path, json.dumps({"model": "stub", "schedule": schedule}) + "\n")
    with pytest.raises(ValueError, match="--replay schedule needs 129 tokens"):
        bench_serve.run(["infer"], model="stub", replay=path, max_model_len=128, out="")


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("\n", "is empty"),
    ("not json\n", "first line is not JSON"),
    ('{"model": "stub"}\n', "holds no schedule"),
    ('{"model": "stub", "schedule": []}\n', "holds no schedule"),
    ('[1, 2]\n', "holds no schedule"),
    ('{"model": "stub", "schedule": [{"offset_s": 0.0}]}\n', "schedule entry 0"),
])
def test_bench_serve_refuses_a_replay_without_a_schedule(text, match, monkeypatch,
                                                         tmp_path) -> None:
    _never(monkeypatch)
    path = _replay(tmp_path, text)
    with pytest.raises(ValueError, match=match) as error:
        bench_serve.run(["url=http://127.0.0.1:1"], model="stub", replay=path, out="")
    assert "--replay" in str(error.value)


@pytest.mark.parametrize("argv, flag", [
    ("--modes=eagr", "--modes"),
    ("--modes=lazy,eagr", "--modes"),
    ("--modes=", "--modes"),
    ("--max_num_seqs=0", "--max_num_seqs"),
    ("--max_model_len=0", "--max_model_len"),
    ("--max_tokens=0", "--max_tokens"),
])
def test_startup_refuses_at_parse(argv: str, flag: str) -> None:
    assert flag in refusal(startup.FLAGS, argv)


def test_startup_out_below_a_file_is_refused_at_parse(a_file) -> None:
    assert "which is a file" in refusal(startup.FLAGS, f"--out={a_file}/x.jsonl")


def test_startup_refuses_an_unknown_mode_in_run(tmp_path) -> None:
    """The child compiled lazily for any mode but "warmup", under the misspelt label."""
    with pytest.raises(ValueError, match="--modes"):
        startup.run(modes=["eagr"], dtype="float32", max_num_seqs=1, max_model_len=64,
                    max_tokens=1, out=str(tmp_path / "startup.jsonl"))
    assert not (tmp_path / "startup.jsonl").exists()


def test_a_failed_startup_child_says_why(monkeypatch, tmp_path) -> None:
    """A failed child raised CalledProcessError quoting the child's whole script, its error
    kept in the captured stderr."""
    import subprocess
    import types

    import experiments.common

    def failed(*args, **kwargs):
        return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback ...\n"
                                     "ValueError: max_num_seqs must be an int >= 1, got 0\n")

    monkeypatch.setattr(subprocess, "run", failed)
    monkeypatch.setattr(experiments.common, "environment", dict)
    with pytest.raises(RuntimeError, match="max_num_seqs must be an int >= 1") as error:
        startup.run(modes=["lazy"], dtype="float32", max_num_seqs=0, max_model_len=64,
                    max_tokens=1, out=str(tmp_path / "startup.jsonl"))
    assert "import json, sys, time" not in str(error.value)  # not the child's script
