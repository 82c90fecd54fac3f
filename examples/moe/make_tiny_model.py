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
    tokenizer: PreTrainedTokenizerFast, *, layers: int = 4, experts: int = 8, topk: int = 2
) -> Qwen3MoeConfig:
    """The Qwen3-MoE shape of the main recipe."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def deepseek_v3_config(
    tokenizer: PreTrainedTokenizerFast, *, layers: int = 4, experts: int = 8, topk: int = 2
) -> DeepseekV3Config:
    """A DeepSeek-V3 of the Qwen3-MoE shape's width: MLA with YaRN (4x over a 32-token
    pretraining context), the first layer dense, a sigmoid router whose experts come from the
    better of two groups (a group scored by its best two experts), one shared expert."""
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
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
        n_group=2,
        topk_group=topk // 2,
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
    # Other shapes, e.g. the drift harness's depth and expert sweeps (megatron-rl bench drift).
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out}: already exists; remove it or choose another path")

    torch.manual_seed(args.seed)
    task = ArithmeticTask()
    tokenizer = char_tokenizer()
    shape = {"layers": args.layers, "experts": args.experts, "topk": args.topk}
    model_class, make_config = FAMILIES[args.family]
    config: PreTrainedConfig = make_config(tokenizer, **shape)
    model = model_class(config)
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
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
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
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "task": vars(task) if hasattr(task, "__dict__") else str(task),
                "steps": args.steps,
                "seconds": round(time.time() - started, 1),
                "validation_accuracy": accuracy,
                "history": history,
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
