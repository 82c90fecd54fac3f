"""Each CPU patch: the upstream code still fails without it (so it is still needed), and the
patched code works. The layout-invariance tests exercise them all together on 2 ranks."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from megatron_rl.parallel import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patches")


@pytest.fixture(scope="module", autouse=True)
def patched():
    names = cpu_compat.apply()
    assert names == [patch.name for patch in cpu_compat.PATCHES]


def test_apply_is_idempotent_and_keeps_the_first_originals():
    first = cpu_compat.original("current_device", "current_device")
    cpu_compat.apply()
    assert cpu_compat.original("current_device", "current_device") is first


def test_current_device():
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        cpu_compat.original("current_device", "current_device")()
    assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"


def test_cuda_streams():
    with pytest.raises(RuntimeError, match="CUDA"):
        cpu_compat.original("cuda_streams", "Stream")()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        event = stream.record_event()
    event.synchronize()
    torch.ones(2).record_stream(torch.cuda.current_stream())


def test_cuda_rng():
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        cpu_compat.original("cuda_rng", "get_rng_state")()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-rng", 7)
    torch.manual_seed(0)
    with tracker.fork("test-rng"):
        forked = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))  # the default stream is restored after the fork
    torch.manual_seed(7)
    assert torch.equal(forked, torch.rand(3))  # the fork drew from its own seeded state
    tracker.reset()


def test_te_names_in_moe_utils():
    from megatron.core.transformer.moe import moe_utils

    # every name was missing upstream when the patch ran (else the patch would not record it)
    assert set(cpu_compat._originals["te_names_in_moe_utils"]) == set(cpu_compat.MOE_UTILS_TE_NAMES)
    source = inspect.getsource(moe_utils)
    assert "te_general_gemm is not None" in source or "if te_general_gemm" in source
    assert all(getattr(moe_utils, name) is None for name in cpu_compat.MOE_UTILS_TE_NAMES)


def test_causal_mask():
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        cpu_compat.original("causal_mask", "get_default_causal_mask")(4)
    from megatron.core.fusions import fused_softmax

    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_alltoall_split_sizes():
    original = cpu_compat.original("alltoall_split_sizes", "maybe_move_tensor_to_cpu")
    splits = torch.tensor([3, 1])
    assert isinstance(original(splits, as_numpy=True), torch.Tensor)  # not the list-like numpy
    from megatron.core.transformer.moe import token_dispatcher

    moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 1]
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is not None


def _config(sequence_parallel: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )


def test_norm_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = cpu_compat.original("norm_sequence_parallel", "__new__")
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        original(WrappedTorchNorm, _config(True), 8)
    norm = WrappedTorchNorm(_config(True), 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel is True
    plain = WrappedTorchNorm(_config(False), 8)
    assert not hasattr(plain.weight, "sequence_parallel")


@pytest.mark.parametrize(
    ("module_name", "function", "snippet"),
    [
        (
            "megatron.core.pipeline_parallel.schedules",
            "forward_backward_no_pipelining",
            'torch.zeros([], dtype=torch.int, device="cuda")',
        ),
        ("megatron.core.optimizer.optimizer", "FP32Optimizer", "device='cuda'"),
        ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'"),
        ("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"'),
    ],
)
def test_host_tensor_factories(module_name, function, snippet):
    import importlib

    module = importlib.import_module(module_name)
    assert snippet in inspect.getsource(getattr(module, function))  # upstream still asks CUDA
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.zeros([], device="cuda")  # and the real torch cannot give it
    assert isinstance(module.torch, cpu_compat._HostFactoryTorch)
    counter = module.torch.zeros([], dtype=torch.int, device="cuda")
    flag = module.torch.tensor([1.0], dtype=torch.float, device="cuda")
    assert counter.device.type == flag.device.type == "cpu" and counter.dtype == torch.int
    assert module.torch.float32 is torch.float32  # everything else passes through


def test_clip_grads_on_host():
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    with pytest.raises(AssertionError):
        clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
    megatron_optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
    torch.testing.assert_close(param.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))
    megatron_optimizer.clip_grad_by_total_norm_fp32([param], max_norm=10.0, total_norm=6.0)
    torch.testing.assert_close(param.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))  # unclipped


def test_optimizer_host_params():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def build_groups(param: torch.nn.Parameter) -> tuple:
        # the smallest input of the parameter sorting the optimizer's __init__ runs: one bucket
        # holding one whole parameter, in one group
        return DistributedOptimizer._build_model_and_main_param_groups(
            [{param.dtype: [{"param_map": {param: {"param": Range(0, param.numel())}}}]}],
            {param: (0, param.dtype, 0)},
            [{"params": [param], "orig_group": {}}],
            OptimizerConfig(),
        )

    param = torch.nn.Parameter(torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"must be one of torch\.cuda\.FloatTensor"):
        build_groups(param)  # upstream still refuses host parameters
    mixed_precision_source = inspect.getsource(
        cpu_compat.original("optimizer_host_params.Float16OptimizerWithFloat16Params", "__init__")
    )
    assert "param.type() == 'torch.cuda.FloatTensor'" in mixed_precision_source  # here too
    with cpu_compat._host_tensors_typed_as_cuda():
        assert param.type() == "torch.cuda.FloatTensor"
        assert param.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(2, dtype=torch.int64).type() == "torch.LongTensor"
        assert param.type(torch.float64).dtype == torch.float64  # conversions pass through
        _, model_fp32_groups, _, shard_fp32_groups, _ = build_groups(param)
    assert model_fp32_groups == [[param]] and shard_fp32_groups[0][0].shape == (6,)
    assert param.type() == "torch.FloatTensor"  # only while an optimizer is being built
    for optimizer_class in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        name = f"optimizer_host_params.{optimizer_class.__name__}"
        assert optimizer_class.__init__ is not cpu_compat.original(name, "__init__")


def test_tied_embeddings_on_host():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = cpu_compat.original("tied_embeddings_on_host", "setup_embeddings_and_output_layer")
    assert "weight.data = weight.data.cuda()" in inspect.getsource(setup)  # still in upstream
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
        torch.ones(2).cuda()
    host = torch.ones(2)
    with cpu_compat._cuda_copies_stay_on_host():
        assert host.cuda() is host
    assert LanguageModule.setup_embeddings_and_output_layer is not setup
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
        host.cuda()  # only while the embeddings are being set up


def test_mla_without_te():
    from megatron.core.transformer import multi_latent_attention

    assert cpu_compat.original("mla_without_te", "HAVE_TE") is True  # wrongly, upstream
    with pytest.raises(TypeError, match="isinstance"):
        isinstance(torch.nn.Linear(1, 1), multi_latent_attention.TELinear)  # a MagicMock
    assert multi_latent_attention.HAVE_TE is False


def test_mla_local_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    upstream = inspect.signature(cpu_compat.original("mla_local_core_attention", "__init__"))
    assert "k_channels" not in upstream.parameters and "v_channels" not in upstream.parameters
    patched = inspect.signature(DotProductAttention.__init__)
    assert {"k_channels", "v_channels"} <= set(patched.parameters)
    # Built end to end (an MLA model's logits against Hugging Face's) in tests/checkpoint.
