"""The Llama model: its config and presets, the Flax module, sharding rules, weight binding."""
