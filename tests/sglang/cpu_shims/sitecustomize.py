"""TEST-ONLY (see README.md here): lets SGLang 0.5.23 run on a CPU-only torch.

Python imports `sitecustomize` at start-up when this folder is on PYTHONPATH. It installs one
import hook that acts on three modules when (and only if) they are first imported:
- `torchvision`: define the `torchvision::nms` / `qnms` op schemas first, so that PyPI's CUDA
  build of torchvision, whose `_C.so` cannot load here, still imports;
- `sglang.srt.mem_cache.pool_host.common`: after it loads, make `_cuda_host_register` a no-op
  when CUDA is absent (routed-experts capture pins its host buffer with cudaHostRegister);
- `sglang.srt.models.deepseek_common.attention_backend_handler`: after it loads, give the
  `torch_native` attention backend a DeepSeek (MLA) handler, the absorbed MLA path; without one
  SGLang falls back to triton's, whose prefill reads full keys from the latent cache.
"""

import importlib.abc
import importlib.util
import sys

_TORCHVISION = "torchvision"
_HOST_POOL = "sglang.srt.mem_cache.pool_host.common"
_MLA_HANDLERS = "sglang.srt.models.deepseek_common.attention_backend_handler"
# Op libraries must outlive the call that defines them.
_libraries = []


def _define_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libraries.append(library)


def _skip_host_register(module) -> None:
    import torch

    if not torch.cuda.is_available():
        module._cuda_host_register = lambda *args, **kwargs: None


def _mla_handler_for_torch_native(module) -> None:
    registry = module.AttentionBackendRegistry
    if "torch_native" not in registry._handlers:
        registry.register("torch_native", module._dispatch_mla_subtype)


_AFTER_LOAD = {_HOST_POOL: _skip_host_register, _MLA_HANDLERS: _mla_handler_for_torch_native}


class _CpuShimFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending = {_TORCHVISION, *_AFTER_LOAD}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if name == _TORCHVISION:
            _define_torchvision_schemas()
            return None  # the normal finders load torchvision itself
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _AFTER_LOAD[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CpuShimFinder())
