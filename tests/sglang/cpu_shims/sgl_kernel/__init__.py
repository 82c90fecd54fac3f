"""TEST-ONLY stand-in for the CPU build of `sgl_kernel` (see ../README.md), which PyPI lacks.

SGLang's CPU engine imports kernels from it by name; the one its decode path calls on this
machine is implemented here in plain torch. Any other kernel raises NotImplementedError when
called, so a code path that needs a real kernel fails loudly instead of computing garbage.
"""

import torch

__version__ = "0.0.0+megatron-rl-test-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table:
    row `req_pool_indices[i]`, columns `start_offset[i]:end_offset[i]`, taken in order from
    `out_cache_loc`."""
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by megatron-rl's test-only CPU stand-in"
        )

    missing.__name__ = name
    return missing
