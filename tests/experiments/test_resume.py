"""The experiments' shared results log: a row is on disk the moment it is measured, so a crash
later loses nothing; --resume measures only the points missing from the file; tables and plots
come from the file. And the main job's peers: a missing package is one line before any work,
and `make run` installs what the default peers need."""

from __future__ import annotations

import json
import pathlib
import re
import tomllib

import pytest

from experiments import common, fragmentation
from experiments.common import ResultLog, read_jsonl, row_key

ENV = {"git": "test"}  # skips starting JAX for the environment record
REPO = pathlib.Path(__file__).parents[2]


class Crash(Exception):
    pass


def sweep(log: ResultLog, points: list[dict], measured: list[dict], crash_at: int | None = None
          ) -> list[dict]:
    """A fake experiment: measures each point (recording the call), crashing at `crash_at`."""
    def measure(point: dict) -> dict:
        if point["x"] == crash_at:
            raise Crash(point)
        measured.append(point)
        return {"y": point["x"] ** 2}

    for point in points:
        log.measure(point, lambda point=point: measure(point))
    return log.rows()


def test_a_row_survives_a_crash_and_resume_measures_only_the_rest(tmp_path) -> None:
    out = tmp_path / "sweep.jsonl"
    points = [{"experiment": "fake", "x": x} for x in range(4)]
    calls: list[dict] = []
    with pytest.raises(Crash):
        sweep(ResultLog(str(out), env=ENV), points, calls, crash_at=2)
    # Written before the crash, read back by a fresh process's reader.
    assert [r["x"] for r in read_jsonl(str(out))] == [0, 1]
    assert all(r["key"] == row_key(p) for r, p in zip(read_jsonl(str(out)), points))

    calls.clear()
    rows = sweep(ResultLog(str(out), resume=True, env=ENV), points, calls)
    assert [p["x"] for p in calls] == [2, 3]
    assert [(r["x"], r["y"]) for r in rows] == [(0, 0), (1, 1), (2, 4), (3, 9)]
    assert len(read_jsonl(str(out))) == 4  # nothing measured twice

    calls.clear()  # all there: a resumed run measures nothing
    assert sweep(ResultLog(str(out), resume=True, env=ENV), points, calls) == rows
    assert calls == []


def test_rows_are_this_runs_points_not_the_whole_file(tmp_path) -> None:
    out = tmp_path / "sweep.jsonl"
    # An older run's row without a key (committed results predate keys) and another sweep's.
    out.write_text(json.dumps({"experiment": "fake", "x": 1, "y": -1}) + "\n")
    sweep(ResultLog(str(out), env=ENV), [{"experiment": "fake", "x": 9}], [])
    calls: list[dict] = []
    points = [{"experiment": "fake", "x": x} for x in (2, 1)]
    rows = sweep(ResultLog(str(out), resume=True, env=ENV), points, calls)
    assert [p["x"] for p in calls] == [2, 1]  # an unkeyed row is never taken for a point
    assert [(r["x"], r["y"]) for r in rows] == [(2, 4), (1, 1)]  # in this run's order
    # Without --resume every point is measured again; the newest row of a point stands.
    calls.clear()
    rows = sweep(ResultLog(str(out), env=ENV), points, calls)
    assert len(calls) == 2 and len(rows) == 2 and len(read_jsonl(str(out))) == 6
    # Another configuration is another key: a float 1.0 is not the int 1.
    assert row_key({"x": 1}) != row_key({"x": 1.0}) and row_key({"a": 1, "b": 2}) == row_key(
        {"b": 2, "a": 1})


def test_a_line_cut_short_is_skipped_and_the_next_row_starts_its_own(tmp_path, capsys) -> None:
    out = tmp_path / "sweep.jsonl"
    points = [{"experiment": "fake", "x": x} for x in range(3)]
    sweep(ResultLog(str(out), env=ENV), points[:1], [])
    with open(out, "a") as f:  # a writer killed mid-row
        f.write('{"experiment": "fake", "x": 1, "y"')
    calls: list[dict] = []
    rows = sweep(ResultLog(str(out), resume=True, env=ENV), points, calls)
    assert [p["x"] for p in calls] == [1, 2]
    assert [r["x"] for r in rows] == [0, 1, 2]
    assert "not JSON" in capsys.readouterr().out
    assert [r["x"] for r in read_jsonl(str(out))] == [0, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_resume_keeps_only_this_machines_rows_that_did_not_fail(tmp_path, capsys, seed) -> None:
    """Random stored rows, each from this machine or another (one MACHINE field differs), some
    failed: a resumed run measures again exactly the failed and the foreign ones, and says so,
    naming the revisions of the rows it kept."""
    import random

    rng = random.Random(seed)
    here = {"git": "new", "backend": "cpu", "device": "cpu", "num_devices": 1, "cpu": "EPYC",
            "cpu_count": 2, "jax": "0.10.2"}
    out = tmp_path / "sweep.jsonl"
    points = [{"experiment": "fake", "x": x} for x in range(12)]
    expected_again = []
    with open(out, "w") as f:
        for point in points:
            env = dict(here, git=rng.choice(["old", "new"]))
            foreign = rng.random() < 0.3
            if foreign:
                field = rng.choice(common.MACHINE)
                env[field] = "elsewhere"
            row = {**point, "key": row_key(point), "y": -1, "env": env}
            if rng.random() < 0.3:
                row["error"] = "JaxRuntimeError: RESOURCE_EXHAUSTED"
            if foreign or "error" in row:
                expected_again.append(point["x"])
            f.write(json.dumps(row) + "\n")
    calls: list[dict] = []
    rows = sweep(ResultLog(str(out), resume=True, env=here), points, calls)
    assert [p["x"] for p in calls] == expected_again
    assert all((r["y"] == -1) == (r["x"] not in expected_again) for r in rows)
    assert all("error" not in r and r["env"]["cpu_count"] == 2 for r in rows
               if r["x"] in expected_again)
    line = capsys.readouterr().out
    assert f"12 measured points in {out}: {12 - len(expected_again)} kept" in line


FRAGMENTATION = dict(num_requests=40, rate=2.0, prompt_dist="uniform", prompt_min=8,
                     prompt_max=64, prompt_median=32, prompt_sigma=1.0, output_shape=1.5,
                     output_scale=8, output_cap=64, max_model_len=128, kv_tokens=2048,
                     page_sizes=[8, 16, 32], seed=0)


def test_an_experiment_resumes_after_a_crash(tmp_path, monkeypatch) -> None:
    """fragmentation.run through the shared log: the points simulated before a crash are kept,
    the resumed run simulates only the others, and the table's rows and the plot (beside
    --out) cover them all."""
    out = tmp_path / "frag" / "fragmentation.jsonl"
    real = fragmentation.simulate
    calls = []

    def simulate(requests, *, page_size, **kw):
        if page_size == 16 and not calls_allowed[0]:
            raise Crash(page_size)
        calls.append(page_size)
        return real(requests, page_size=page_size, **kw)

    calls_allowed = [False]
    monkeypatch.setattr(fragmentation, "simulate", simulate)
    with pytest.raises(Crash):
        fragmentation.run(**FRAGMENTATION, out=str(out))
    assert [r["page_size"] for r in read_jsonl(str(out))] == [128, 8]  # contiguous, then G=8
    assert not out.with_suffix(".png").exists()

    calls.clear()
    calls_allowed[0] = True
    rows = fragmentation.run(**FRAGMENTATION, out=str(out), resume=True)
    assert calls == [16, 32]
    assert [(r["policy"], r["page_size"]) for r in rows] == [
        ("contiguous", 128), ("paged", 8), ("paged", 16), ("paged", 32)]
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_skips_a_peer_without_its_packages_before_any_work(tmp_path, monkeypatch,
                                                                 capsys) -> None:
    import infer.io.loader
    from experiments import serve

    real = common.importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(infer.io.loader, "load_on_host", load)
    args = dict(num_requests=2, rate=1.0, prompt_min=4, prompt_max=8, output_shape=1.5,
                output_scale=2.0, output_cap=4, max_num_seqs=2, max_prefill_tokens=16,
                max_model_len=64, dtype="float32", kv_cache_dtype="auto", policies=["static"],
                seed=0, out=str(tmp_path / "serve.jsonl"))
    with pytest.raises(Loaded):  # the check ran, then the work began
        serve.run(peers=["hf", "llamacpp"], **args)
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipping" in line]
    assert lines == ["[serve] skipping peer 'llamacpp': llama_cpp not installed "
                     "(add it with: pip install -e \".[llamacpp]\")"]
    assert not (tmp_path / "serve.jsonl").exists()
    assert common.usable_peers(["hf", "none"], "serve") == ["hf"]  # torch is installed here
    with pytest.raises(ValueError, match="unknown peers"):
        serve.run(peers=["hf", "vllm"], **args)


def test_make_run_installs_the_default_peers_packages() -> None:
    """Each default peer of the main job names an extra of pyproject.toml that `make run`
    installs, and that extra holds the packages the peer's modules come from; the test extra
    reuses it."""
    from experiments import serve

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    makefile = (REPO / "Makefile").read_text()
    run_stamp = re.search(r"^\$\(VENV\)/\.installed-run:.*?(?=^\S)", makefile, re.M | re.S)
    assert run_stamp and re.search(r"^run: \$\(VENV\)/\.installed-run", makefile, re.M)
    installed = set(re.findall(r'pip install -q -e "\.\[([^\]]*)\]"', run_stamp.group(0))[0]
                    .split(","))
    package = {"torch": "torch", "transformers": "transformers", "llama_cpp": "llama-cpp-python"}
    for peer in serve.FLAGS["peers"].default:
        extra, modules = common.PEERS[peer]
        assert extra in installed, (peer, extra)
        names = {re.split(r"[=<>\[ ]", req)[0] for req in extras[extra]}
        assert {package[m] for m in modules} <= names, (peer, extras[extra])
    self_extras = next(r for r in extras["test"] if r.startswith("infer["))
    assert "torch==2.13.0" in extras["hf"] and "hf" in self_extras[6:-1].split(",")
    assert "$(ARGS)" in makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
