"""The parallel flags (vLLM's names) that the CLI and the experiments share."""

from __future__ import annotations

from absl import flags

# How a data-parallel front picks a replica (`infer.parallel.replicas`). Here, with no JAX
# import, so that defining the flags stays cheap.
ROUTINGS = ("least_loaded", "prefix")


def check_routing(routing: str, prefix_caching: bool) -> None:
    """Raises ValueError for a routing not in ROUTINGS, or prefix-aware routing without the
    prefix cache it reads: `LLM` checks it even with one replica, which routes nothing, so that
    a typo never passes unseen, and before the weights are read."""
    if routing not in ROUTINGS:
        raise ValueError(f"dp_routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "prefix" and not prefix_caching:
        raise ValueError("dp_routing='prefix' routes by what each replica's prefix cache "
                         "holds: it needs enable_prefix_caching=True (--enable_prefix_caching)")


def define_parallel_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    flags.DEFINE_integer("tensor_parallel_size", 1, "devices per model replica (heads, FFN and "
                         "vocabulary split over them)", flag_values=flag_values)
    flags.DEFINE_integer("data_parallel_size", 1, "engine replicas, one per group of "
                         "tensor_parallel_size devices", flag_values=flag_values)
    flags.DEFINE_bool("pad_heads", False, "allow a tensor_parallel_size that does not divide the "
                      "heads by adding zero heads (exact, more KV memory)",
                      flag_values=flag_values)
    flags.DEFINE_enum("dp_routing", "least_loaded", list(ROUTINGS), "how data-parallel replicas "
                      "get requests", flag_values=flag_values)


def define_distributed_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Many hosts (`infer.parallel.distributed`): the same command on each, its process_id apart."""
    flags.DEFINE_string("coordinator_address", "", "host:port of process 0, which serves; empty: "
                        "one host", flag_values=flag_values)
    flags.DEFINE_integer("num_processes", 1, "processes in all, one per host",
                         flag_values=flag_values)
    flags.DEFINE_integer("process_id", 0, "this process's index (0 serves, the rest follow)",
                         flag_values=flag_values)


def parallel_kwargs(flag_values: flags.FlagValues = flags.FLAGS) -> dict:
    """The parallel flags as `LLM` keyword arguments."""
    return {name: flag_values[name].value for name in
            ("tensor_parallel_size", "data_parallel_size", "pad_heads", "dp_routing")}
