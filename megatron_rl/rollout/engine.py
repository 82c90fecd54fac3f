"""The rollout-engine interface: what the trainer asks of SGLang and of the in-process engine.

Shaped after SGLang's `/generate`: requests carry token ids (no text), every prompt is sampled
`n` times, and each sample comes back with its token ids, the log-prob of every generated token,
a finish reason and, when asked, the experts its tokens were routed to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; the names follow SGLang's `sampling_params`."""

    temperature: float = 1.0
    """Softmax temperature; 0 samples greedily."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 64
    """Longest response, in tokens; a response cut here finishes with reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (kept as its last token); reason "stop"."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Sample:
    """One generated response.

    Attributes:
        prompt_ids: the prompt's token ids.
        response_ids: generated token ids, a stop token included.
        logprobs: `[len(response_ids)]` float32, the engine's log-prob of each generated token
            under the unmodified model distribution (temperature 1, no top-p), which is what the
            trainer's log-probs are compared with.
        finish_reason: "stop" (a stop token was generated) or "length" (max_new_tokens reached).
        routed_experts: `[len(prompt_ids) + len(response_ids) - 1, layers, topk]` int32 in
            SGLang's layout (see megatron_rl.moe.engine_routing), or None when not asked for.
        routed_weights: like `routed_experts`, float32, the gate weight the engine gave each of
            those experts; the in-process engine returns them with the experts, SGLang does not
            (its `return_routed_experts` gives expert ids only): None.
        weight_version: the engine's weight version (`RolloutEngine.weight_version`) that
            generated its first token.
        token_versions: per response token, the weight version that generated it, when the
            weights changed during the generation (partial rollouts, `RolloutEngine.paused`);
            None when all of them came from `weight_version`.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: Tensor
    finish_reason: FinishReason
    routed_experts: Tensor | None = None
    routed_weights: Tensor | None = None
    weight_version: int = -1
    token_versions: tuple[int, ...] | None = None

    def response_versions(self) -> list[int]:
        """The weight version of every response token, `[len(response_ids)]`."""
        if self.token_versions is None:
            return [self.weight_version] * len(self.response_ids)
        return list(self.token_versions)


WeightBucket = Sequence[tuple[str, Tensor]]


def check_generate_request(prompts: Sequence[Sequence[int]], n: int) -> None:
    """What every engine refuses before generating: n < 1, an empty prompt."""
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}]: empty prompt")


class RolloutEngine(Protocol):
    """A source of samples from the current policy."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        seed: int = 0,
        return_routed_experts: bool = False,
    ) -> list[list[Sample]]:
        """`n` samples per prompt, `[len(prompts)][n]`; the same seed gives the same samples."""
        ...

    def score(self, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Per sequence, `[len - 1]` float32 log-probs of its tokens 1.. under the engine's
        current weights (the weight-sync probe compares them with the trainer's). May be called
        while a generation runs on another thread."""
        ...

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load Hugging Face-named tensors (megatron_rl.models.hf_weights.stream_hf_weights);
        every parameter of the engine's model must be covered; `version` is recorded."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the last completed update (-1 before the first)."""
        ...

    def healthy(self) -> bool:
        """True when the engine can serve requests."""
        ...


@runtime_checkable
class PausableEngine(Protocol):
    """What a RolloutEngine whose generations can be paused for a weight update (partial
    rollouts) has besides."""

    def paused(self) -> AbstractContextManager[None]:
        """Within it no generation step runs: a generation in flight waits, the weights may be
        updated (from the thread that paused), and the generation then goes on with the new
        weights, the prefix it has recomputed under them, every token marked with the version
        that generated it (`Sample.token_versions`). Partial rollouts rest on it."""
        ...
