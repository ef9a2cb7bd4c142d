"""Shared by the experiment scripts: environment record, machine ceilings, timing, JSONL results
(written row by row, resumable), the peers' package check, the devices of the one engine a
step-record experiment measures (`one_engine`), the one `__main__` wrapper (`run_main`) and the
one figure preamble (`new_figure`, `save_figure`)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # JAX starts only in the experiments that run a model
    from jax.sharding import Mesh

    from infer.engine.engine import Engine
    from infer.io.tokenizer import Tokenizer
    from infer.model.config import LlamaConfig
    from infer.model.llama import Llama
    from infer.parallel.mesh import ParallelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "results")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    import jax

    from infer.platform import git_revision

    device = jax.devices()[0]
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_revision(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "num_devices": jax.device_count(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def check_repeats(repeats: int, name: str = "repeats") -> None:
    """Refuses a timing of no samples: their median is NaN, which a row would keep."""
    if repeats < 1:
        raise ValueError(f"{name} must be >= 1 (timings per point), got {repeats}")


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, its result blocked on before the clock stops."""
    import jax

    check_repeats(repeats)

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def interleaved_medians(programs: Mapping[str, Callable[..., Any]], args: Sequence[Any],
                        repeats: int, calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each program on `args`, after one untimed call each; each
    timing is `calls` calls, and the programs take turns repeat by repeat, so that a slow
    spell of the machine falls on all of them alike."""
    import jax

    check_repeats(repeats)
    check_repeats(calls, "calls")

    for fn in programs.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):
        for name, fn in programs.items():
            start = time.perf_counter()
            for _ in range(calls):
                result = fn(*args)
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: float(np.median(t)) for name, t in times.items()}


def first_and_step_time(generate: Callable[[int], Any], tokens: int, repeats: int
                        ) -> tuple[float, float]:
    """(seconds to the first token, seconds per decode step after it) of `generate(n)`, a
    generation loop returning on the host after n tokens, the way its user sees it: over
    `repeats`, after one untimed run that compiles or warms every shape, the median of t(1),
    and the median of t(tokens + 1) less that, over tokens (a difference of medians, not the
    median of each repeat's difference)."""
    check_repeats(repeats)
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1 (decode steps timed after the first), got {tokens}")
    generate(tokens + 1)
    first, full = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(1)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(tokens + 1)
        full.append(time.perf_counter() - start)
    t_first = float(np.median(first))
    return t_first, (float(np.median(full)) - t_first) / tokens


def measure_ceilings(copy_bytes: int = 1 << 30, matmul_n: int = 2048,
                     dtype: Any = "float32", buffers: int = 3) -> dict[str, Any]:
    """This machine's copy bandwidth (bytes read + written per second, through XLA), read
    bandwidth (bytes read per second by a reduction) and dense matmul FLOP/s, measured now, on
    the default device; each bandwidth the median over `buffers` buffers of `copy_bytes`, whose
    figures are kept too (`*_samples_Bps`)."""
    # JAX is imported where it is used: the experiments without a model (fragmentation,
    # memory_budget, the prefix cache alone) run without starting it.
    import jax
    import jax.numpy as jnp

    n = copy_bytes // 4
    # Donated, so the output reuses the input's pages: a fresh 1 GiB output every call would
    # time the kernel's page faults rather than the memory bus.
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    # Reading alone can run slower than a copy's reads and writes together, and a decode step's
    # weights are only read.
    read = jax.jit(lambda a: jnp.max(a, axis=0))
    rng = np.random.default_rng(0)
    # Each on a few buffers allocated afresh, the median of them: on the development machine
    # (a 2-vCPU VM) one buffer copied at 51-55 GB/s and the next, same process, at 96-102, and
    # reads ran at 33-35 or 53: where the host put the pages decides.
    copies, reads = [], []
    for _ in range(buffers):
        box = [jnp.asarray(rng.random((n // 16, 16), np.float32))]

        def step() -> jax.Array:
            box[0] = copy(box[0])
            return box[0]

        reads.append(n * 4 / median_time(lambda: read(box[0]), repeats=5))
        copies.append(2 * n * 4 / median_time(step, repeats=5))
        del box
    bandwidth, read_bandwidth = float(np.median(copies)), float(np.median(reads))
    a = jnp.asarray(np.random.default_rng(0).standard_normal((matmul_n, matmul_n)), dtype)
    mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    flops = 2 * matmul_n**3 / median_time(lambda: mm(a), repeats=5)
    return {"copy_bandwidth_Bps": bandwidth, "read_bandwidth_Bps": read_bandwidth,
            "copy_bandwidth_samples_Bps": copies, "read_bandwidth_samples_Bps": reads,
            "matmul_flops": flops,
            "matmul_dtype": jnp.dtype(dtype).name}


def row_key(point: Mapping[str, Any]) -> str:
    """The id of a sweep point: a hash of its canonical JSON, so the same configuration gets the
    same key in every run (and a float 1 and an int 1 stay different points)."""
    text = json.dumps(dict(point), sort_keys=True, default=_jsonable)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# The environment fields that say which machine measured a row: --resume keeps rows of this one
# only. The code revision is not among them: resuming a sweep across commits is a choice, and
# the line --resume prints names the revisions kept rows come from.
MACHINE = ("backend", "device", "num_devices", "cpu", "cpu_count", "jax")


class ResultLog:
    """An experiment's JSONL results, written one row at a time.

    Each row is appended, flushed and synced the moment it is measured, so a failure later in the
    run loses nothing already measured. A row of a sweep point carries `key` (`row_key` of the
    point's configuration); with `resume=True` a point whose key is already in the file is not
    measured again, its stored row stands in, unless it failed or another machine measured it
    (`_reusable`). Tables and plots are built from `rows()`, which reads this run's rows back
    from the file. Every row carries the run's environment."""

    def __init__(self, path: str, *, resume: bool = False,
                 env: dict[str, Any] | None = None) -> None:
        check_output_path(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.resume = resume
        self.env = environment() if env is None else env
        self._keys: list[str] = []  # this run's points, in the order it met them
        self._stored: dict[str, dict[str, Any]] = {}
        if resume:
            self._stored = self._reusable(
                _latest_by_key(read_jsonl(path)) if os.path.exists(path) else {})

    def _reusable(self, stored: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The stored rows a resumed run keeps: those measured on this machine (`MACHINE`
        fields of their env equal to this run's) that did not fail. The others are measured
        again, as the printed line says: a table must not set another machine's timings beside
        this one's, nor keep a failure (out of memory, say) that was the moment's."""
        kept, elsewhere, failed = {}, [], 0
        for key, row in stored.items():
            env = row.get("env") or {}
            differ = [f"{f} {env.get(f)!r}" for f in MACHINE
                      if f in self.env and env.get(f) != self.env[f]]
            if differ:
                elsewhere.append(", ".join(differ))
            elif "error" in row:
                failed += 1
            else:
                kept[key] = row
        line = (f"[resume] {len(stored)} measured points in {self.path}: {len(kept)} kept, not "
                f"measured again")
        if failed:
            line += f"; {failed} that failed measured again"
        if elsewhere:
            line += (f"; {len(elsewhere)} from another machine or JAX measured again (e.g. "
                     f"{elsewhere[0]}; here " + ", ".join(
                         f"{f} {self.env[f]!r}" for f in MACHINE if f in self.env) + ")")
        revisions = sorted({str((r.get("env") or {}).get("git")) for r in kept.values()}
                           - {str(self.env.get("git"))})
        if revisions:
            line += f"; kept rows come from git {', '.join(revisions)} (this run: " \
                    f"{self.env.get('git')})"
        print(line)
        return kept

    def done(self, point: Mapping[str, Any]) -> dict[str, Any] | None:
        """The stored row of `point` when resuming and the file holds one, else None."""
        return self._stored.get(row_key(point)) if self.resume else None

    def measure(self, point: Mapping[str, Any],
                fn: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The row of sweep point `point`: {**point, **fn()} written now, or, when resuming and
        the file holds the point, its stored row (fn is not called)."""
        stored = self.done(point)
        if stored is not None:
            self._keys.append(row_key(point))
            return stored
        return self.append({**point, **fn()}, point=point)

    def append(self, row: Mapping[str, Any],
               point: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Writes `row` now; with `point`, as that point's row (keyed, one of `rows()`); without,
        as a log line (training curves) that resume never skips."""
        row = dict(row)
        if point is not None:
            row["key"] = row_key(point)
            self._keys.append(row["key"])
        line = json.dumps({**row, "env": self.env}, default=_jsonable) + "\n"
        with open(self.path, "a+") as f:
            f.seek(0, os.SEEK_END)
            # A run killed mid-write leaves a line without its newline: end it, so the next row
            # starts a line of its own (read_jsonl skips the broken one).
            if f.tell() > 0:
                f.seek(f.tell() - 1)
                if f.read(1) != "\n":
                    f.write("\n")
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return {**row, "env": self.env}

    def rows(self) -> list[dict[str, Any]]:
        """This run's point rows as the file holds them, in the order the run met the points."""
        stored = _latest_by_key(read_jsonl(self.path)) if os.path.exists(self.path) else {}
        return [stored[k] for k in dict.fromkeys(self._keys) if k in stored]


def _latest_by_key(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if "key" in row:
            out[row["key"]] = row
    return out


def define_resume_flag(flag_values: Any) -> None:
    """--resume, shared by the sweep experiments (see ResultLog)."""
    from absl import flags

    flags.DEFINE_bool("resume", False, "keep the rows already in --out that this machine "
                      "measured without error, and measure only the other sweep points (same "
                      "flags as the interrupted run)",
                      flag_values=flag_values)


@dataclasses.dataclass(frozen=True)
class OneEngine:
    """The devices of the one engine an experiment measures (`one_engine`): a mesh of
    `parallel.tensor_parallel_size` devices, or the default device alone, for `model`."""

    parallel: ParallelConfig
    model: str = "smollm2-135m"

    @property
    def point(self) -> dict[str, Any]:
        """What a sweep point adds for these devices: nothing on one device, so rows measured
        before the parallel flags keep their keys (and --resume finds them)."""
        if self.parallel.is_single_device:
            return {}
        return {"tensor_parallel_size": self.parallel.tensor_parallel_size,
                "pad_heads": self.parallel.pad_heads}

    def place(self, host_model: Llama) -> tuple[Llama, Mesh | None]:
        """(model, mesh) of a model whose weights are on the host (`load_on_host`), as an
        engine runs it: heads laid out for the mesh and the weights placed on it; on one device
        no mesh, and the projections in the CPU kernel's tile layout where it has one
        (`tile_weights`; the engine then keeps them, and a plain loop over the model reads the
        same weights)."""
        from infer.model.llama import tile_weights
        from infer.parallel.placement import place_replicas

        (model, mesh), = place_replicas(host_model, self.parallel)
        return (tile_weights(model) if mesh is None else model), mesh

    def load(self, dtype: str) -> tuple[LlamaConfig, Llama, Tokenizer, Mesh | None]:
        """(config, model, tokenizer, mesh): the model read on the host and `place`d, so a
        model split over devices never passes through one device whole."""
        from infer.io.loader import load_on_host

        config, host_model, tokenizer = load_on_host(self.model, dtype)
        placed, mesh = self.place(host_model)
        return config, placed, tokenizer, mesh


def one_engine(experiment: str, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
               pad_heads: bool = False, model: str = "smollm2-135m") -> OneEngine:
    """The parallel flags (`infer.parallel.flags`) of an experiment that measures one engine's
    step records, checked before any work: data parallelism is refused (D engines' records are
    not one step's), and too few devices or heads that do not split fail in one line before
    the model loads."""
    from infer.model.config import get_config
    from infer.parallel.heads import head_layout
    from infer.parallel.mesh import ParallelConfig

    parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, pad_heads)
    if parallel.data_parallel_size != 1:
        raise ValueError(f"{experiment} measures one engine's step records: run data-parallel "
                         f"replicas through LLM (data_parallel_size) instead")
    parallel.replica_meshes()
    if not parallel.is_single_device:
        # The preset's shape: the checkpoint takes seconds to read, the layout check none.
        head_layout(get_config(model), tensor_parallel_size, pad_heads)
    return OneEngine(parallel, model)


def engine_devices(engine: Engine) -> int:
    """The devices `engine`'s KV cache is split over: what a row records to show where its
    steps ran (the flags say only what was asked)."""
    import jax

    return len({d for leaf in jax.tree.leaves(engine.runner.cache)
                for d in leaf.sharding.device_set})


# Peer implementations of the benchmarks: the modules each imports, and the extra of
# pyproject.toml that installs them.
PEERS = {"hf": ("hf", ("torch", "transformers")), "llamacpp": ("llamacpp", ("llama_cpp",))}


def usable_peers(peers: list[str], experiment: str) -> list[str]:
    """The requested peers whose packages are installed. A missing one is skipped with one line
    naming the extra that adds it, checked before any work so that no run fails minutes in on an
    import. An unknown name is an error; "none" asks for no peer."""
    unknown = sorted(set(peers) - set(PEERS) - {"none"})
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {sorted(PEERS)} or none")
    usable = []
    for peer in dict.fromkeys(p for p in peers if p != "none"):
        extra, modules = PEERS[peer]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            print(f"[{experiment}] skipping peer {peer!r}: {', '.join(missing)} not installed "
                  f"(add it with: pip install -e \".[{extra}]\")")
        else:
            usable.append(peer)
    return usable


def plot_path(jsonl_path: str) -> str:
    """The PNG beside a JSONL: same name, .png."""
    return os.path.splitext(jsonl_path)[0] + ".png"


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line cut short by a killed writer is skipped with a note."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"[results] {path}:{n}: skipping a line that is not JSON (a run cut short?)")
    return rows


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """rows as a Markdown table; columns are (key, header) and floats print with 3 significant
    figures or as integers when large."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(h for _, h in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def real_text(min_chars: int, offset: int = 0) -> str:
    """English prose and code that ships with CPython (pydoc's topic help), no download."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    if offset + min_chars > len(text):
        raise ValueError(f"asked for {min_chars} chars at {offset}; pydoc topics hold {len(text)}")
    return text[offset:offset + min_chars]


def check_no_nan_flags(experiment_flags: Any) -> None:
    """Refuses NaN in any float flag: absl's bounds compare false with NaN and let it through,
    and no experiment has a use for it (it would be written into rows as a figure)."""
    from absl import flags

    for name in experiment_flags:
        value = experiment_flags[name].value
        if isinstance(value, float) and value != value:
            raise flags.IllegalFlagValueError(f"flag --{name}=nan: not a number")


def run_experiment(main: Callable[[list[str]], None], experiment_flags: Any) -> None:
    """`app.run` for an experiment whose flags live in their own `flags.FlagValues`, so that
    experiment modules can be imported side by side (tests, notebooks, one experiment calling
    another) without redefining each other's flags. absl's own flags are parsed first."""
    from absl import app, flags

    def parse(argv: list[str]) -> list[str]:
        if {"-h", "-?", "--help", "--helpshort"} & set(argv):  # absl lists only its own flags
            print(experiment_flags.get_help())
        try:
            rest = experiment_flags(flags.FLAGS(argv, known_only=True))
            check_no_nan_flags(experiment_flags)
        except flags.Error as e:  # as absl's own parser: the reason in one line, no traceback
            sys.exit(f"FATAL Flags parsing error: {e}\nPass --help to see this experiment's flags.")
        return rest

    app.run(main, flags_parser=parse)


# A list flag holds strings; `run` says in its annotation what it takes (`validate_list_flag`
# has checked at parse time that the strings convert).
_FROM_FLAG = {"list[int]": lambda v: [int(x) for x in v],
              "list[float]": lambda v: [float(x) for x in v],
              "tuple[int, int]": lambda v: (int(v[0]), int(v[1]))}


def check_output_path(path: str, suffix: str | None = None, flag: str | None = None) -> None:
    """Refuses an output path that cannot be written, before any work whose result it would
    hold: an existing directory, a path below an existing file, or (with `suffix`) another
    extension. Missing folders are fine: the writer makes them. `flag`: the flag the path came
    from, which the message names (a script writing two files says which one)."""
    what = f"--{flag}: output path" if flag else "output path"
    if not path:
        raise ValueError(f"{what} must not be empty")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory; name a file in it")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {path!r} lies below {parent!r}, which is a file")
    if suffix is not None and not path.endswith(suffix):
        raise ValueError(f"{what} {path!r} must end in {suffix}")


def validate_output_flag(flag_values: Any, name: str, suffix: str | None = None,
                         allow_empty: bool = False) -> None:
    """Has absl refuse a bad output path in flag `name` (`check_output_path`) when the flags are
    parsed, so that a typo costs no run whose rows, weights or data would then be lost;
    `allow_empty` for a script that takes an empty path as "write no file"."""
    from absl import flags

    def valid(path: str) -> bool:
        if allow_empty and not path:
            return True
        try:
            check_output_path(path, suffix)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    flags.register_validator(name, valid, flag_values=flag_values)


def validate_list_flag(flag_values: Any, name: str, *, parse: Callable[[str], Any] = int,
                       lower_bound: float | None = None, upper_bound: float | None = None,
                       choices: Sequence[str] | None = None, length: int | None = None,
                       allow_empty: bool = False) -> None:
    """Has absl check list flag `name` when the flags are parsed: each entry one of `choices`,
    or a `parse`-able number within [lower_bound, upper_bound]; `length` entries when given,
    else at least one unless `allow_empty`. A sweep with a bad point is refused before its
    first point is measured, not when the point is reached."""
    from absl import flags

    def valid(values: list[str] | None) -> bool:
        values = values or []
        if length is not None and len(values) != length:
            raise flags.ValidationError(f"--{name} takes {length} comma-separated values, got "
                                        f"{len(values)}")
        if not values and not allow_empty:
            raise flags.ValidationError(f"--{name} must list at least one value")
        for v in values:
            if choices is not None:
                if v not in choices:
                    raise flags.ValidationError(f"--{name}: {v!r} is not one of "
                                                f"{', '.join(choices)}")
                continue
            try:
                x = parse(v)
            except ValueError as e:
                kind = {int: "an integer", float: "a number"}.get(parse)
                raise flags.ValidationError(f"--{name}: {v!r} is not {kind}" if kind else
                                            f"--{name}: {v!r}: {e}") from None
            if x != x:  # NaN passes every bound
                raise flags.ValidationError(f"--{name}: {v!r} is not a number")
            if (lower_bound is not None and x < lower_bound) or (
                    upper_bound is not None and x > upper_bound):
                bounds = (f">= {lower_bound}" if upper_bound is None else
                          f"<= {upper_bound}" if lower_bound is None else
                          f"in [{lower_bound}, {upper_bound}]")
                raise flags.ValidationError(f"--{name}: {v} must be {bounds}")
        return True

    flags.register_validator(name, valid, flag_values=flag_values)


def flag_kwargs(run_fn: Callable[..., Any], experiment_flags: Any) -> dict[str, Any]:
    """`run_fn`'s keyword arguments from the flags of the same names: every parameter with a
    flag, a list flag converted to its parameter's annotation (`list[int]`, `list[float]`,
    `tuple[int, int]`); parameters without a flag keep their defaults."""
    kwargs = {}
    for name, param in inspect.signature(run_fn).parameters.items():
        if name in experiment_flags:
            value = experiment_flags[name].value
            kwargs[name] = _FROM_FLAG.get(str(param.annotation), lambda v: v)(value)
    return kwargs


def run_main(run_fn: Callable[..., Any], experiment_flags: Any, *,
             compilation_cache: bool = False,
             args: Callable[[Any], Mapping[str, Any]] | None = None) -> None:
    """The `__main__` of an experiment: parses the flags (see `run_experiment`), sets the
    platform up (XLA's CPU flags; with `compilation_cache`, JAX's persistent compilation cache)
    and calls `run_fn(**flag_kwargs(run_fn, flags), **args(flags))` -- `args` for what a flag
    does not give one to one (a renamed parameter, a preset). `run_fn` writes its rows, prints
    its table and draws its plot itself, so that a library caller gets the same."""
    def main(argv: list[str]) -> None:
        del argv
        from infer.platform import configure_xla_cpu, enable_compilation_cache
        configure_xla_cpu()
        if compilation_cache:
            enable_compilation_cache()
        run_fn(**{**flag_kwargs(run_fn, experiment_flags),
                  **(args(experiment_flags) if args is not None else {})})

    run_experiment(main, experiment_flags)


def new_figure(ncols: int = 1, *, figsize: tuple[float, float], nrows: int = 1
               ) -> tuple[Any, Any]:
    """(fig, axes) of a new matplotlib figure on the Agg backend (no display needed); hand it
    to `save_figure` when drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize)


def save_figure(fig: Any, path: str) -> None:
    """Lays `fig` out tight, saves it to `path` (its folder made) at 120 dpi and closes it."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> Any:
    """HF transformers' `generate` of exactly n greedy tokens after each prompt (equal lengths:
    no padding), the peer's own generation loop."""
    import torch

    x = torch.tensor(prompts)
    with torch.no_grad():
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)


def load_hf_smollm2(dtype: str) -> Any:
    """HF transformers' LlamaForCausalLM from the bundled SmolLM2 GGUF, in eval mode: the peer
    that the benchmarks run on the same requests."""
    import torch
    import transformers

    from infer.io.checkpoint import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path),
        dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
    return model.eval()
