"""megatron-rl: RL post-training (GSPO, GRPO + replay, SSPO) for MoE LLMs on Megatron-Core."""

__version__ = "0.1.0"
