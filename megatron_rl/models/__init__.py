"""Megatron-Core model building and the Hugging Face family mappings."""

from megatron_rl.models.config import MoEModelConfig

__all__ = ["MoEModelConfig"]
