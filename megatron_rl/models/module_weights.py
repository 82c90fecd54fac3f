"""The tensors a checkpoint holds for a torch module, whichever implementation it is (the
Megatron-Core model, or the Hugging Face one of the in-process engine)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def named_weights(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """`module`'s parameters, then its persistent buffers (e.g. DeepSeek-V3's score-correction
    bias, which is not trained but is part of the model), by name."""
    yield from module.named_parameters()
    for owner_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                yield f"{owner_name}.{name}" if owner_name else name, buffer
