"""The pieces the experiment scripts share: flags to `run` arguments, the request generator, the
held-out split and the trainers' batches."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from absl import flags

from experiments.common import flag_kwargs
from experiments.training import batches, make_optimizer, training_split
from experiments.workloads import pareto_lengths, poisson_pareto, split_heldout


def test_flag_kwargs_converts_list_flags_to_the_annotation_and_skips_the_rest() -> None:
    fv = flags.FlagValues()
    flags.DEFINE_list("sizes", ["1", "8"], "", flag_values=fv)
    flags.DEFINE_list("temps", ["0", "0.7"], "", flag_values=fv)
    flags.DEFINE_list("pair", ["3", "4"], "", flag_values=fv)
    flags.DEFINE_list("names", ["a", "b"], "", flag_values=fv)
    flags.DEFINE_string("out", "x.jsonl", "", flag_values=fv)
    flags.DEFINE_integer("unused", 0, "", flag_values=fv)
    fv(["prog", "--sizes=2,4"])

    def run(*, sizes: list[int], temps: list[float], pair: tuple[int, int], names: list[str],
            out: str, loaded=None) -> None:
        pass

    assert flag_kwargs(run, fv) == {"sizes": [2, 4], "temps": [0.0, 0.7], "pair": (3, 4),
                                    "names": ["a", "b"], "out": "x.jsonl"}


def test_requests_are_deterministic_and_within_limits() -> None:
    kw = dict(num_requests=300, rate=2.0, prompt_min=8, prompt_max=200, output_shape=1.5,
              output_scale=10, output_cap=100)
    a = poisson_pareto(np.random.default_rng(1), **kw)
    b = poisson_pareto(np.random.default_rng(1), **kw)
    assert all((x == y).all() for x, y in zip(a, b))
    arrivals, prompts, outputs = a
    assert (np.diff(arrivals) >= 0).all() and arrivals[0] > 0
    assert prompts.min() >= 8 and prompts.max() <= 200
    assert outputs.min() >= 10 and outputs.max() <= 100  # Pareto's minimum is its scale
    _, prompts, outputs = poisson_pareto(np.random.default_rng(1), **kw, prompt_dist="lognormal",
                                         prompt_median=64, prompt_sigma=1.0, max_model_len=128)
    assert (prompts + outputs <= 128).all() and outputs.min() >= 1
    up = pareto_lengths(np.random.default_rng(2), 50, 1.5, 10, 1000, round_up=True)
    down = pareto_lengths(np.random.default_rng(2), 50, 1.5, 10, 1000)
    assert ((up - down >= 0) & (up - down <= 1)).all()


def test_heldout_split_is_fixed_and_disjoint() -> None:
    train, held = split_heldout(50)
    again_train, again_held = split_heldout(50)
    assert (train == again_train).all() and (held == again_held).all()
    assert held.size and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(50))
    assert len(split_heldout(3)[1]) == 1  # at least one held out


def test_heldout_split_agrees_between_files_of_any_size() -> None:
    # Files drawn from one prompt stream share their first rows: a row held out in one is held
    # out in every other (a 384-row file's split held out rows a 1,600-row file trained on).
    rng = np.random.default_rng(16)
    _, held_all = split_heldout(20_000)
    assert abs(len(held_all) / 20_000 - 0.1) < 0.01
    for n in rng.integers(30, 20_000, 12):
        train, held = split_heldout(int(n))
        assert list(held) == [i for i in held_all if i < n], n
        assert sorted([*train, *held]) == list(range(n))


def test_batches_pad_the_last_one_with_empty_rows() -> None:
    n, width = 5, 4
    data = {"tokens": np.arange(n * width).reshape(n, width), "hidden": np.ones((n, width, 2)),
            "lengths": np.full(n, width), "prompt_lens": np.ones(n, int)}
    out = list(batches(data, [0, 1, 2], 2))
    assert [b[0].shape for b in out] == [(2, width), (2, width)]
    assert out[1][2].tolist() == [width, 0]  # the padding row has length 0
    shuffled = list(batches(data, range(n), 2, np.random.default_rng(0)))
    assert sorted(int(r[0]) for b in shuffled for r, length in zip(b[0], b[2]) if length) == [
        0, 4, 8, 12, 16]


def test_max_sequences_keeps_the_whole_files_split(tmp_path) -> None:
    """A run over the first m sequences (`--max_sequences`) never trains on a sequence that a
    run over the whole file holds out, nor holds out one that run trains on: its split is the
    whole file's, restricted to the first m."""
    rng = np.random.default_rng(14)
    for n in rng.integers(20, 400, 6):
        path = str(tmp_path / f"data_{n}.npz")
        np.savez(path, tokens=np.zeros((n, 2), np.int32), hidden=np.zeros((n, 2, 1), np.float16),
                 lengths=np.full(n, 2, np.int32), prompt_lens=np.ones(n, np.int32),
                 meta=np.array(json.dumps({})))
        _, train, held = training_split(path, 0)
        assert sorted([*train, *held]) == list(range(n)) and not set(train) & set(held)
        for m in (*rng.integers(int(held.min()) + 1, n + 1, 4), n, n + 5):
            _, train_m, held_m = training_split(path, int(m))
            assert set(train_m) == {i for i in train if i < m}, (n, m)
            assert set(held_m) == {i for i in held if i < m}, (n, m)
        if held.min() > 0:  # the first rows hold no held-out one: refused, not an empty split
            with pytest.raises(ValueError, match="max_sequences"):
                training_split(path, int(held.min()))


def test_schedule_warms_up_for_the_steps_asked_only() -> None:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to 5% of lr by the last
    step; no warmup asked (or a one-step run): the first step already trains at lr."""
    rng = np.random.default_rng(15)
    for total in (1, 2, *rng.integers(3, 300, 8)):
        for warmup in (0, *rng.integers(1, total + 1, 2)):
            _, schedule = make_optimizer(lr=1e-3, total_steps=int(total),
                                         warmup_steps=int(warmup), weight_decay=0.0, clip=1.0)
            lrs = np.array([float(schedule(i)) for i in range(int(total))])
            w = min(int(warmup), int(total) - 1)
            ramp = 1e-3 * np.arange(w + 1) / w if w else np.array([1e-3])
            np.testing.assert_allclose(lrs[:w + 1], ramp, atol=1e-9, err_msg=f"{total} {warmup}")
            assert (lrs[w:] > 0).all() and (np.diff(lrs[w:]) <= 1e-9).all(), (total, warmup)


@pytest.mark.parametrize("repeats", [0, -1])
def test_timing_with_no_sample_is_refused_not_a_nan(repeats: int, tmp_path) -> None:
    """A median of no timings is NaN (numpy warns, then returns it): the row would be written
    with NaN step times and throughputs, and --resume would keep it."""
    from experiments import decode_speed, engine_overhead, roofline
    from experiments.common import first_and_step_time, interleaved_medians, median_time

    calls = []
    fn = lambda *args: calls.append(args) or 0.0
    with pytest.raises(ValueError, match="repeats"):
        median_time(fn, repeats=repeats)
    with pytest.raises(ValueError, match="repeats"):
        interleaved_medians({"f": fn}, (), repeats)
    with pytest.raises(ValueError, match="repeats"):
        first_and_step_time(fn, 4, repeats)
    with pytest.raises(ValueError, match="repeats"):
        roofline._time_steps(fn, repeats=repeats, steps_per_sample=4)
    with pytest.raises(ValueError, match="steps_per_sample"):
        roofline._time_steps(fn, repeats=3, steps_per_sample=repeats)
    assert not calls  # refused before any (untimed) call
    with pytest.raises(ValueError, match="repeats"):
        engine_overhead.run(batch_sizes=[1], dtypes=["float32"], tokens=8, prompt_len=16,
                            repeats=repeats, peers=["none"], out=str(tmp_path / "o.jsonl"))
    for run in (lambda: decode_speed.run(batch_sizes=[1], dtype="float32", tokens=8,
                                         prompt_len=16, repeats=repeats, peers=["none"],
                                         out=str(tmp_path / "d.jsonl")),
                lambda: roofline.run(batch_sizes=[1], prefill_lengths=[16], prefill_batch=1,
                                     context=16, dtype="float32", kv_dtype="float32",
                                     repeats=repeats, steps_per_sample=2, knee_factor=1.5,
                                     out=str(tmp_path / "r.jsonl"))):
        with pytest.raises(ValueError, match="repeats"):
            run()


@pytest.mark.parametrize("rate", [0.0, -2.0, math.nan])
def test_a_rate_that_is_no_rate_is_refused_in_words(rate: float) -> None:
    """Rate 0 failed as a ZeroDivisionError, a negative one as numpy's "scale < 0"; NaN gave NaN
    arrivals, which experiments.serve's loop never reaches: it spun for ever."""
    from experiments.serve import make_workload
    from experiments.workloads import poisson_arrivals

    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(np.random.default_rng(0), 4, rate)
    with pytest.raises(ValueError, match="rate"):
        make_workload(list(range(1000)), num_requests=4, rate=rate, prompt_min=4, prompt_max=8,
                      output_shape=1.5, output_scale=4.0, output_cap=16, seed=0)
    assert not poisson_arrivals(np.random.default_rng(0), 4, math.inf).any()  # all at once
    assert poisson_arrivals(np.random.default_rng(0), 0, 2.0).shape == (0,)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload(list(range(1000)), num_requests=0, rate=2.0, prompt_min=4, prompt_max=8,
                      output_shape=1.5, output_scale=4.0, output_cap=16, seed=0)


def test_no_calls_and_no_tokens_are_refused_before_any_call() -> None:
    """interleaved_medians with calls=0 ended in an UnboundLocalError; first_and_step_time with
    tokens=0 divided by zero after every timed run."""
    from experiments.common import first_and_step_time, interleaved_medians

    calls = []
    fn = lambda *args: calls.append(args) or 0.0
    with pytest.raises(ValueError, match="calls"):
        interleaved_medians({"f": fn}, (), repeats=3, calls=0)
    with pytest.raises(ValueError, match="tokens"):
        first_and_step_time(fn, 0, repeats=3)
    assert not calls


def test_output_paths_that_cannot_be_written_are_refused(tmp_path) -> None:
    """A directory, or a path below a file, failed at the first write, after the work; a
    missing folder is made by the writer."""
    from experiments.common import ResultLog, check_output_path

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, match in [(str(tmp_path), "is a directory"),
                        (str(a_file / "x.jsonl"), "which is a file"),
                        (str(a_file / "deeper" / "x.jsonl"), "which is a file"),
                        ("", "empty")]:
        with pytest.raises(ValueError, match=match):
            check_output_path(path)
        if path:
            with pytest.raises(ValueError, match=match):
                ResultLog(path, env={})
    with pytest.raises(ValueError, match=r"end in \.npz"):
        check_output_path(str(tmp_path / "data"), suffix=".npz")
    check_output_path(str(tmp_path / "new" / "folder" / "x.jsonl"))
    check_output_path(str(a_file))  # an existing file is appended to or replaced


@pytest.mark.parametrize("argv, message", [
    (["--sizes="], "--sizes must list at least one value"),
    (["--sizes=8,0"], "--sizes: 0 must be >= 1"),
    (["--sizes=8,x"], "--sizes: 'x' is not an integer"),
    (["--temps=0.7,1.5"], r"--temps: 1.5 must be in \[0, 1\]"),
    (["--pair=3"], "--pair takes 2 comma-separated values, got 1"),
    (["--pair=3,4,5"], "--pair takes 2 comma-separated values, got 3"),
    (["--names=a,c"], "--names: 'c' is not one of a, b"),
    (["--out=/"], "is a directory"),
])
def test_list_and_output_flags_are_checked_when_parsed(argv: list[str], message: str) -> None:
    from experiments.common import validate_list_flag, validate_output_flag
    from tests.experiments.flags_util import parses, refusal

    fv = flags.FlagValues()
    flags.DEFINE_list("sizes", ["1", "8"], "", flag_values=fv)
    flags.DEFINE_list("temps", ["0", "0.7"], "", flag_values=fv)
    flags.DEFINE_list("pair", ["3", "4"], "", flag_values=fv)
    flags.DEFINE_list("names", ["a", "b"], "", flag_values=fv)
    flags.DEFINE_list("maybe", [], "", flag_values=fv)
    flags.DEFINE_string("out", "x.jsonl", "", flag_values=fv)
    validate_list_flag(fv, "sizes", lower_bound=1)
    validate_list_flag(fv, "temps", parse=float, lower_bound=0, upper_bound=1)
    validate_list_flag(fv, "pair", length=2)
    validate_list_flag(fv, "names", choices=["a", "b"])
    validate_list_flag(fv, "maybe", allow_empty=True)
    validate_output_flag(fv, "out")
    parses(fv)
    parses(fv, "--sizes=2,4", "--temps=1", "--pair=0,0", "--names=b", "--maybe=3")
    assert re.search(message, refusal(fv, *argv))


def test_nan_in_a_float_flag_is_refused() -> None:
    """absl's bounds compare false with NaN: --gpu_memory_gb=nan passed lower_bound=0 and was
    written into every row."""
    from experiments.common import check_no_nan_flags

    fv = flags.FlagValues()
    flags.DEFINE_float("memory", 80.0, "", lower_bound=0.0, flag_values=fv)
    flags.DEFINE_integer("count", 1, "", flag_values=fv)
    fv(["prog", "--memory=nan"])
    with pytest.raises(flags.IllegalFlagValueError, match="--memory=nan"):
        check_no_nan_flags(fv)
    fv(["prog", "--memory=inf"])
    check_no_nan_flags(fv)  # inf is a bound some flags mean (a rate: all at once)


@pytest.mark.parametrize("argv, message", [
    (["--gpus=0"], "flag --gpus=0: 0 is not a positive integer"),
    (["--gpu_memory_gb=nan"], "flag --gpu_memory_gb=nan: not a number"),
    (["--contexts="], "flag --contexts=[]: --contexts must list at least one value"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
])
def test_a_bad_flag_ends_the_script_in_one_line(argv: list[str], message: str,
                                                tmp_path) -> None:
    """The experiments parse their flags themselves (`run_experiment`): a refused value ended in
    a traceback through absl's internals, where absl's own parser prints one line."""
    import subprocess
    import sys

    from experiments.common import REPO

    out = tmp_path / "o.jsonl"
    done = subprocess.run([sys.executable, "-m", "experiments.memory_budget", f"--out={out}",
                           *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"FATAL Flags parsing error: {message}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()
