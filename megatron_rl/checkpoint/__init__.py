"""Checkpoints: Hugging Face files, and conversion to and from Megatron-Core."""
