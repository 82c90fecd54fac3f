"""A Hugging Face checkpoint matched to a model family and checked, before any process group."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_tensor_names(family: ModelFamily, hf_config: dict[str, Any], names: set[str]) -> set[str]:
    """The checkpoint's tensors of multi-token-prediction layers: model.layers.{i} for the
    `family.mtp_layers_field` layers after the last decoder layer."""
    if family.mtp_layers_field is None:
        return set()
    count = hf_config.get(family.mtp_layers_field) or 0
    first = hf_config.get("num_hidden_layers", 0)
    mtp_layers = range(first, first + count)
    return {
        name
        for name in names
        if (match := _LAYER_INDEX.match(name)) and int(match.group(1)) in mtp_layers
    }


def inspect_hf(hf_dir: Path, *, given_as: str | None = None) -> HFSource:
    """Open and check a Hugging Face checkpoint: files, architecture, config, unused tensors.
    `given_as` is how the user named the directory (`--hf`, `model.hf_path`)."""
    checkpoint = HFCheckpoint(hf_dir, given_as=given_as)
    family = family_for(checkpoint.config)
    config = family.config_from_hf(checkpoint.config)
    names = checkpoint.names()
    mtp = mtp_tensor_names(family, checkpoint.config, names)
    if mtp:
        warnings.warn(
            f"{hf_dir}: skipping the {len(mtp)} tensor(s) of the multi-token-prediction layer(s) "
            f"({family.mtp_layers_field} = {checkpoint.config[family.mtp_layers_field]}): RL "
            "does not use them, and an export will not have them",
            stacklevel=2,
        )
    extra = unmapped_hf_names(family, config, names - mtp)
    if extra:
        raise ValueError(
            f"{hf_dir}: {len(extra)} tensor(s) the {family.architecture} mapping does not use, "
            f"e.g. {extra[:3]}; the config and the weights disagree"
        )
    return HFSource(checkpoint, family, config)
