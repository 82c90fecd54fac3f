"""SGLang's `/generate` answers, checked and turned into `Sample`s.

Facts about SGLang 0.5.x this relies on (checked against 0.5.23 in tests/sglang):
- a batch of `P` prompts with `sampling_params.n = n` answers with a list of `P * n` items,
  prompt-major (the `n` samples of prompt 0 first);
- `meta_info.output_token_logprobs` is `[[logprob, token_id, text], ...]`, one entry per
  generated token (`text` is null with `--skip-tokenizer-init`);
- `meta_info.input_token_logprobs` (with `logprob_start_len: 0`) has one entry per prompt
  token, the first with a null log-prob;
- `meta_info.finish_reason` is `{"type": "stop" | "length" | "abort", ...}`;
- `meta_info.routed_experts` is base64 of int32 `[prompt_len + response_len - 1, layers, topk]`;
- `meta_info.weight_versions`, when the served weights changed during the generation (a weight
  update while paused), is `[{"version", "start", "end"}, ...]`: contiguous spans of the output
  tokens and the weight version (as the update named it) that generated them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from megatron_rl.rollout.engine import Sample
from megatron_rl.rollout.sglang.http import SGLangError


def _field(item: Any, path: str, where: str) -> Any:
    value = item
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise SGLangError(f"{where}: the answer has no field {path!r}")
        value = value[key]
    return value


def parse_samples(
    answer: Any,
    prompts: Sequence[Sequence[int]],
    n: int,
    *,
    where: str,
    routed_experts: tuple[int, int] | None = None,
    weight_version: int = -1,
) -> list[list[Sample]]:
    """`[len(prompts)][n]` samples from a `/generate` answer; `routed_experts` is `(layers,
    topk)` when routing was asked for; `weight_version` is the served weights' version, which
    every sample carries. `where` names the server and request in errors."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(prompts) * n:
        raise SGLangError(
            f"{where}: {len(items)} sample(s) in the answer, expected {len(prompts)} prompt(s) "
            f"x n={n}"
        )
    samples = [
        _sample(
            items[index],
            prompts[index // n],
            f"{where}, sample {index}",
            routed_experts,
            weight_version,
        )
        for index in range(len(items))
    ]
    return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


def _sample(
    item: Any,
    prompt: Sequence[int],
    where: str,
    routed_experts: tuple[int, int] | None,
    weight_version: int,
) -> Sample:
    output_ids = _field(item, "output_ids", where)
    logprobs = _field(item, "meta_info.output_token_logprobs", where)
    finish = _field(item, "meta_info.finish_reason", where)
    if not isinstance(output_ids, list) or not output_ids:
        raise SGLangError(f"{where}: output_ids: expected a non-empty list, got {output_ids!r}")
    if not isinstance(logprobs, list) or len(logprobs) != len(output_ids):
        got = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
        raise SGLangError(
            f"{where}: meta_info.output_token_logprobs has {got} entries for "
            f"{len(output_ids)} output token(s)"
        )
    values = []
    for position, (entry, token) in enumerate(zip(logprobs, output_ids, strict=True)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
            raise SGLangError(
                f"{where}: meta_info.output_token_logprobs[{position}] = {entry!r} does not "
                f"belong to output token {token}"
            )
        values.append(entry[0])
    reason = finish.get("type") if isinstance(finish, dict) else None
    if reason not in ("stop", "length"):
        raise SGLangError(f"{where}: meta_info.finish_reason = {finish!r} (aborted?)")
    prompt_len = _field(item, "meta_info.prompt_tokens", where)
    if prompt_len != len(prompt):
        raise SGLangError(
            f"{where}: meta_info.prompt_tokens = {prompt_len}, the prompt has {len(prompt)} "
            "tokens (answers out of order?)"
        )
    routing = None
    if routed_experts is not None:
        encoded = _field(item, "meta_info.routed_experts", where)
        routing = decode_routed_experts(
            encoded, len(prompt) + len(output_ids) - 1, *routed_experts, where=where
        )
    token_versions = None
    spans = item["meta_info"].get("weight_versions")
    if spans is not None:
        token_versions = _token_versions(spans, len(output_ids), weight_version, where)
        weight_version = token_versions[0]
        if len(set(token_versions)) == 1:
            token_versions = None
    return Sample(
        prompt_ids=tuple(prompt),
        response_ids=tuple(output_ids),
        logprobs=torch.tensor(values, dtype=torch.float32),
        finish_reason=reason,
        routed_experts=routing,
        weight_version=weight_version,
        token_versions=token_versions,
    )


def _token_versions(spans: Any, length: int, first_version: int, where: str) -> tuple[int, ...]:
    """Per output token, the weight version of `meta_info.weight_versions`'s span holding it.
    The trainer's updates name versions by integers; the weights a server started with have
    another name ("default", a directory's tag), which only the first span can carry: its tokens
    are then `first_version`'s (the engine's when it sent the request)."""
    versions: list[int] = []
    for index, span in enumerate(spans if isinstance(spans, list) else [spans]):
        fields = span if isinstance(span, dict) else {}
        version, start, end = fields.get("version"), fields.get("start"), fields.get("end")
        if start != len(versions) or not isinstance(end, int) or end <= start:
            raise SGLangError(
                f"{where}: meta_info.weight_versions = {spans!r}: expected contiguous spans "
                f"from token 0 to {length}"
            )
        if index == 0 and not str(version).lstrip("-").isdigit():
            version = first_version
        try:
            versions += [int(version)] * (end - start)
        except (TypeError, ValueError):
            raise SGLangError(
                f"{where}: meta_info.weight_versions names version {version!r}; the trainer's "
                "versions are integers"
            ) from None
    if len(versions) != length:
        raise SGLangError(
            f"{where}: meta_info.weight_versions = {spans!r} covers {len(versions)} of the "
            f"{length} output tokens"
        )
    return tuple(versions)


def decode_routed_experts(
    encoded: Any, positions: int, layers: int, topk: int, *, where: str
) -> Tensor:
    """`meta_info.routed_experts` as int32 `[positions, layers, topk]`."""
    if not isinstance(encoded, str):
        raise SGLangError(
            f"{where}: meta_info.routed_experts is {type(encoded).__name__}, expected base64 "
            "(start the server with --enable-return-routed-experts)"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise SGLangError(f"{where}: meta_info.routed_experts is not base64 ({error})") from None
    expected = positions * layers * topk
    if len(raw) != 4 * expected:
        raise SGLangError(
            f"{where}: meta_info.routed_experts holds {len(raw) // 4} int32 values, expected "
            f"{positions} positions x {layers} layers x top-{topk} = {expected}"
        )
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy()).view(positions, layers, topk)


def parse_prompt_logprobs(
    answer: Any, sequences: Sequence[Sequence[int]], *, where: str
) -> list[Tensor]:
    """Per sequence, `[len - 1]` float32 log-probs of tokens 1.. from `input_token_logprobs`."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(sequences):
        raise SGLangError(f"{where}: {len(items)} answer(s) for {len(sequences)} sequence(s)")
    result = []
    for index, (item, sequence) in enumerate(zip(items, sequences, strict=True)):
        entries = _field(item, "meta_info.input_token_logprobs", f"{where}, sequence {index}")
        if not isinstance(entries, list) or len(entries) != len(sequence):
            raise SGLangError(
                f"{where}, sequence {index}: meta_info.input_token_logprobs has "
                f"{len(entries) if isinstance(entries, list) else entries!r} entries for "
                f"{len(sequence)} tokens"
            )
        values = [entry[0] for entry in entries[1:]]
        if any(not isinstance(value, int | float) for value in values):
            raise SGLangError(
                f"{where}, sequence {index}: meta_info.input_token_logprobs has non-numeric "
                "log-probs"
            )
        result.append(torch.tensor(values, dtype=torch.float32))
    return result
