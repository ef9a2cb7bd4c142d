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


def test_two_processes_give_one_device_tokens():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker", str(i),
                               str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # never leave a process waiting on a dead peer
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    row = json.loads(next(line for line in results[0][0].splitlines() if line.startswith("{")))
    assert (row["processes"], row["global_devices"], row["mesh_devices"]) == (2, 4, 4)
    assert row["tokens"] == row["one_device"]
