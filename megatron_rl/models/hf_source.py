"""A Hugging Face checkpoint matched to a model family and checked, before any process group."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import family_for
from megatron_rl.models.families.base import ModelFamily
from megatron_rl.models.hf_weights import unmapped_hf_names


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face checkpoint, its family and its model config."""

    checkpoint: HFCheckpoint
    family: ModelFamily
    config: MoEModelConfig


def inspect_hf(hf_dir: Path, *, given_as: str | None = None) -> HFSource:
    """Open and check a Hugging Face checkpoint: files, architecture, config, unused tensors.
    `given_as` is how the user named the directory (`--hf`, `model.hf_path`)."""
    checkpoint = HFCheckpoint(hf_dir, given_as=given_as)
    family = family_for(checkpoint.config)
    config = family.config_from_hf(checkpoint.config)
    extra = unmapped_hf_names(family, config, checkpoint.names())
    if extra:
        raise ValueError(
            f"{hf_dir}: {len(extra)} tensor(s) the {family.architecture} mapping does not use, "
            f"e.g. {extra[:3]}; the config and the weights disagree"
        )
    return HFSource(checkpoint, family, config)
