"""The serving engine: requests, the scheduler's plans, the runner's device steps, metrics,
and the simple loop."""
