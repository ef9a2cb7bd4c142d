"""Reading models in: checkpoints (GGUF, HF safetensors), weights, tokenizer, named tensors."""
