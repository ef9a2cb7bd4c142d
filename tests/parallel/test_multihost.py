"""Two processes x two virtual CPU devices on 127.0.0.1, one tensor-parallel mesh over both
(`jax.distributed`, gloo collectives): process 0 serves, process 1 follows its plans, and the
tokens are one device's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_one_device_tokens(tmp_path):
    port = _free_port()
    # The persistent compilation cache asked for before jax.distributed starts (by JAX's own
    # variable) and after it (as the CLI asks): it must end up off.
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker", str(i),
                               str(port), str(tmp_path / f"xla{i}")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # never leave a process waiting on a dead peer
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    row = json.loads(next(line for line in results[0][0].splitlines() if line.startswith("{")))
    assert (row["processes"], row["global_devices"], row["mesh_devices"]) == (2, 4, 4)
    assert row["cache"] is None and row["cache_dir"] is None
    assert row["tokens"] == row["one_device"]


def test_a_mesh_must_hold_devices_of_every_process():
    """A follower without a device of the mesh has no shard to run a step on: refused before
    the first step, by every process alike."""
    import random
    import types

    from infer.parallel.distributed import processes_without_devices

    for _ in range(50):
        count = random.randint(1, 6)
        held = set(random.sample(range(count), random.randint(0, count)))
        devices = [types.SimpleNamespace(process_index=p) for p in held for _ in range(2)]
        random.shuffle(devices)
        assert processes_without_devices(devices, count) == sorted(set(range(count)) - held)


def test_structured_output_is_refused_when_plans_are_mirrored(tiny_model):
    """Across hosts each step's plan is pickled to the followers; a grammar matcher cannot go
    with it, so such a request is refused at the door rather than failing the first step."""
    import pytest

    from infer.sampling_params import SamplingParams, StructuredOutput
    from tests.engines import tiny_engine

    engine = tiny_engine(tiny_model)
    engine.runner.mirror = lambda *message: None
    params = SamplingParams(max_tokens=4, structured=StructuredOutput(regex="[ab]+"))
    with pytest.raises(ValueError, match="across hosts"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=params)
    assert not engine.has_unfinished()
