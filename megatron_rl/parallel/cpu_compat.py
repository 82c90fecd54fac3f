"""The named, minimal patches that let megatron-core 0.16.1 run on a CUDA-less torch with gloo.

Applied once per process by `apply()`, and only when CUDA is absent: on a GPU nothing here runs.
Each patch names the upstream file and line it works around and keeps the original, so that the
tests can show, patch by patch, that the upstream code still fails without it (the patch is still
needed) and works with it. Paths are relative to the installed `megatron/core/` package.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_applied = False
_originals: dict[str, dict[str, Any]] = {}


class _HostEvent:
    """Stands in for torch.cuda.Event: on the host, work is already complete when recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time: float | None = None

    def record(self, *args: Any, **kwargs: Any) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1000.0 * ((end._time or 0.0) - (self._time or 0.0))


class _HostStream:
    """Stands in for torch.cuda.Stream: the host has one stream, so ordering is implicit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, *args: Any, **kwargs: Any) -> _HostEvent:
        event = _HostEvent()
        event.record()
        return event


_HOST_STREAM = _HostStream()


def _patch(name: str, owner: object, attribute: str, replacement: object) -> None:
    _originals.setdefault(name, {})[attribute] = getattr(owner, attribute, None)
    setattr(owner, attribute, replacement)


def _current_device() -> None:
    # models/common/embeddings/rotary_pos_embedding.py:162, transformer/moe/router.py:90 and ~100
    # other sites pass torch.cuda.current_device() as a device; on a CPU build it raises
    # "Torch not compiled with CUDA enabled". The host is device "cpu".
    _patch("current_device", torch.cuda, "current_device", lambda: "cpu")


def _cuda_streams() -> None:
    # transformer/moe/token_dispatcher.py:445 creates torch.cuda.Stream() for the alltoall
    # dispatcher's device-to-host copies (used at lines 871-899 with events and record_stream).
    _patch("cuda_streams", torch.cuda, "Stream", _HostStream)
    _patch("cuda_streams", torch.cuda, "Event", _HostEvent)
    _patch("cuda_streams", torch.cuda, "current_stream", lambda *a, **k: _HOST_STREAM)
    _patch("cuda_streams", torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _patch("cuda_streams", torch.cuda, "synchronize", lambda *a, **k: None)
    _patch("cuda_streams", torch.Tensor, "record_stream", lambda self, *a, **k: None)


def _cuda_rng() -> None:
    # tensor_parallel/random.py: model_parallel_cuda_manual_seed and CudaRNGStatesTracker keep
    # per-group CUDA generator states (_get_cuda_rng_state / _set_cuda_rng_state,
    # torch.cuda.get_rng_state). On the host the CPU generator takes their place.
    from megatron.core.tensor_parallel import random as megatron_random

    _patch("cuda_rng", torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch("cuda_rng", torch.cuda, "manual_seed", torch.manual_seed)
    _patch(
        "cuda_rng", megatron_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()
    )
    _patch(
        "cuda_rng",
        megatron_random,
        "_set_cuda_rng_state",
        lambda new_state, *a, **k: torch.set_rng_state(new_state),
    )


MOE_UTILS_TE_NAMES = (
    "te_general_gemm",
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_unpermute",
)


def _te_names_in_moe_utils() -> None:
    # transformer/moe/moe_utils.py (0.16.1) binds these names only when Transformer Engine
    # imports, but tests them for None unconditionally (e.g. `if te_general_gemm is not None`),
    # which raises NameError without TE. Bind the missing ones to None, as upstream intends.
    from megatron.core.transformer.moe import moe_utils

    for name in MOE_UTILS_TE_NAMES:
        if not hasattr(moe_utils, name):
            _patch("te_names_in_moe_utils", moe_utils, name, None)


def _causal_mask() -> None:
    # transformer/utils.py:35 get_default_causal_mask builds its mask with device="cuda";
    # fusions/fused_softmax.py imports it by name, so both references are replaced.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def host_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    _patch("causal_mask", transformer_utils, "get_default_causal_mask", host_causal_mask)
    _patch("causal_mask", fused_softmax, "get_default_causal_mask", host_causal_mask)


def _alltoall_split_sizes() -> None:
    # transformer/moe/moe_utils.py:1093 maybe_move_tensor_to_cpu converts only CUDA tensors to
    # numpy; on the host the alltoall dispatcher (token_dispatcher.py:879-886) then hands tensors
    # to all_to_all_single as split sizes, which wants a list of ints (TypeError).
    from megatron.core.transformer.moe import token_dispatcher

    def move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                return tensor.numpy()
        return tensor

    _patch("alltoall_split_sizes", token_dispatcher, "maybe_move_tensor_to_cpu", move_to_host)


def _norm_sequence_parallel() -> None:
    # transformer/torch_norm.py:32 WrappedTorchNorm asserts `not config.sequence_parallel`. A
    # torch RMSNorm is per token, so it is exact on a sequence shard; only its weight gradient
    # is partial per TP rank, and megatron-core sums the gradients of parameters marked
    # `sequence_parallel` over TP (distributed/finalize_model_grads.py:354). Build the norm as
    # without SP and mark its parameters.
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    _patch("norm_sequence_parallel", torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


def _on_host(device: Any) -> Any:
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _HostFactoryTorch:
    """The torch module as one upstream module sees it, with device="cuda" factories on host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_on_host(device), **kwargs)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device=_on_host(device), **kwargs)


def _host_tensor_factories() -> None:
    # Counters and flags created with an explicit device="cuda":
    #   pipeline_parallel/schedules.py:596, 983, 2138  torch.zeros([], ..., device="cuda")
    #   optimizer/optimizer.py:473, 481, 485, 907       torch.tensor([...], device='cuda')
    #   optimizer/clip_grads.py:90, 103, 115, 174, 207  torch.tensor / torch.zeros(device='cuda')
    #   utils.py:1207 (local_multi_tensor_l2_norm)      torch.tensor([...], device="cuda")
    # Each of these modules gets a torch whose zeros / tensor put "cuda" tensors on the host.
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    for module in (schedules, megatron_optimizer, clip_grads, megatron_utils):
        _patch("host_tensor_factories", module, "torch", _HostFactoryTorch())


def _clip_grads_on_host() -> None:
    # optimizer/clip_grads.py:167 clip_grad_by_total_norm_fp32 asserts every gradient is a
    # 'torch.cuda.FloatTensor' (then scales them with the multi-tensor applier). The optimizer
    # calls it by the name it imported (optimizer/optimizer.py); on the host the same scaling
    # is an in-place multiply.
    from megatron.core.optimizer import optimizer as megatron_optimizer

    def clip_by_total_norm(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        scale = max_norm / (total_norm + 1.0e-6)
        if scale >= 1.0:
            return
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        attribute = "decoupled_grad" if use_decoupled_grad else "grad"
        for param in params:
            grad = getattr(param, attribute, None)
            if grad is not None:
                grad.detach().mul_(scale)

    _patch(
        "clip_grads_on_host",
        megatron_optimizer,
        "clip_grad_by_total_norm_fp32",
        clip_by_total_norm,
    )


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
}


@contextlib.contextmanager
def _tensor_method_replaced(name: str, replace: Callable[[Any], Any]) -> Iterator[None]:
    """While active, the tensor method `name` is `replace(original method)`."""
    original = getattr(torch.Tensor, name)
    setattr(torch.Tensor, name, replace(original))
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def _within(context: Callable[[], Any], method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, run inside a fresh `context()` at every call."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with context():
            return method(self, *args, **kwargs)

    return run


def _cuda_type_names(host_type: Callable[..., Any]) -> Callable[..., Any]:
    def type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return host_type(self, *args, **kwargs)

    return type_name


def _host_tensors_typed_as_cuda() -> contextlib.AbstractContextManager[None]:
    """While active, `tensor.type()` of a floating host tensor names its CUDA type."""
    return _tensor_method_replaced("type", _cuda_type_names)


def _optimizer_host_params() -> None:
    # Two optimizers sort parameters by `param.type()` while they are built, accepting only
    # 'torch.cuda.{Float,Half,BFloat16}Tensor' and raising TypeError for anything else:
    #   optimizer/distrib_optimizer.py:361, 420, 582  DistributedOptimizer.__init__ and the
    #                                                 _build_model_and_main_param_groups it calls
    #   optimizer/optimizer.py:671, 690               Float16OptimizerWithFloat16Params.__init__
    #                                                 (the plain optimizer of bf16 parameters)
    # Host parameters are sorted the same way by their dtype while these are built; everything
    # they do afterwards (for the distributed one, reduce-scatter of gradients and all-gather
    # of weights) runs on gloo as it is.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for optimizer_class in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        _patch(
            f"optimizer_host_params.{optimizer_class.__name__}",
            optimizer_class,
            "__init__",
            _within(_host_tensors_typed_as_cuda, optimizer_class.__init__),
        )


def _stay_on_host(host_cuda: Callable[..., Any]) -> Callable[..., Any]:
    def stay(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.device.type == "cpu" else host_cuda(self, *args, **kwargs)

    return stay


def _cuda_copies_stay_on_host() -> contextlib.AbstractContextManager[None]:
    """While active, `tensor.cuda()` of a host tensor returns the tensor itself."""
    return _tensor_method_replaced("cuda", _stay_on_host)


def _tied_embeddings_on_host() -> None:
    # models/common/language_module/language_module.py:244: with tied embeddings and more than
    # one pipeline stage, the last stage's copy of the embedding is moved with `.cuda()` before
    # the all-reduce that gives it the first stage's values (AssertionError "Torch not compiled
    # with CUDA enabled" on a CPU build). On the host the copy stays where it is.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _patch(
        "tied_embeddings_on_host",
        LanguageModule,
        "setup_embeddings_and_output_layer",
        _within(_cuda_copies_stay_on_host, LanguageModule.setup_embeddings_and_output_layer),
    )


def _mla_without_te() -> None:
    # transformer/multi_latent_attention.py:50-63 sets HAVE_TE = True whenever
    # extensions/transformer_engine.py imports, and that module imports without Transformer
    # Engine too (it stands TE in with a MagicMock), so TELinear is a MagicMock; line 185 then
    # calls isinstance(linear_proj, TELinear) and every MLA layer fails to build (TypeError).
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        _patch("mla_without_te", multi_latent_attention, "HAVE_TE", False)


def _mla_local_core_attention() -> None:
    # transformer/multi_latent_attention.py:155 builds its core attention with k_channels and
    # v_channels (MLA's query/key heads are wider than its value heads); the local spec's
    # DotProductAttention (transformer/dot_product_attention.py:42) takes neither (TypeError),
    # and sizes its output by kv_channels (line 228). It takes them here and sizes its output by
    # the value heads; its matmuls already follow the tensors' own widths.
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    upstream_init = DotProductAttention.__init__

    def init_with_head_widths(
        self: DotProductAttention,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ) -> None:
        upstream_init(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    _patch("mla_local_core_attention", DotProductAttention, "__init__", init_with_head_widths)


@dataclass(frozen=True)
class CpuPatch:
    name: str
    apply: Callable[[], None]


PATCHES = (
    CpuPatch("current_device", _current_device),
    CpuPatch("cuda_streams", _cuda_streams),
    CpuPatch("cuda_rng", _cuda_rng),
    CpuPatch("te_names_in_moe_utils", _te_names_in_moe_utils),
    CpuPatch("causal_mask", _causal_mask),
    CpuPatch("alltoall_split_sizes", _alltoall_split_sizes),
    CpuPatch("norm_sequence_parallel", _norm_sequence_parallel),
    CpuPatch("host_tensor_factories", _host_tensor_factories),
    CpuPatch("clip_grads_on_host", _clip_grads_on_host),
    CpuPatch("optimizer_host_params", _optimizer_host_params),
    CpuPatch("tied_embeddings_on_host", _tied_embeddings_on_host),
    CpuPatch("mla_without_te", _mla_without_te),
    CpuPatch("mla_local_core_attention", _mla_local_core_attention),
)


def needed() -> bool:
    """True when this torch has no CUDA, so megatron-core needs the patches."""
    return not torch.cuda.is_available()


def apply() -> list[str]:
    """Apply every patch once (no-op with CUDA or when already applied); returns their names."""
    global _applied
    if not needed():
        return []
    if not _applied:
        for patch in PATCHES:
            patch.apply()
        _applied = True
    return [patch.name for patch in PATCHES]


def original(patch_name: str, attribute: str) -> Any:
    """What `attribute` was before patch `patch_name` replaced it (for the tests)."""
    return _originals[patch_name][attribute]
