"""What a recipe's layout holds on each GPU of a cluster, before anything runs (`megatron-rl plan`).

Parameters are counted as megatron-core lays them out on a rank (its pipeline stage, its TP and
EP shards; tests/launch/test_plan.py checks the counts against built models, the tiny ones
(Qwen3-MoE- and DeepSeek-V3-shaped) at several layouts and Qwen3-30B-A3B on the meta device).
Memory per rank, in bytes:

- weights: parameters x the model dtype's size (twice with a KL penalty: the frozen reference);
- gradients: parameters x 4 (megatron-core's DDP keeps fp32 `main_grad` buffers, full size
  even with the distributed optimizer, megatron_rl/trainer/optimizer.py);
- optimizer (Adam): 12 bytes per bf16 parameter (fp32 main weight and two moments), 8 per fp32
  one (the moments); the distributed optimizer divides the dense part by dp * cp and the expert
  part by edp, the data-parallel copies of each;
- activations, an estimate for the GPU path (Transformer Engine, flash attention, activations
  in the model dtype, sequence parallelism whenever tp > 1): per layer and micro-batch of
  b sequences of s tokens, with t = tp and a = the dtype's size,
    attention  s*b/t * (a * (2h + 2q + 2kv) + 4 * heads)   LN input, QKV input, Q, K, V, output,
                                                           the softmax statistics (fp32)
    router     s*b/t * (2a * h + 8 * experts)              LN input, router input, fp32 logits
                                                           and probabilities
    experts    s*b*k*etp/t * a * (2h + 3 f / etp)          each of the k copies of a token: its
                                                           permuted input, fc2 output, fc1 output
                                                           (2f) and activation (f)
    shared     s*b/t * a * (h + 3 f_shared)
  (h hidden, q = heads x head_dim, kv = kv heads x head_dim, f the expert FFN width), routing
  balanced over the experts. Multi-latent attention keeps, in place of 2q + 2kv, its queries,
  keys, values, output and latents (heads x (2 (nope + rope) + 2 v) + the ranks); a dense layer
  (DeepSeek-V3's first ones) keeps attention and s*b/t * a * (h + 3 f_dense) for its FFN.
  With recompute (full, uniform, one layer) a layer keeps only its input, s*b/t * a * h, and
  one layer's activations exist at a time in the backward. 1F1B
  pipelining keeps pp - stage micro-batches in flight (fewer when a minibatch has fewer);
- logits on the last stage: s*b * vocab/tp, in the model dtype, and their gradient;
- the routing-replay record (R2, R3): the step's tokens on this rank x its MoE layers x top-k,
  as int64 indices;
- the rollout engine's share, on the GPUs that also host an SGLang server the trainer starts
  (rollout.backend=sglang without rollout nodes): mem_fraction_static x the GPU's memory.
A fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) comes on top.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.files.hf_checkpoint import read_config, read_config_file
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import family_for
from megatron_rl.moe.replay_mode import RoutingReplayMode
from megatron_rl.parallel.dims import ParallelConfig, ParallelDims
from megatron_rl.trainer.recipe import Recipe

GIB = 2**30
BYTES = {"bfloat16": 2, "float32": 4}
INDEX_BYTES = 8  # top-k expert indices (torch.topk's int64)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The GPUs a recipe is planned for (the options of `megatron-rl plan`)."""

    nodes: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    reserve_gib: float = 4.0
    prompt_tokens: int = 1024
    rollout_nodes: int = 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget_bytes(self) -> int:
        """What a rank may hold: the GPU's memory less the reserve."""
        return int((self.gpu_memory_gib - self.reserve_gib) * GIB)


@dataclass(frozen=True)
class RankParameters:
    """One rank's parameters: `dense` (attention, norms, router, embeddings, shared experts;
    copies on the dp * cp ranks of its data-parallel group) and `expert` (its routed experts;
    copies on edp ranks)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_layer_counts(model: MoEModelConfig, dims: ParallelDims, stage: int) -> tuple[int, int]:
    """How many dense and how many MoE layers pipeline stage `stage` holds (the dense ones, a
    model's first layers, fall on the first stages)."""
    per_stage = model.num_layers // dims.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    moe = sum(1 for layer in layers if layer in model.moe_layers)
    return per_stage - moe, moe


def _attention_parameters(model: MoEModelConfig, tp: int) -> int:
    """One layer's attention weights on a rank: GQA (fused QKV, its biases and head norms where
    the model has them, output projection), or multi-latent attention (down-projections split
    by TP like column-parallel layers, their norms whole, up-projections and output split)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if not model.multi_latent_attention:
        query = heads * model.kv_channels
        key_value = model.num_query_groups * model.kv_channels
        qkv = query + 2 * key_value
        return (
            h * qkv // tp
            + (qkv // tp if model.qkv_bias else 0)
            + query * h // tp
            + (2 * model.kv_channels if model.qk_layernorm else 0)
        )
    query_head = model.qk_nope_head_dim + model.qk_rope_head_dim
    if model.q_lora_rank is None:
        query = h * heads * query_head // tp
    else:
        rank = model.q_lora_rank
        query = h * rank // tp + rank + rank * heads * query_head // tp
    latent = model.kv_lora_rank
    key_value = (
        h * (latent + model.qk_rope_head_dim) // tp
        + latent
        + latent * heads * (model.qk_nope_head_dim + model.v_head_dim) // tp
    )
    return query + key_value + heads * model.v_head_dim * h // tp


def rank_parameters(model: MoEModelConfig, dims: ParallelDims, stage: int) -> RankParameters:
    """The parameters of a rank of pipeline stage `stage` (every rank of a stage holds as many)."""
    h, tp = model.hidden_size, dims.tp
    per_layer = 2 * h + _attention_parameters(model, tp)  # + input and pre-MLP RMSNorm
    dense_mlp = 3 * h * model.ffn_hidden_size // tp
    moe_layer = (
        model.num_experts * h  # router
        + 3 * h * (model.shared_expert_ffn_hidden_size or 0) // tp
    )
    expert_per_layer = model.num_experts // dims.ep * 3 * h * model.moe_ffn_hidden_size // dims.etp
    dense_layers, moe_layers = stage_layer_counts(model, dims, stage)
    dense = (dense_layers + moe_layers) * per_layer + dense_layers * dense_mlp
    dense += moe_layers * moe_layer
    embedding = model.vocab_size // tp * h
    if stage == 0:
        dense += embedding
    if stage == dims.pp - 1:
        dense += h  # final RMSNorm
        # The output layer; tied to the embedding it is that weight, except on a last stage of
        # its own, which keeps a copy.
        if not model.tie_word_embeddings or dims.pp > 1:
            dense += embedding
    return RankParameters(dense=dense, expert=moe_layers * expert_per_layer)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes (module docstring)."""

    stage: int
    parameters: RankParameters
    weights: int
    gradients: int
    optimizer: int
    optimizer_plain: int
    activations: int
    logits: int
    routing_record: int
    engine: int
    reference: int = 0  # the frozen reference policy's weights (algo.kl_coef > 0)

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.reference
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.routing_record
            + self.engine
        )


@dataclass(frozen=True)
class Workload:
    """What the recipe asks of each rank per step."""

    sequence: int  # tokens per sequence (prompt + response)
    micro_batch: int
    samples_per_update: int  # sequences of one minibatch update, all ranks together
    samples_per_step: int
    recompute: bool
    replay: bool


def workload(recipe: Recipe, cluster: Cluster, *, micro_batch: int | None = None) -> Workload:
    samples = recipe.rollout.prompts_per_step * recipe.rollout.group_size
    return Workload(
        sequence=cluster.prompt_tokens + recipe.rollout.max_new_tokens,
        micro_batch=micro_batch or recipe.run.micro_batch_size,
        samples_per_update=samples // recipe.algo.updates_per_batch,
        samples_per_step=samples,
        recompute=recipe.model.recompute,
        replay=recipe.algo.routing_replay != RoutingReplayMode.NONE,
    )


def layer_activation_bytes(
    model: MoEModelConfig, dims: ParallelDims, tokens: int, *, stored_input_only: bool, moe: bool
) -> int:
    """One layer's activations for `tokens` tokens of a micro-batch, an MoE layer's or a dense
    layer's (module docstring)."""
    a, h, t = BYTES[model.dtype], model.hidden_size, dims.tp
    if stored_input_only:
        return tokens * a * h // t
    heads = model.num_attention_heads
    if model.multi_latent_attention:
        query_head = model.qk_nope_head_dim + model.qk_rope_head_dim
        query = key = heads * query_head
        value = heads * model.v_head_dim
        latent = (model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim
        projected = query + key + value + value + latent
    else:
        query = heads * model.kv_channels
        key_value = model.num_query_groups * model.kv_channels
        projected = 2 * query + 2 * key_value
    attention = tokens * (a * (2 * h + projected) + 4 * heads)
    if not moe:
        return (attention + tokens * a * (h + 3 * model.ffn_hidden_size)) // t
    router = tokens * (2 * a * h + 8 * model.num_experts)
    expert_tokens = tokens * model.router_topk * dims.etp
    experts = expert_tokens * a * (2 * h + 3 * model.moe_ffn_hidden_size // dims.etp)
    shared = tokens * a * (h + 3 * (model.shared_expert_ffn_hidden_size or 0))
    return (attention + router + experts + shared) // t


def rank_memory(
    model: MoEModelConfig,
    dims: ParallelDims,
    recipe: Recipe,
    work: Workload,
    stage: int,
    *,
    engine_bytes: int = 0,
) -> RankMemory:
    """What a rank of `stage` holds running `work` (with `engine_bytes` of a colocated server)."""
    params = rank_parameters(model, dims, stage)
    a = BYTES[model.dtype]
    state_bytes = 12 if model.dtype == "bfloat16" else 8
    plain = params.total * state_bytes
    distributed = params.dense * state_bytes // (dims.dp * dims.cp) + (
        params.expert * state_bytes // dims.edp
    )
    use_distributed = recipe.optim.distributed_optimizer and dims.replicates_weights
    tokens = work.sequence * work.micro_batch
    dense_layers, moe_layers = stage_layer_counts(model, dims, stage)
    micro_batches = max(1, work.samples_per_update // (dims.dp * work.micro_batch))
    in_flight = min(dims.pp - stage, micro_batches)
    full = {
        kind: layer_activation_bytes(model, dims, tokens, stored_input_only=False, moe=kind)
        for kind in (False, True)
    }
    if work.recompute:
        stored = layer_activation_bytes(model, dims, tokens, stored_input_only=True, moe=True)
        largest = full[True] if moe_layers else full[False]
        activations = (dense_layers + moe_layers) * stored * in_flight + largest
    else:
        activations = (dense_layers * full[False] + moe_layers * full[True]) * in_flight
    logits = 2 * a * tokens * model.vocab_size // dims.tp if stage == dims.pp - 1 else 0
    step_tokens = work.samples_per_step // dims.dp * work.sequence // dims.tp
    record = step_tokens * moe_layers * model.router_topk * INDEX_BYTES if work.replay else 0
    return RankMemory(
        stage=stage,
        parameters=params,
        weights=params.total * a,
        gradients=params.total * 4,
        optimizer=distributed if use_distributed else plain,
        optimizer_plain=plain,
        activations=activations,
        logits=logits,
        routing_record=record,
        engine=engine_bytes,
        reference=params.total * a
        if recipe.algo.kl_coef > 0 and not recipe.algo.ref_offload
        else 0,
    )


@dataclass(frozen=True)
class Plan:
    """A recipe on a cluster: per stage what a rank holds, with and without a colocated server."""

    recipe: Recipe
    model: MoEModelConfig
    dims: ParallelDims
    cluster: Cluster
    work: Workload
    stages: list[RankMemory]
    engine_ranks: int  # ranks 0 .. engine_ranks - 1 also hold an SGLang server's share
    engine_bytes: int
    largest_micro_batch: int

    def worst(self) -> RankMemory:
        """The fullest rank (a stage-0 rank hosting a server, if any does)."""
        return fullest_rank(self.stages, self.engine_ranks, self.engine_bytes)

    @property
    def fits(self) -> bool:
        return self.worst().total <= self.cluster.budget_bytes


def load_model(recipe: Recipe, model_config: Path | None = None) -> MoEModelConfig:
    """The recipe's model, from `model_config` (a config.json under any name, for planning
    before the weights are downloaded) or from model.hf_path's config.json."""
    if model_config is not None:
        hf_config = read_config_file(model_config)
    elif not Path(recipe.model.hf_path).is_dir():
        raise ValueError(
            f"model.hf_path {recipe.model.hf_path}: not a directory here; to plan before the "
            "weights are downloaded, pass the model's config.json: --model-config FILE "
            "(examples/moe/configs/ has the published ones)"
        )
    else:
        hf_config = read_config(Path(recipe.model.hf_path), given_as="model.hf_path")
    return family_for(hf_config).config_from_hf(hf_config)


def fullest_rank(stages: list[RankMemory], engine_ranks: int, engine_bytes: int) -> RankMemory:
    """The fullest of the ranks of `stages`, counting a colocated server's `engine_bytes` on
    the first `engine_ranks` ranks (all of stage 0)."""
    candidates = list(stages)
    if engine_ranks:
        candidates.append(dataclasses.replace(stages[0], engine=engine_bytes))
    return max(candidates, key=lambda memory: memory.total)


def cluster_layout(parallel: ParallelConfig, nodes: int, gpus_per_node: int) -> ParallelDims:
    """`parallel` over nodes x GPUs; a ValueError with the arithmetic when it cannot be."""
    world_size = nodes * gpus_per_node
    try:
        return ParallelDims.of(parallel, world_size)
    except ValueError as error:
        raise ValueError(
            f"parallel (over --nodes {nodes} x --gpus-per-node {gpus_per_node} = "
            f"{world_size} ranks): {error}"
        ) from None


def make_plan(recipe: Recipe, model: MoEModelConfig, cluster: Cluster) -> Plan:
    """The plan of `recipe` for `model` on `cluster`; a ValueError with the arithmetic when the
    layout cannot split the model over the cluster."""
    dims = cluster_layout(recipe.parallel, cluster.nodes, cluster.gpus_per_node)
    model.check_split(dims)
    sglang = recipe.rollout.sglang
    colocated = (
        recipe.rollout.backend == "sglang" and not sglang.urls and cluster.rollout_nodes == 0
    )
    engine_ranks = min(sglang.num_servers * sglang.tp_size, cluster.world_size) if colocated else 0
    engine_bytes = int(sglang.mem_fraction_static * cluster.gpu_memory_gib * GIB)
    work = workload(recipe, cluster)

    def stages_at(micro_batch: int) -> list[RankMemory]:
        at = dataclasses.replace(work, micro_batch=micro_batch)
        return [rank_memory(model, dims, recipe, at, stage) for stage in range(dims.pp)]

    def fits_at(micro_batch: int) -> bool:
        worst = fullest_rank(stages_at(micro_batch), engine_ranks, engine_bytes)
        return worst.total <= cluster.budget_bytes

    per_rank = max(1, work.samples_per_update // dims.dp)
    largest = 0
    while largest < per_rank and fits_at(largest + 1):
        largest += 1
    return Plan(
        recipe=recipe,
        model=model,
        dims=dims,
        cluster=cluster,
        work=work,
        stages=stages_at(work.micro_batch),
        engine_ranks=engine_ranks,
        engine_bytes=engine_bytes,
        largest_micro_batch=largest,
    )


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def _billions(value: int) -> str:
    return f"{value / 1e9:.3f} B" if value >= 1e8 else f"{value:,}"


def format_plan(plan: Plan) -> str:
    """The plan as the text `megatron-rl plan` prints."""
    model, dims, cluster, work = plan.model, plan.dims, plan.cluster, plan.work
    total_params = rank_parameters(model, ParallelDims(world_size=1), 0).total
    lines = [
        f"{cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gib:g} "
        f"GiB: {dims.describe()}",
        f"model: {model.num_layers} layers, {model.num_experts} experts (top-{model.router_topk}), "
        f"{model.dtype}, {_billions(total_params)} parameters",
        f"per micro-batch: {work.micro_batch} sequences of {work.sequence} tokens "
        f"({cluster.prompt_tokens} prompt, --prompt-tokens, + {plan.recipe.rollout.max_new_tokens} "
        f"response), recompute {'on' if work.recompute else 'off'}",
        "",
        f"{'per rank':<28}" + "".join(f"{'stage ' + str(m.stage):>12}" for m in plan.stages),
    ]
    rows = [
        ("parameters", lambda m: _billions(m.parameters.total)),
        ("  dense", lambda m: _billions(m.parameters.dense)),
        ("  experts", lambda m: _billions(m.parameters.expert)),
        ("weights (GiB)", lambda m: _gib(m.weights)),
        ("reference weights (GiB)", lambda m: _gib(m.reference)),
        ("gradients, fp32 (GiB)", lambda m: _gib(m.gradients)),
        (
            "Adam, distributed (GiB)"
            if plan.recipe.optim.distributed_optimizer and dims.replicates_weights
            else "Adam (GiB)",
            lambda m: _gib(m.optimizer),
        ),
        ("  not distributed (GiB)", lambda m: _gib(m.optimizer_plain)),
        ("activations, est. (GiB)", lambda m: _gib(m.activations)),
        ("logits (GiB)", lambda m: _gib(m.logits)),
        ("routing record (GiB)", lambda m: _gib(m.routing_record)),
        ("total (GiB)", lambda m: _gib(m.total)),
    ]
    for name, value in rows:
        lines.append(f"{name:<28}" + "".join(f"{value(m):>12}" for m in plan.stages))
    if plan.engine_ranks:
        lines.append(
            f"ranks 0-{plan.engine_ranks - 1} also hold a colocated SGLang server's share: "
            f"{plan.recipe.rollout.sglang.mem_fraction_static:g} x {cluster.gpu_memory_gib:g} GiB "
            f"= {_gib(plan.engine_bytes)} GiB"
        )
    worst = plan.worst()
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += [
        "",
        f"{verdict}: the fullest rank (stage {worst.stage}"
        + (", with the server" if worst.engine else "")
        + f") needs {_gib(worst.total)} GiB of {_gib(cluster.budget_bytes)} "
        f"({cluster.gpu_memory_gib:g} GiB less {cluster.reserve_gib:g} reserved)",
        f"largest micro-batch that fits: {plan.largest_micro_batch}"
        + (" (none: even one sequence does not)" if plan.largest_micro_batch == 0 else ""),
    ]
    return "\n".join(lines) + "\n"
