"""Hugging Face model families: one file each, registered here by architecture name."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families import deepseek_v3, glm4_moe, mixtral, qwen3_moe
from megatron_rl.models.families.base import ModelFamily

FAMILIES: dict[str, ModelFamily] = {
    family.architecture: family
    for family in (qwen3_moe.FAMILY, mixtral.FAMILY, deepseek_v3.FAMILY, glm4_moe.FAMILY)
}


def family_for(hf_config: dict[str, Any]) -> ModelFamily:
    """The family of a config.json; an unsupported architecture lists the supported ones."""
    architectures = hf_config.get("architectures") or []
    for architecture in architectures:
        if architecture in FAMILIES:
            return FAMILIES[architecture]
    raise ValueError(
        f"config.json: architecture {architectures or hf_config.get('model_type')!r} is not "
        f"supported; supported: {', '.join(FAMILIES)}"
    )
