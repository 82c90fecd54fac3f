"""Make the tiny base model of the CPU recipes: a Qwen3-MoE-shaped (or DeepSeek-V3-shaped)
model warm-started by supervised training on worked solutions of the built-in arithmetic task
from a sloppy teacher.

    python examples/moe/make_tiny_model.py --out examples/moe/tiny_qwen3_moe
    python examples/moe/make_tiny_model.py --family deepseek_v3 --out examples/moe/tiny_deepseek_v3

Steps: build a character-level tokenizer over the task's alphabet; initialise a 4-layer,
8-expert, top-2 Qwen3-MoE (other shapes: --layers, --experts, --topk), or a DeepSeek-V3 of the
same width (multi-latent attention with YaRN, the first layer dense, a sigmoid router in two
groups with a shared expert), at random (seeded); train it on (prompt, worked solution) pairs
of the task's train split, with the loss on the solution only.

The teacher is sloppy in one systematic way: in a step that carries (an addition whose units
add up to 10 or more) or borrows (a subtraction whose units digit is smaller), it forgets the
tens digit's correction with probability `--slip-prob` and carries on from its wrong total.
A model that imitates it well learns the arithmetic *and* the slip, so its greedy answers are
wrong on most problems with a carry or a borrow: that is the room RL has (the verifier rewards
only right answers). Greedy accuracy on a validation draw of the held-out split is printed
every `--eval-every` steps. Deterministic on one machine for a given seed and thread count.
Writes into a temporary directory, renamed when complete.

`--shape` builds one of the routing-drift harness's base models instead (`SHAPES`: fine-grained
Qwen3-MoE and DeepSeek-V3 shapes, and a dense control), each with the load balancing it keeps in
RL: megatron-core's switch aux loss (per MoE layer, megatron-core's formula) or DeepSeek-V3's
aux-loss-free expert-bias updates, applied here in SFT and written to training.json's
`rl_options` (recipe overrides) for RL:

    python examples/moe/make_tiny_model.py --shape fine_qwen3 --out /path/fine_qwen3
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_rl.rewards import ArithmeticTask, get_verifier
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.evaluate import held_out_accuracy
from megatron_rl.rollout.local import LocalEngine

SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>")
ALPHABET = "0123456789+-=# \n"
VOCAB_SIZE = 32  # the 18 tokens, padded so the vocabulary splits over up to 32 TP ranks
MAX_NEW_TOKENS = 48


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of the task's alphabet, plus padding and end-of-text."""
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *ALPHABET])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[0],
        model_max_length=128,
    )


def model_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int = 4,
    experts: int = 8,
    topk: int = 2,
    moe_ffn: int = 96,
    dense_ffn: int = 256,
    hf_aux_loss_coef: float = 0.01,
    norm_topk_prob: bool = True,
) -> Qwen3MoeConfig:
    """The Qwen3-MoE shape of the main recipe (other shapes: the keywords). `hf_aux_loss_coef`:
    transformers' own load-balancing loss in SFT (its formula: pooled over layers, topk times
    megatron-core's); 0: off (the `--shape` models add megatron-core's instead, `Balancing`)."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=dense_ffn,
        moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=hf_aux_loss_coef,
        output_router_logits=hf_aux_loss_coef > 0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def deepseek_v3_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int = 4,
    experts: int = 8,
    topk: int = 2,
    moe_ffn: int = 96,
    dense_ffn: int = 256,
    groups: int = 2,
    group_topk: int | None = None,
) -> DeepseekV3Config:
    """A DeepSeek-V3 of the Qwen3-MoE shape's width: MLA with YaRN (4x over a 32-token
    pretraining context), the first layer dense, a sigmoid router whose experts come from the
    best `group_topk` (default topk / 2) of `groups` groups (a group scored by its best two
    experts, as transformers does), one shared expert of a routed expert's width."""
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=dense_ffn,
        moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=experts,
        num_experts_per_tok=topk,
        n_group=groups,
        topk_group=topk // 2 if group_topk is None else group_topk,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        # fields of DeepSeek-V3's own config.json that transformers' config class lacks and
        # SGLang reads (it fails to start without them)
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


FAMILIES: dict[str, tuple[type[PreTrainedModel], Callable[..., PreTrainedConfig]]] = {
    "qwen3_moe": (Qwen3MoeForCausalLM, model_config),
    "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config),
}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A named base model of the routing-drift harness (`--shape`, issue 36): its family, its
    shape, and the load balancing it trains with in SFT and keeps in RL."""

    family: str
    """qwen3_moe or deepseek_v3 (FAMILIES)."""
    layers: int
    """Transformer layers (DeepSeek-V3: the dense first one included)."""
    experts: int
    """Routed experts per MoE layer."""
    topk: int
    """Experts each token is routed to."""
    moe_ffn: int
    """Each routed expert's FFN width (moe_intermediate_size); DeepSeek-V3's shared expert has it
    too."""
    dense_ffn: int
    """A dense layer's FFN width (intermediate_size): DeepSeek-V3's first layer; unused by an
    all-MoE Qwen3-MoE."""
    groups: int = 1
    """DeepSeek-V3: expert groups (n_group)."""
    group_topk: int = 1
    """DeepSeek-V3: groups each token may use (topk_group)."""
    aux_loss_coeff: float = 0.0
    """Megatron-core's switch load-balancing loss, summed over the MoE layers with this weight:
    added to the SFT loss here, and the RL recipe's `model.aux_loss_coeff`."""
    router_bias_update_rate: float = 0.0
    """Aux-loss-free balancing: after each SFT step every expert's e_score_correction_bias moves
    by this towards an even load (sign rule); the RL recipe's `model.router_bias_update_rate`.
    DeepSeek-V3 only (sigmoid router with an expert bias)."""

    def rl_options(self) -> dict[str, float]:
        """The recipe overrides that keep this shape's balancing in RL."""
        return {
            "model.aux_loss_coeff": self.aux_loss_coeff,
            "model.router_bias_update_rate": self.router_bias_update_rate,
        }

    def hf_config(self, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
        common = {"layers": self.layers, "experts": self.experts, "topk": self.topk}
        widths = {"moe_ffn": self.moe_ffn, "dense_ffn": self.dense_ffn}
        if self.family == "qwen3_moe":
            # top-1: megatron-core routes one expert only softmax-then-top-k (its
            # moe_router_pre_softmax, transformers' norm_topk_prob=False); the same at top-k > 1
            # would change the gate weights, so those keep renormalising as Qwen3-MoE does.
            return model_config(
                tokenizer, **common, **widths, hf_aux_loss_coef=0.0, norm_topk_prob=self.topk > 1
            )
        return deepseek_v3_config(
            tokenizer, **common, **widths, groups=self.groups, group_topk=self.group_topk
        )


# Qwen3-MoE fine-grained: 64 small experts, top-8, megatron-core's aux loss in SFT and RL.
FINE_QWEN3 = Shape(
    family="qwen3_moe",
    layers=8,
    experts=64,
    topk=8,
    moe_ffn=16,
    dense_ffn=128,
    aux_loss_coeff=0.01,
)

FINE_DEEPSEEK = Shape(
    family="deepseek_v3",
    layers=8,
    experts=64,
    topk=8,
    moe_ffn=16,
    dense_ffn=144,
    groups=8,
    group_topk=4,
    router_bias_update_rate=1e-3,
)

SHAPES = {
    "fine_qwen3": FINE_QWEN3,
    # The papers' regime (the default grid's main model): fine_qwen3 at 128 experts (as
    # Qwen3-30B-A3B; the same active parameters) and 30x its aux-loss weight, which keeps router
    # margins small enough that ~5% of activated experts change per batch at the grid's learning
    # rate (the pilot `pilot_e128_aux03` of docs/drift.md, renamed).
    "fine_qwen3_e128": replace(FINE_QWEN3, experts=128, aux_loss_coeff=0.3),
    # Regime pilots (docs/drift.md, "Towards 5% per update"): fine_qwen3 with 10x its aux-loss
    # weight, and the same at 128 experts; the lever the issue measured (balancing keeps margins
    # small) against the learning rate, which collapses the dense control too.
    "pilot_aux01": replace(FINE_QWEN3, aux_loss_coeff=0.1),
    "pilot_e128_aux01": replace(FINE_QWEN3, experts=128, aux_loss_coeff=0.1),
    # DeepSeek-V3: as fine-grained, a sigmoid router in 8 groups of 8 (best 4 groups), the
    # expert bias updated (aux-loss-free balancing, DeepSeek-V3's rate), a shared expert of a
    # routed expert's width, the first layer dense with the active experts' width (8 + 1) x 16.
    "fine_deepseek": FINE_DEEPSEEK,
    # The same at 128 experts (8 groups of 16), the sigmoid router beside fine_qwen3_e128.
    "fine_deepseek_e128": replace(FINE_DEEPSEEK, experts=128),
    # The dense control: a Qwen3-MoE with one expert of fine_qwen3's active width 8 x 16, always
    # chosen with weight exactly 1 (softmax over the one expert, top-1): a dense SwiGLU layer, in
    # a family both transformers and megatron-core run (its router weight gets no gradient; no
    # balancing: nothing to balance).
    "dense_control": Shape(
        family="qwen3_moe", layers=8, experts=1, topk=1, moe_ffn=128, dense_ffn=128
    ),
}


class Balancing:
    """Load balancing in SFT as megatron-core does it in RL: `aux_loss()` is megatron-core's
    switch loss (`switch_load_balancing_loss_func`: E * sum_e f_e P_e, f_e the share of the
    T * topk choices that went to expert e, P_e expert e's mean normalised score), summed over
    the MoE layers; `update_biases()` moves each e_score_correction_bias by
    rate * sign(mean load - load) (`get_updated_expert_bias`), as DeepSeek-V3 did; transformers
    does neither. The routers' outputs are taken with forward hooks on the gates, in forwards
    with gradients only (evaluation does not count), over the batch's non-padding tokens."""

    def __init__(self, model: PreTrainedModel, shape: Shape) -> None:
        self.shape = shape
        self.gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for gate in self.gates:
            gate.register_forward_hook(self._keep)
        self.mask: torch.Tensor | None = None

    def _keep(self, module: torch.nn.Module, args: object, output: tuple) -> None:
        if torch.is_grad_enabled():  # both routers return (logits, weights, chosen experts)
            self.outputs.append((output[0], output[2]))

    def start(self, attention_mask: torch.Tensor) -> None:
        """Before a training forward of a batch with `attention_mask`."""
        self.outputs, self.mask = [], attention_mask.reshape(-1).bool()

    def aux_loss(self) -> torch.Tensor:
        if len(self.outputs) != len(self.gates):
            raise RuntimeError(f"expected one output per gate, got {len(self.outputs)}")
        total = torch.zeros(())
        for logits, _ in self.outputs:
            logits = logits[self.mask].float()
            if self.shape.family == "qwen3_moe":
                scores = torch.softmax(logits, dim=-1)
            else:
                scores = torch.sigmoid(logits)
                scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
            chosen = torch.zeros_like(scores).scatter(
                1, scores.topk(self.shape.topk, dim=1).indices, 1.0
            )
            tokens, experts = scores.shape
            share = chosen.sum(0) / (tokens * self.shape.topk)
            total = total + experts * (share * scores.mean(0)).sum()
        return self.shape.aux_loss_coeff * total

    @torch.no_grad()
    def update_biases(self) -> None:
        rate = self.shape.router_bias_update_rate
        if rate == 0:
            return
        for gate, (_, chosen) in zip(self.gates, self.outputs, strict=True):
            load = torch.bincount(chosen[self.mask].reshape(-1), minlength=self.shape.experts)
            load = load.to(gate.e_score_correction_bias.dtype)
            gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def sloppy_solution(prompt: str, slip_prob: float, rng: random.Random) -> str:
    """The teacher's worked solution of `prompt`: right except for forgotten carries and
    borrows (each with probability `slip_prob`, when the running total stays >= 0)."""
    numbers = [int(n) for n in re.findall(r"\d+", prompt)]
    operators = re.findall(r"[+-]", prompt)
    total, lines = numbers[0], []
    for index, (operator, operand) in enumerate(zip(operators, numbers[1:], strict=True)):
        if operator == "+":
            result = total + operand
            slipped = result - 10 if total % 10 + operand % 10 >= 10 else result
        else:
            result = total - operand
            slipped = result + 10 if total % 10 < operand % 10 else result
        if slipped != result and rng.random() < slip_prob:
            rest = list(zip(operators[index + 1 :], numbers[index + 2 :], strict=True))
            if _stays_non_negative(slipped, rest):
                result = slipped
        lines.append(f"{total}{operator}{operand}={result}\n")
        total = result
    return "".join(lines) + f"#### {total}\n"


def _stays_non_negative(total: int, rest: list[tuple[str, int]]) -> bool:
    for operator, operand in rest:
        total = total + operand if operator == "+" else total - operand
        if total < 0:
            return False
    return True


def training_batch(
    tokenizer: PreTrainedTokenizerFast, prompts: list[str], solutions: list[str]
) -> dict[str, torch.Tensor]:
    """Right-padded prompt + solution + end-of-text; labels only on the solution part."""
    rows, labels = [], []
    for prompt, solution in zip(prompts, solutions, strict=True):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        solution_ids = tokenizer.encode(solution, add_special_tokens=False)
        answer_ids = [*solution_ids, tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    label_ids = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, (row, label) in enumerate(zip(rows, labels, strict=True)):
        input_ids[index, : len(row)] = torch.tensor(row)
        label_ids[index, : len(row)] = torch.tensor(label)
        attention_mask[index, : len(row)] = 1
    return {"input_ids": input_ids, "labels": label_ids, "attention_mask": attention_mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (new)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--slip-prob", type=float, default=0.8)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-problems", type=int, default=200)
    # Other shapes, e.g. the drift harness's depth and expert sweeps (megatron-rl bench drift):
    # --layers 4, --experts 8, --topk 2, --family qwen3_moe unless given; or a --shape.
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--topk", type=int)
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a drift-harness base model (SHAPES); fixes all four",
    )
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out}: already exists; remove it or choose another path")
    legacy = {"layers": 4, "experts": 8, "topk": 2, "family": "qwen3_moe"}
    given = [f"--{name}" for name in legacy if getattr(args, name) is not None]
    if args.shape is not None and given:
        raise SystemExit(f"--shape {args.shape} fixes the shape: leave out {', '.join(given)}")

    torch.manual_seed(args.seed)
    task = ArithmeticTask()
    tokenizer = char_tokenizer()
    shape = SHAPES[args.shape] if args.shape is not None else None
    if shape is None:
        chosen = {
            name: value if (value := getattr(args, name)) is not None else default
            for name, default in legacy.items()
        }
        model_class, make_config = FAMILIES[chosen.pop("family")]
        config: PreTrainedConfig = make_config(tokenizer, **chosen)
    else:
        model_class, config = FAMILIES[shape.family][0], shape.hf_config(tokenizer)
    model = model_class(config)
    balancing = None
    if shape is not None and (shape.aux_loss_coeff > 0 or shape.router_bias_update_rate > 0):
        balancing = Balancing(model, shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    train = task.problems("train", args.batch_size * args.steps, seed=args.seed)
    teacher = random.Random(args.seed)
    solutions = [sloppy_solution(p.prompt, args.slip_prob, teacher) for p in train]
    validation = task.problems("eval", args.eval_problems, seed=args.seed + 1)
    verifier = get_verifier("arithmetic")

    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}-", dir=args.out.parent))
    tokenizer.save_pretrained(staging)
    codec = PromptCodec(staging, max_prompt_tokens=128 - MAX_NEW_TOKENS)
    engine = LocalEngine(model)
    started, accuracy = time.time(), 0.0
    history = []
    for step in range(1, args.steps + 1):
        rows = slice((step - 1) * args.batch_size, step * args.batch_size)
        batch = training_batch(tokenizer, [p.prompt for p in train[rows]], solutions[rows])
        model.train()
        if balancing is not None:
            balancing.start(batch["attention_mask"])
        loss = model(**batch).loss
        aux = balancing.aux_loss() if balancing and shape.aux_loss_coeff > 0 else 0.0
        optimizer.zero_grad()
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if balancing is not None:
            balancing.update_biases()
        if step % args.eval_every == 0:
            accuracy = held_out_accuracy(
                engine, codec, validation, verifier, max_new_tokens=MAX_NEW_TOKENS
            )
            history.append({"step": step, "loss": round(loss.item(), 4), "accuracy": accuracy})
            print(f"step {step}  loss {loss.item():.4f}  validation accuracy {accuracy:.3f}")
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = False
    model.save_pretrained(staging)
    (staging / "training.json").write_text(
        json.dumps(
            {
                "command": "python examples/moe/make_tiny_model.py "
                + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
                ),
                "task": vars(task) if hasattr(task, "__dict__") else str(task),
                "steps": args.steps,
                "seconds": round(time.time() - started, 1),
                "validation_accuracy": accuracy,
                "history": history,
                **(
                    {}
                    if shape is None
                    else {
                        "shape": {"name": args.shape, **asdict(shape)},
                        "rl_options": shape.rl_options(),
                    }
                ),
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    shutil.move(staging, args.out)
    print(f"wrote {args.out}; validation accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
