"""What bounds the in-process engine's decode step (docs/training.md, "The in-process rollout
engine"; results in docs/benchmarks/decode_step.md), and what a static KV cache and a compiled step
would save: the tiny recipe's model (`examples/moe/tiny_qwen3_moe`) decoding 32 tokens for 128 rows
after 24-token prompts, greedy, as milliseconds per decode step, four ways: the engine's
preallocated cache eagerly (megatron_rl.rollout.kv_cache), transformers' growing cache eagerly (what
the engine ran before), a static cache eagerly, and a static cache with the step under torch.compile
(its compile time apart); then the engine's eager step's ops by self CPU time.

    python scripts/profile_decode.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from megatron_rl.rollout.kv_cache import preallocated_cache

MODEL = "examples/moe/tiny_qwen3_moe"
ROWS, PROMPT, NEW_TOKENS = 128, 24, 32

# (tokens [rows, 1], position [1]) -> logits [rows, vocab]; the position a tensor, so that the
# compiled step is not specialised (and recompiled) on each position's value
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def decode_ms(prefill: Callable[[], torch.Tensor], step: Step) -> float:
    """Milliseconds per decode step of NEW_TOKENS greedy steps after `prefill`."""
    token = prefill().argmax(-1, keepdim=True)
    start = time.perf_counter()
    for offset in range(NEW_TOKENS):
        token = step(token, torch.tensor([PROMPT + offset])).argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / NEW_TOKENS * 1e3


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompts = torch.randint(2, model.config.vocab_size, (ROWS, PROMPT))
    with torch.inference_mode():
        dynamic: list[DynamicCache] = []

        def prefill_into(cache: DynamicCache) -> torch.Tensor:
            dynamic[:] = [cache]
            return model(input_ids=prompts, past_key_values=cache).logits[:, -1]

        def growing_prefill() -> torch.Tensor:
            return prefill_into(DynamicCache(config=model.config))

        def preallocated_prefill() -> torch.Tensor:
            return prefill_into(preallocated_cache(model.config, PROMPT + NEW_TOKENS + 1))

        def dynamic_step(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            positions = position.expand(ROWS, 1)
            out = model(input_ids=token, position_ids=positions, past_key_values=dynamic[0])
            return out.logits[:, -1]

        static = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS + 1)

        def static_prefill() -> torch.Tensor:
            static.reset()
            cache_position = torch.arange(PROMPT)
            out = model(input_ids=prompts, past_key_values=static, cache_position=cache_position)
            return out.logits[:, -1]

        def static_step(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            out = model(
                input_ids=token,
                position_ids=position.expand(ROWS, 1),
                cache_position=position,
                past_key_values=static,
            )
            return out.logits[:, -1]

        compiled = torch.compile(static_step, dynamic=False)
        results = {}
        for name, prefill, step in (
            ("eager, preallocated cache (the engine)", preallocated_prefill, dynamic_step),
            ("eager, growing cache (the engine before)", growing_prefill, dynamic_step),
            ("eager, static cache", static_prefill, static_step),
        ):
            results[name] = [decode_ms(prefill, step) for _ in range(3)]
        start = time.perf_counter()
        decode_ms(static_prefill, compiled)
        compile_s = time.perf_counter() - start
        results["compiled, static cache"] = [decode_ms(static_prefill, compiled) for _ in range(3)]
        print(f"{ROWS} rows, {PROMPT}-token prompts, {NEW_TOKENS} new tokens; ms per decode step")
        for name, runs in results.items():
            print(f"  {name}: {', '.join(f'{ms:.2f}' for ms in runs)}")
        print(f"  (compile and first run: {compile_s:.1f} s)")
        preallocated_prefill()
        token = torch.zeros(ROWS, 1, dtype=torch.long)
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for offset in range(NEW_TOKENS):
                position = torch.tensor([PROMPT + offset])
                token = dynamic_step(token, position).argmax(-1, keepdim=True)
    print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
