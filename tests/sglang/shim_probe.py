"""Run by test_cpu_shims.py with .venv-sglang's python, with or without the CPU shims on
PYTHONPATH: tries what each shim stands for and prints one JSON line of outcomes."""

import json
import traceback


def attempt(check) -> str:
    try:
        return f"ok: {check()}"
    except BaseException as error:  # the outcome is the report
        return f"error: {type(error).__name__}: {error}"[:400]


def torchvision_imports() -> str:
    import torchvision

    return torchvision.__version__


def assign_req_to_token_pool() -> list:
    import torch
    from sgl_kernel import assign_req_to_token_pool_cpu

    table = torch.zeros(3, 6, dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        table,
        torch.tensor([1, 0]),
        torch.tensor([3, 3]),
        torch.tensor([7, 8, 9, 10, 11]),
        2,
    )
    return table.tolist()


def other_kernels_fail_loudly() -> str:
    import sgl_kernel

    sgl_kernel.fused_experts_cpu()
    return "called"


def pinned_host_register() -> str:
    import torch
    from sglang.srt.mem_cache.pool_host import common

    common._cuda_host_register(torch.zeros(4))
    return "registered"


def pinned_host_register_unpatched() -> str:
    """The same call with the module as SGLang ships it (a reload passes the shim's hook by)."""
    import importlib

    import torch
    from sglang.srt.mem_cache.pool_host import common

    importlib.reload(common)._cuda_host_register(torch.zeros(4))
    return "registered"


def mla_torch_native_handler() -> str:
    """Which handler DeepSeek's attention gets on the torch_native backend."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    return handlers.AttentionBackendRegistry.get_handler("torch_native").__name__


def mla_torch_native_handler_unpatched() -> str:
    """The same with the module as SGLang ships it (a reload passes the shim's hook by)."""
    import importlib

    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    registry = importlib.reload(handlers).AttentionBackendRegistry
    return registry.get_handler("torch_native").__name__


if __name__ == "__main__":
    checks = [torchvision_imports, assign_req_to_token_pool, other_kernels_fail_loudly]
    checks += [pinned_host_register, pinned_host_register_unpatched]
    checks += [mla_torch_native_handler, mla_torch_native_handler_unpatched]
    try:
        print(json.dumps({check.__name__: attempt(check) for check in checks}))
    except BaseException:
        traceback.print_exc()
        raise
