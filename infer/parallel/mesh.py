"""Tensor- and data-parallel sizes (vLLM's names) and the meshes they make.

Each data-parallel replica gets a mesh of its own `tensor_parallel_size` devices, with axes
("data", "model") of sizes (1, T): the model's logical-axis rules (`infer.model.sharding`) name
both, and a replica's batch stays on its own devices. Data parallelism is engine replicas, not a
"data" axis of one program: each replica schedules its own batch (`infer.parallel.replicas`).

Axes are `AxisType.Auto`: `jax.make_mesh` defaults to Explicit axes, under which
`with_sharding_constraint` refuses them and einsums over a sharded contraction raise.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from infer.model.config import LlamaConfig
from infer.parallel.heads import head_layout

DATA, MODEL = "data", "model"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Opt in to zero-weight heads when the tensor-parallel size neither divides the KV heads
    # nor is a multiple of them (`infer.parallel.heads`): exact, at the cost of more KV memory.
    pad_heads: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.pad_heads, bool):  # "no" would be truthy, and pad
            raise ValueError(f"pad_heads must be a bool, got {self.pad_heads!r}")

    def check_model(self, model_config: LlamaConfig) -> None:
        """ValueError when the tensor-parallel size cannot split this model (`head_layout`):
        LLM asks before it reads the weights."""
        if self.tensor_parallel_size > 1:
            head_layout(model_config, self.tensor_parallel_size, self.pad_heads)

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.num_devices == 1

    def replica_meshes(self, devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
        """One ("data", "model") mesh of tensor_parallel_size devices per replica, in device
        order; ValueError when there are too few devices."""
        devices = list(jax.devices() if devices is None else devices)
        t, n = self.tensor_parallel_size, self.num_devices
        if len(devices) < n:
            hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N "
                    "virtual devices)" if devices and devices[0].platform == "cpu" else "")
            raise ValueError(f"tensor_parallel_size={t} x data_parallel_size="
                             f"{self.data_parallel_size} needs {n} devices, but {len(devices)} "
                             f"are visible{hint}")
        return [Mesh(np.array(devices[r * t:(r + 1) * t]).reshape(1, t), (DATA, MODEL),
                     axis_types=(AxisType.Auto, AxisType.Auto))
                for r in range(self.data_parallel_size)]

