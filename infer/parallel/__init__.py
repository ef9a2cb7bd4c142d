"""Past one device, on JAX's own machinery: a `jax.sharding.Mesh` per engine replica for tensor
parallelism, engine replicas for data parallelism, `jax.distributed` across hosts."""
