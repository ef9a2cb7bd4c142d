"""An OpenAI-compatible HTTP server over the engine (`python -m infer.serve`)."""
