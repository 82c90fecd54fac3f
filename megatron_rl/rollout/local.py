"""The in-process rollout engine: batched sampling with a KV cache from a Hugging Face model.

Why a Hugging Face model and not megatron-core's inference engine: the engine then runs the
*exported* weights through an independent implementation, exactly as SGLang does, so every weight
sync exercises the conversion mapping (megatron_rl.models.hf_weights) and the engine/trainer
log-prob comparison checks it. It also keeps the engine independent of the trainer's parallel
layout (it lives on one rank while the trainer is split by EP or TP) and runs on plain CPU torch.

Weights arrive under their checkpoint names (per-expert tensors); transformers 5 keeps experts
fused in memory. The map from checkpoint names to memory comes from transformers' own reverse
conversion, applied once to tensors that hold each parameter element's flat index.

With `emulate_fp8` the engine rounds its linear layers' weights and inputs to FP8 e4m3 as FP8
rollout engines do (megatron_rl.rollout.fp8_emulation says what is quantised and what is not);
weights are quantised per checkpoint tensor, at load and at every weight update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from megatron_rl.models.module_weights import named_weights
from megatron_rl.rollout.engine import (
    Sample,
    SamplingParams,
    WeightBucket,
    check_generate_request,
)
from megatron_rl.rollout.fp8_emulation import Fp8Emulation, quantize_weight_blocks
from megatron_rl.rollout.kv_cache import preallocated_cache
from megatron_rl.rollout.route_flips import RouteFlips, check_flippable


class WeightUpdateError(ValueError):
    """A weight update that does not fit the engine's model (names, shapes or coverage)."""


class _CheckpointNameMap:
    """Checkpoint tensor name -> (parameter or persistent buffer, flat indices of its elements
    in it)."""

    def __init__(self, model: PreTrainedModel) -> None:
        params = dict(named_weights(model))
        offsets, start = {}, 0
        index_state = {}
        for name, param in params.items():
            offsets[name] = start
            index_state[name] = torch.arange(start, start + param.numel()).view(param.shape)
            start += param.numel()
        owners = sorted(offsets.items(), key=lambda item: item[1])
        bounds = torch.tensor([offset for _, offset in owners])
        self.targets: dict[str, tuple[Tensor, Tensor]] = {}
        for ckpt_name, flat in revert_weight_conversion(model, index_state).items():
            owner = owners[int(torch.searchsorted(bounds, flat.min(), right=True)) - 1][0]
            self.targets[ckpt_name] = (params[owner], flat - offsets[owner])
        self.fp8_names: set[str] = set()  # tensors written rounded to e4m3 (fp8 emulation)

    def quantize(self, weights: Iterable[Tensor]) -> None:
        """From now on, write the checkpoint tensors that land in `weights` rounded to e4m3 in
        128x128 blocks (each expert's tensor apart), and round those already there."""
        owners = {id(weight) for weight in weights}
        self.fp8_names = {n for n, (param, _) in self.targets.items() if id(param) in owners}
        for name in self.fp8_names:
            self.copy(name, self.read(name))

    def read(self, name: str) -> Tensor:
        """The engine's tensor of checkpoint name `name`, a copy in its checkpoint shape."""
        param, index = self.targets[name]
        return param.detach().view(-1)[index.reshape(-1)].view(index.shape).clone()

    def copy(self, name: str, tensor: Tensor) -> None:
        if name not in self.targets:
            raise WeightUpdateError(f"weight {name!r}: the engine's model has no such tensor")
        param, index = self.targets[name]
        if tuple(tensor.shape) != tuple(index.shape):
            raise WeightUpdateError(
                f"weight {name!r}: shape {list(tensor.shape)}, the engine expects "
                f"{list(index.shape)}"
            )
        if name in self.fp8_names:
            tensor = quantize_weight_blocks(tensor)
        param.data.view(-1)[index.reshape(-1)] = tensor.reshape(-1).to(param.dtype)


class _StepGate:
    """Lets a thread pause the generation between two of its model steps.

    The generating thread runs each step inside `step()`; `paused()` waits for the step in
    progress to end and holds the next one back until it exits. A waiting pause goes first,
    so a generation cannot starve it.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._pauses = 0  # paused() blocks entered and not left, waiting ones included
        self._stepping = False

    @property
    def pause_pending(self) -> bool:
        with self._condition:
            return self._pauses > 0

    @contextmanager
    def step(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: self._pauses == 0)
            self._stepping = True
        try:
            yield
        finally:
            with self._condition:
                self._stepping = False
                self._condition.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self._condition:
            self._pauses += 1
            self._condition.wait_for(lambda: not self._stepping)
        try:
            yield
        finally:
            with self._condition:
                self._pauses -= 1
                self._condition.notify_all()


def _left_padded(prompts: list[tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    """The prompts as `[batch, width]` token ids and attention mask, left-padded: the last
    prompt tokens line up, so that each decoding step appends one column."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return tokens, attention


@dataclass
class _Decoding:
    """One batch's decoding so far. Per row and step: the token (0 after the row's end) and its
    log-prob; per step, the weights' version and the rows that took part (a row that ends
    leaves the batch, and the model's next input, mask and positions cover the rows going on)."""

    generated: Tensor  # [batch, max_new_tokens]
    logprobs: Tensor  # [batch, max_new_tokens]
    lengths: Tensor  # [batch]
    stopped: Tensor  # [batch] bool: ended on a stop token
    active: Tensor  # [rows going on]: their batch rows
    step_input: Tensor  # [rows, new tokens]: what the next model step reads
    attention: Tensor  # [rows, columns so far]
    positions: Tensor  # [rows, new tokens]
    versions: list[int] = field(default_factory=list)
    stepped: list[Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, tokens: Tensor, attention: Tensor, max_new_tokens: int) -> _Decoding:
        batch = len(tokens)
        return cls(
            generated=torch.zeros(batch, max_new_tokens, dtype=torch.long),
            logprobs=torch.zeros(batch, max_new_tokens),
            lengths=torch.full((batch,), max_new_tokens),
            stopped=torch.zeros(batch, dtype=torch.bool),
            active=torch.arange(batch),
            step_input=tokens,
            attention=attention,
            positions=(attention.cumsum(1) - 1).clamp(min=0),
        )

    def restart_from_prefix(self, tokens: Tensor, step: int) -> None:
        """The next model step reads each going row's prompt and its `step` tokens so far
        (into an empty cache)."""
        self.step_input = torch.cat([tokens[self.active], self.generated[self.active, :step]], 1)
        self.positions = (self.attention.cumsum(1) - 1).clamp(min=0)

    def advance(
        self,
        step: int,
        version: int,
        logits: Tensor,
        next_token: Tensor,
        stop_ids: Tensor,
        cache: DynamicCache,
    ) -> bool:
        """Record `step`'s tokens `[rows]` (sampled from `logits` `[rows, vocab]` by weight
        `version`); rows that ended leave the batch and `cache`. True when none is left."""
        active = self.active
        self.versions.append(version)
        self.stepped.append(active)
        self.generated[active, step] = next_token
        token_logp = torch.log_softmax(logits, -1).gather(1, next_token[:, None])[:, 0]
        self.logprobs[active, step] = token_logp
        ends = torch.isin(next_token, stop_ids)
        self.lengths[active[ends]], self.stopped[active[ends]] = step + 1, True
        if bool(ends.all()):
            return True
        if bool(ends.any()):
            going_on = (~ends).nonzero()[:, 0]
            cache.batch_select_indices(going_on)
            self.active, next_token = active[going_on], next_token[going_on]
            self.attention = self.attention[going_on]
            self.positions = self.positions[going_on]
        self.step_input = next_token[:, None]
        self.positions = self.positions[:, -1:] + 1
        ones = torch.ones(len(self.active), 1, dtype=torch.long)
        self.attention = torch.cat([self.attention, ones], 1)
        return False


class LocalEngine:
    """Generates on this process from a Hugging Face causal LM (see the module docstring).

    Args:
        model: a transformers causal LM (float32 or bfloat16; put in eval mode here). Log-probs
            are float32 whatever its dtype: the logits are upcast before the softmax, as
            SGLang does.
        max_batch_size: sequences generated together; larger requests run in chunks.
        emulate_fp8: round the linear layers' weights (now and at every update) and their
            inputs to e4m3 as an FP8 engine does (fp8_emulation; the model must be float32).
        route_flips: flip a dose of the routes of every generation (route_flips.py).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 256,
        emulate_fp8: bool = False,
        route_flips: RouteFlips | None = None,
    ) -> None:
        self.model = model.eval()
        self.max_batch_size = max_batch_size
        self._names = _CheckpointNameMap(self.model)
        self._routers = [m for m in self.model.modules() if type(m).__name__.endswith("Router")]
        self._flip = None
        if route_flips is not None and route_flips.share > 0:
            check_flippable(self._routers)
            self._flip = route_flips.hook()  # one generator for the engine's life
        if emulate_fp8:
            kept = [self.model.get_input_embeddings(), self.model.get_output_embeddings()]
            emulation = Fp8Emulation(self.model, routers=self._routers, unquantised=kept)
            with torch.no_grad():
                self._names.quantize(emulation.weights)
        # MoE models may be configured to return router logits for an aux loss; not needed here.
        self._extra_inputs = (
            {"output_router_logits": False}
            if hasattr(self.model.config, "output_router_logits")
            else {}
        )
        self._version = -1
        self._healthy = True
        self._gate = _StepGate()

    @classmethod
    def from_pretrained(
        cls,
        hf_dir: str | Path,
        *,
        max_batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
        emulate_fp8: bool = False,
        route_flips: RouteFlips | None = None,
    ) -> LocalEngine:
        """An engine on the Hugging Face checkpoint in `hf_dir` (config.json + safetensors), its
        weights in `dtype` (synced weights are cast to it too), rounded to e4m3 with
        `emulate_fp8` (dtype float32), flipping `route_flips`' dose of routes."""
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        return cls(
            model,
            max_batch_size=max_batch_size,
            emulate_fp8=emulate_fp8,
            route_flips=route_flips,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    def healthy(self) -> bool:
        return self._healthy

    def paused(self) -> AbstractContextManager[None]:
        """No model step of a generation runs within it (see PausableEngine.paused)."""
        return self._gate.paused()

    @property
    def pause_pending(self) -> bool:
        """True while a `paused()` block waits for, or holds back, the generation's steps."""
        return self._gate.pause_pending

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy every tensor of `buckets` in (rounded to e4m3 where the engine emulates FP8);
        all of the model's tensors must come. A generation in flight waits meanwhile and goes
        on with the new weights."""
        seen: set[str] = set()
        self._healthy = False  # until the update is complete
        with self._gate.paused(), torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    self._names.copy(name, tensor)
                    seen.add(name)
        missing = sorted(set(self._names.targets) - seen)
        if missing:
            raise WeightUpdateError(
                f"weight update {version}: {len(missing)} tensor(s) never came, e.g. {missing[:3]}"
            )
        self._version = version
        self._healthy = True

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Per sequence, `[len - 1]` log-probs of its tokens 1.. (one forward each, between two
        steps of a generation in flight)."""
        result = []
        with self._gate.paused():
            for sequence in sequences:
                tokens = torch.tensor([list(sequence)])
                logits = self.model(input_ids=tokens, **self._extra_inputs).logits[0, :-1]
                logprobs = torch.log_softmax(logits.float(), -1)
                result.append(logprobs.gather(1, tokens[0, 1:, None])[:, 0])
        return result

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        seed: int = 0,
        return_routed_experts: bool = False,
    ) -> list[list[Sample]]:
        check_generate_request(prompts, n)
        if not self._healthy:
            raise RuntimeError("engine: a weight update did not complete; refusing to generate")
        flat = [tuple(prompt) for prompt in prompts for _ in range(n)]
        generator = torch.Generator().manual_seed(seed)
        samples: list[Sample] = []
        for start in range(0, len(flat), self.max_batch_size):
            chunk = flat[start : start + self.max_batch_size]
            samples += self._generate_batch(chunk, params, generator, return_routed_experts)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(
        self,
        prompts: list[tuple[int, ...]],
        params: SamplingParams,
        generator: torch.Generator,
        return_routed_experts: bool,
    ) -> list[Sample]:
        tokens, attention = _left_padded(prompts)
        decoding = _Decoding.start(tokens, attention, params.max_new_tokens)
        stop_ids = torch.tensor(params.stop_token_ids or (-1,))
        routing: list[Tensor] = []  # per router call, in call order: [tokens, topk]
        gate_weights: list[Tensor] = []  # the same calls' gate weights
        hooks = []
        if self._flip is not None:  # first: the record below keeps the flipped routing
            hooks = [r.register_forward_hook(self._flip) for r in self._routers]
        if return_routed_experts:
            record = self._record_into(routing, gate_weights)
            hooks += [r.register_forward_hook(record) for r in self._routers]
        capacity = tokens.shape[1] + params.max_new_tokens
        cache, cache_version = preallocated_cache(self.model.config, capacity), self._version
        try:
            for step in range(params.max_new_tokens):
                with self._gate.step():
                    if self._version != cache_version:
                        # The weights changed while paused: the prefix again under the new ones,
                        # so that each later token comes from one version alone.
                        if return_routed_experts:
                            raise RuntimeError(
                                "engine: the weights changed during a generation that records "
                                "routed experts; the prefix would be routed again by the new "
                                "weights (partial rollouts cannot record routing for R3)"
                            )
                        cache = preallocated_cache(self.model.config, capacity)
                        cache_version = self._version
                        decoding.restart_from_prefix(tokens, step)
                    output = self.model(
                        input_ids=decoding.step_input,
                        attention_mask=decoding.attention,
                        position_ids=decoding.positions,
                        past_key_values=cache,
                        use_cache=True,
                        **self._extra_inputs,
                    )
                logits = output.logits[:, -1].float()
                next_token = self._sample(logits, params, generator)
                if decoding.advance(step, cache_version, logits, next_token, stop_ids, cache):
                    break
        finally:
            for hook in hooks:
                hook.remove()
        steps = len(decoding.versions)
        return self._samples(
            prompts,
            decoding.generated[:, :steps],
            decoding.logprobs[:, :steps],
            decoding.versions,
            decoding.stepped,
            decoding.lengths,
            decoding.stopped,
            _per_sample(routing, decoding.stepped, prompts, decoding.lengths, len(self._routers)),
            _per_sample(
                gate_weights, decoding.stepped, prompts, decoding.lengths, len(self._routers)
            ),
        )

    @staticmethod
    def _record_into(routing: list[Tensor], weights: list[Tensor]) -> Callable[..., None]:
        """A forward hook that keeps a router's chosen experts `[tokens, topk]` and their gate
        weights (the routers of transformers' MoE blocks return (logits, weights, experts))."""

        def hook(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            routing.append(output[-1].to(torch.int32))
            weights.append(output[1].detach().float())

        return hook

    @staticmethod
    def _sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> Tensor:
        """Next token per row from `[batch, vocab]` logits."""
        if params.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / params.temperature, -1)
        if params.top_p < 1:
            sorted_probs, order = probs.sort(-1, descending=True)
            # Keep a token while the mass before it is below top_p (the first always stays).
            keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
            sorted_probs = torch.where(keep, sorted_probs, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _samples(
        self,
        prompts: list[tuple[int, ...]],
        tokens: Tensor,
        token_logprobs: Tensor,
        versions: list[int],
        stepped: list[Tensor],
        lengths: Tensor,
        stopped: Tensor,
        routing: list[Tensor] | None,
        gate_weights: list[Tensor] | None,
    ) -> list[Sample]:
        """The rows' samples from `[batch, steps]` tokens and log-probs, per step the weights'
        version and the rows that took part, and per row its routing records (`_per_sample`)."""
        samples = []
        for row, prompt in enumerate(prompts):
            length = int(lengths[row])
            token_versions = tuple(versions[:length])
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=tuple(tokens[row, :length].tolist()),
                    logprobs=token_logprobs[row, :length].clone(),
                    finish_reason="stop" if bool(stopped[row]) else "length",
                    routed_experts=None if routing is None else routing[row],
                    routed_weights=None if gate_weights is None else gate_weights[row],
                    weight_version=token_versions[0],
                    token_versions=token_versions if len(set(token_versions)) > 1 else None,
                )
            )
        return samples


def _per_sample(
    calls: list[Tensor],
    stepped: list[Tensor],
    prompts: list[tuple[int, ...]],
    lengths: Tensor,
    layers: int,
) -> list[Tensor] | None:
    """Per row, `[prompt + length - 1, layers, topk]` from the router calls' records (each
    `[tokens, topk]`, `layers` per forward, in call order): its prompt's tokens in the prefill
    and the tokens it fed back in the decode steps it took part in (`stepped`). None when no
    call was recorded."""
    if not calls:
        return None
    # Forward 0 is the prefill over [batch * width] left-padded tokens; forward k >= 1 feeds
    # generated token k - 1 of the rows stepped[k] only.
    forwards = [torch.stack(calls[c : c + layers], 1) for c in range(0, len(calls), layers)]
    batch, width = len(prompts), max(len(p) for p in prompts)
    prefill = forwards[0].view(batch, width, layers, -1)
    rows = []
    for row, prompt in enumerate(prompts):
        steps = [forwards[k][(stepped[k] == row).nonzero()[0]] for k in range(1, int(lengths[row]))]
        rows.append(torch.cat([prefill[row, width - len(prompt) :], *steps], 0))
    return rows
