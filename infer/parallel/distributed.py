"""Many hosts: `jax.distributed`, one identical process per host, process 0 owning intake.

Every process builds the same `LLM` over the global devices (its mesh may span hosts); JAX's
multi-controller model then needs every process to launch the same programs in the same order.
Process 0 runs the engine (requests, scheduler, outputs) and, before each device step, sends the
step's plan to the others (`jax.experimental.multihost_utils.broadcast_one_to_all`); they run
the plan on their own runner and so take part in each step's collectives. Nothing but the plan
crosses hosts on the host side: the tokens each step samples are replicated on every device.

    from infer.parallel import distributed
    distributed.initialize("host0:12355", num_processes=2, process_id=i)
    llm = LLM(model=..., tensor_parallel_size=4)
    outputs = distributed.run(llm, lambda llm: llm.generate(prompts))  # None on processes > 0
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

import jax
import numpy as np

from infer.engine.plan import InFlight, StepPlan
from infer.engine.runner import Runner
from infer.io.tokenizer import Tokenizer
from infer.parallel.replicas import ReplicatedEngine

if TYPE_CHECKING:
    from infer.llm import LLM

T = TypeVar("T")


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_count: int | None = None) -> None:
    """`jax.distributed.initialize`, with CPU collectives over gloo (XLA:CPU has no others
    across processes). `local_device_count`: virtual CPU devices per process (tests, CPU hosts).
    Call it before anything touches a JAX device."""
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    # Off even when turned on before (JAX_COMPILATION_CACHE_DIR, an earlier LLM): see
    # `infer.platform.enable_compilation_cache`, which keeps it off from here on. (Its
    # directory must go: jax_enable_compilation_cache=False beside one still failed so.)
    jax.config.update("jax_compilation_cache_dir", None)


# -- the plan channel -------------------------------------------------------------------------------

_STOP, _WARMUP, _STEP = "stop", "warmup", "step"


class _Pickler(pickle.Pickler):
    """Plans reference their requests, and requests their tokenizer: the followers never
    detokenize, so tokenizers travel as a placeholder."""

    def persistent_id(self, obj: object) -> str | None:
        return "tokenizer" if isinstance(obj, Tokenizer) else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: str) -> None:
        return None


def _broadcast(message: tuple | None) -> tuple:
    """Process 0's `message` on every process (others pass None). Two broadcasts: the length,
    then the bytes padded to a power of two, so a run compiles a handful of transfer programs."""
    from jax.experimental import multihost_utils

    leader = jax.process_index() == 0
    data = b""
    if leader:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        data = buffer.getvalue()
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    padded = np.zeros(1 << max(size - 1, 0).bit_length(), np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return _Unpickler(io.BytesIO(received[:size].tobytes())).load()


def run(llm: "LLM", main: Callable[["LLM"], T]) -> T | None:
    """`main(llm)` on process 0, its steps mirrored by every other process; their return is None.
    On one process, just `main(llm)`."""
    if jax.process_count() == 1:
        return main(llm)
    if isinstance(llm.engine, ReplicatedEngine):
        raise ValueError("across hosts, one engine replica spans the processes: use "
                         "tensor_parallel_size, not data_parallel_size")
    runner = llm.engine.runner
    mesh = runner.device_steps.mesh
    missing = processes_without_devices(() if mesh is None else mesh.devices.flat,
                                        jax.process_count())
    if missing:
        # Every process raises here alike, so none is left waiting for another's broadcast.
        held = ("the engine runs on one device, with no mesh" if mesh is None else
                f"processes {missing} hold none of its mesh's {mesh.devices.size} devices")
        raise ValueError(
            f"across {jax.process_count()} processes the engine's mesh must hold devices of "
            f"each, but {held} (of {jax.device_count()} devices in all): set "
            f"tensor_parallel_size to jax.device_count()")
    if jax.process_index() != 0:
        _follow(runner)
        return None
    runner.mirror = lambda *message: _broadcast(message)
    try:
        return main(llm)
    finally:
        runner.mirror = None
        _broadcast((_STOP,))


def processes_without_devices(devices: Iterable[jax.Device], process_count: int) -> list[int]:
    """The processes of `process_count` that hold none of `devices`: a follower without a
    device of the mesh has no shard to run a step on (it crashed, and process 0 then waited)."""
    held = {d.process_index for d in devices}
    return [p for p in range(process_count) if p not in held]


def _follow(runner: Runner) -> None:
    """Runs process 0's steps on this process's runner until it stops."""
    in_flight: InFlight | None = None
    while True:
        kind, *args = _broadcast(None)
        if kind == _STOP:
            return
        if kind == _WARMUP:
            runner.warmup(*args)
            continue
        plan, = args
        assert isinstance(plan, StepPlan)
        in_flight = runner.dispatch(plan, in_flight if plan.ahead else None)
