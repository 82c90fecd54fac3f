"""Megatron-Core process groups and the maths that must cross them."""
