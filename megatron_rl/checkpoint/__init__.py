"""megatron-rl checkpoints: their format, and conversion to and from Hugging Face."""
