"""A set dose of flipped routes in the in-process engine (rollout/route_flips.py): which tokens
flip, what they flip to, and that the engine samples with them while scoring without."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.route_flips import RouteFlips, flip_routes
from tests.checkpoint.tiny_hf import save_tiny

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]

# 6 tokens, 5 experts, top-2: the 2nd and 3rd logits are 0.1 * t apart, so the smallest margins
# are tokens 1, 2, 3 (t = 1, 2, 3; token 0's and 5's are larger)
LOGITS = torch.tensor(
    [[3.0, 2.0, 2.0 - 0.1 * t, 0.0, -1.0] for t in (7, 1, 2, 3, 5, 9)], dtype=torch.float32
)


def _top_k(logits: torch.Tensor, k: int = 2) -> torch.Tensor:
    return torch.topk(logits.softmax(-1), k, dim=-1).indices


def test_the_smallest_margins_swap_their_kth_expert_for_the_next_one():
    experts = _top_k(LOGITS)
    weights, flipped = flip_routes(
        LOGITS, experts, share=0.5, at="margin", normalize=True, generator=torch.Generator()
    )
    changed = (flipped != experts).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1, 2, 3]
    assert flipped[changed, 0].tolist() == [0, 0, 0]  # the first choice stays
    assert flipped[changed, 1].tolist() == [2, 2, 2]  # the third-best takes the second's place
    probs = LOGITS.softmax(-1)
    expected = probs.gather(1, flipped)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))
    unnormalised, _ = flip_routes(
        LOGITS, experts, share=0.5, at="margin", normalize=False, generator=torch.Generator()
    )
    torch.testing.assert_close(unnormalised, expected)


def test_random_flips_take_the_share_reproducibly_and_none_at_zero():
    experts = _top_k(LOGITS)

    def changed(share: float, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        _, flipped = flip_routes(
            LOGITS, experts, share=share, at="random", normalize=True, generator=generator
        )
        return (flipped != experts).any(dim=1).nonzero().flatten().tolist()

    assert len(changed(0.5, 0)) == 3 and changed(0.5, 0) == changed(0.5, 0)
    assert {tuple(changed(0.5, seed)) for seed in range(6)} != {(1, 2, 3)}  # not the margins'
    assert changed(0.0, 0) == []


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("hf"))


def test_the_engine_samples_with_flipped_routes_and_scores_without(hf_dir):
    plain = LocalEngine.from_pretrained(hf_dir)
    dosed = LocalEngine.from_pretrained(hf_dir, route_flips=RouteFlips(0.3, "margin", seed=0))
    params = SamplingParams(max_new_tokens=6)
    ours, theirs = (
        engine.generate(PROMPTS, params, n=1, seed=3, return_routed_experts=True)
        for engine in (dosed, plain)
    )
    # the prompts' tokens at the first MoE layer (the first router call, on the same input to
    # both; later layers see the flips' effect too): 30% of the 12 have one expert swapped
    swapped = 0
    for (mine,), (other,) in zip(ours, theirs, strict=True):
        for token in range(len(mine.prompt_ids)):
            a = set(mine.routed_experts[token, 0].tolist())
            b = set(other.routed_experts[token, 0].tolist())
            assert len(a ^ b) in (0, 2)  # at most one expert swapped
            swapped += a != b
            # the recorded gate weights are the flipped routing's (renormalised over it)
            weights = mine.routed_weights[token, 0]
            assert torch.equal(weights, other.routed_weights[token, 0]) == (a == b)
            torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    assert swapped == round(0.3 * 12)
    assert any(
        not torch.equal(mine.logprobs, other.logprobs)
        for (mine,), (other,) in zip(ours, theirs, strict=True)
    )
    # the weight-sync probe's scoring is not flipped
    sequence = [PROMPTS[0] + list(ours[0][0].response_ids)]
    torch.testing.assert_close(dosed.score(sequence)[0], plain.score(sequence)[0])


def test_a_model_whose_routers_cannot_be_flipped_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.flip_routes: .* this model has DeepseekV3"):
        LocalEngine.from_pretrained(
            save_tiny("deepseek_v3", tmp_path), route_flips=RouteFlips(0.1, "margin", seed=0)
        )
