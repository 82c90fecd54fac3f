"""Benchmark: the training step's throughput and model FLOP utilisation (MFU), on one rank.

A randomly initialised MoE of the given shape trains for a few optimizer steps of the GSPO loss
on synthetic rollouts (random tokens, a response mask, old log-probs, advantages of both signs),
through the trainer's own path: megatron-core's model, DDP wrapper, Adam and schedule
(megatron_rl.trainer). Reported: trained tokens per second, model FLOPs per token, achieved
FLOP/s, the machine's matrix-product peak measured in the same run (a square product in the
model's dtype), MFU = achieved / peak, and the peak memory.

Model FLOPs per trained token: 3 x the forward's (the backward costs twice the forward;
recomputation is not counted, as MFU counts), with
    forward = 2 x matmul_parameters + 2 x layers x seq x q    (causal attention: QK^T and AV,
                                                               half the sequence on average)
    matmul_parameters = layers x (h (q + 2 kv) + q h + experts h + topk 3 h f + 3 h f_shared)
                        + vocab h
the parameters a token multiplies through (the router's, its top-k experts'; h hidden, q and kv
the query and key/value widths, f the expert FFN width). tests/bench/test_train_step_bench.py
checks the matmul part against torch's FLOP counter on the built model.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from megatron.core.distributed import DistributedDataParallel

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.bench.report import machine, now, resident_kib
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.models.build import build_gpt_moe, transformer_engine_available
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward


@dataclass(frozen=True)
class TrainStepSpec:
    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    experts: int = 32
    topk: int = 4
    moe_ffn: int = 768
    vocab: int = 151_936
    seq: int = 4096
    micro_batch: int = 1
    micro_batches: int = 4
    steps: int = 4  # timed optimizer steps, after one warm-up step
    dtype: str = "bfloat16"
    recompute: bool = False
    grouped_experts: bool = True  # False: megatron-core's loop over experts
    matmul_size: int = 8192  # of the square product that measures the peak

    def model(self) -> MoEModelConfig:
        return MoEModelConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            num_query_groups=self.kv_heads,
            ffn_hidden_size=4 * self.hidden,
            moe_ffn_hidden_size=self.moe_ffn,
            num_experts=self.experts,
            router_topk=self.topk,
            qk_layernorm=True,
            vocab_size=self.vocab,
            max_position_embeddings=self.seq,
            dtype=self.dtype,
        )


def matmul_parameters(model: MoEModelConfig) -> int:
    """The weights a token multiplies through in one forward (module docstring)."""
    h = model.hidden_size
    query = model.num_attention_heads * model.kv_channels
    key_value = model.num_query_groups * model.kv_channels
    per_layer = (
        h * (query + 2 * key_value)
        + query * h
        + model.num_experts * h
        + model.router_topk * 3 * h * model.moe_ffn_hidden_size
        + 3 * h * (model.shared_expert_ffn_hidden_size or 0)
    )
    return model.num_layers * per_layer + model.vocab_size * h


def training_flops_per_token(model: MoEModelConfig, seq: int) -> int:
    """Model FLOPs of one trained token at sequence length `seq` (module docstring)."""
    query = model.num_attention_heads * model.kv_channels
    forward = 2 * matmul_parameters(model) + 2 * model.num_layers * seq * query
    return 3 * forward


def matmul_peak(size: int, dtype: torch.dtype, device: torch.device, repeats: int = 10) -> float:
    """FLOP/s of a `size`^3 matrix product on random data: the mean of `repeats` timed
    products after three warm-ups."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    for _ in range(3):
        a @ b
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rollouts(spec: TrainStepSpec, device: torch.device) -> list[PolicyMicroBatch]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(spec.micro_batches):
        shape = (spec.micro_batch, spec.seq)
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[:, spec.seq // 4 : spec.seq - 1] = True  # a prompt, then the response
        advantages = torch.randn(spec.micro_batch, generator=gen)
        batches.append(
            PolicyMicroBatch(
                tokens=torch.randint(0, spec.vocab, shape, generator=gen).to(device),
                loss_mask=mask.to(device),
                old_logp=torch.full(shape, -torch.log(torch.tensor(float(spec.vocab)))).to(device),
                advantages=advantages.to(device),
            )
        )
    return batches


@contextlib.contextmanager
def training_step(
    spec: TrainStepSpec, batches: list[PolicyMicroBatch] | None = None
) -> Iterator[tuple[Callable[[], None], DistributedDataParallel]]:
    """One rank's process groups, `spec`'s model (CUDA when there is one), Adam and `batches`
    (default: `spec`'s synthetic rollouts); yields a function that runs one optimizer step on
    them, and the model. The groups are shut down after."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, LaunchEnv.from_environ({}))
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = wrap_for_training(
            build_gpt_moe(
                spec.model(),
                dims,
                recompute=spec.recompute,
                grouped_experts=spec.grouped_experts,
            ),
            distributed_optimizer=False,
        )
        optimizer = build_optimizer(model, OptimConfig(lr=1e-6))
        loss = PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4, check_finite=False)
        batches = (
            _rollouts(spec, device) if batches is None else [micro.to(device) for micro in batches]
        )

        def step() -> None:
            model.zero_grad_buffer()  # as Policy.update does
            optimizer.zero_grad()
            policy_forward_backward(model, batches, loss)
            optimizer.step()

        yield step, model
    finally:
        shutdown_distributed()


def timed_steps(step: Callable[[], None], device: torch.device, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`, after one warm-up call not timed."""
    seconds = []
    for index in range(steps + 1):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        if index:
            seconds.append(time.perf_counter() - start)
    return seconds


def run_benchmark(spec: TrainStepSpec) -> dict[str, object]:
    """Train `spec`'s model on one rank (CUDA when there is one) and measure it."""
    model_config = spec.model()
    with training_step(spec) as (step, model):
        device = next(model.parameters()).device
        seconds = timed_steps(step, device, spec.steps)
        if device.type == "cuda":
            peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            peak_mib = resident_kib("VmHWM") / 1024
        parameters = sum(p.numel() for p in model.module.parameters())
    peak = matmul_peak(spec.matmul_size, model_config.torch_dtype, device)
    tokens = spec.micro_batches * spec.micro_batch * spec.seq
    step_s = statistics.median(seconds)
    flops = training_flops_per_token(model_config, spec.seq)
    achieved = flops * tokens / step_s
    return {
        "spec": asdict(spec),
        "parameters": parameters,
        "matmul_parameters_per_token": matmul_parameters(model_config),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "transformer_engine": transformer_engine_available(),
        "step_seconds": seconds,
        "step_seconds_median": step_s,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / step_s,
        "flops_per_token": flops,
        "achieved_flops": achieved,
        "matmul_peak_flops": peak,
        "mfu": achieved / peak,
        "peak_memory_mib": peak_mib,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec = report["spec"]
    return "\n".join(
        [
            f"Training step of a random MoE, one rank on {report['device']} "
            f"(Transformer Engine: {report['transformer_engine']}): {spec['layers']} layers, "
            f"hidden {spec['hidden']}, {spec['experts']} experts top-{spec['topk']} "
            f"(FFN {spec['moe_ffn']}, {_experts_kind(spec)}), vocab {spec['vocab']}, "
            f"{report['parameters'] / 1e9:.2f} B "
            f"parameters, {spec['dtype']}; GSPO, {spec['micro_batches']} micro-batches of "
            f"{spec['micro_batch']} x {spec['seq']} tokens per step, recompute "
            f"{'on' if spec['recompute'] else 'off'}; median of {spec['steps']} steps after one "
            f"warm-up; {report['machine']['cpu']}, torch {report['machine']['torch']}, "
            f"{report['date']}.",
            "",
            "| step (s) | tokens/s | model TFLOP/s | matmul peak (TFLOP/s) | MFU "
            "| peak memory (GiB) |",
            "|---|---|---|---|---|---|",
            f"| {report['step_seconds_median']:.3f} | {report['tokens_per_second']:.0f} | "
            f"{report['achieved_flops'] / 1e12:.1f} | {report['matmul_peak_flops'] / 1e12:.1f} | "
            f"{report['mfu']:.1%} | {report['peak_memory_mib'] / 1024:.1f} |",
            "",
            f"Model FLOPs per trained token: {report['flops_per_token'] / 1e9:.2f} G (3 x the "
            f"forward; {report['matmul_parameters_per_token'] / 1e9:.3f} B matmul parameters per "
            "token, causal attention; megatron_rl/bench/train_step.py).",
        ]
    )


def _experts_kind(spec: dict) -> str:
    """How the spec's experts ran: grouped GEMMs or megatron-core's loop."""
    return "grouped GEMMs" if spec.get("grouped_experts", True) else "loop over experts"


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "train_step", format_markdown)
