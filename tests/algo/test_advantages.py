"""Group-relative advantages against a loop reference; zero-variance groups are exact zeros."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import group_advantages
from tests.algo import reference


@pytest.mark.parametrize("std_normalize", [True, False])
def test_matches_reference(std_normalize):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1])
    result = group_advantages(rewards, 4, std_normalize=std_normalize)
    expected = reference.group_advantages(rewards, 4, std_normalize=std_normalize)
    torch.testing.assert_close(result.advantages.double(), expected, rtol=1e-6, atol=1e-6)
    assert int(result.num_zero_variance_groups) == 1
    assert result.zero_variance.tolist() == [False] * 8 + [True] * 4


def test_zero_variance_group_is_exactly_zero_even_when_the_mean_rounds():
    # 0.1 * 3 / 3 != 0.1 in floating point: r - mean would leave a residue
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    result = group_advantages(rewards, 3)
    assert (result.advantages == 0).all()
    assert int(result.num_zero_variance_groups) == 1


@settings(max_examples=100, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda size: st.tuples(
            st.just(size),
            st.lists(
                st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=size, max_size=size),
                min_size=1,
                max_size=5,
            ),
        )
    )
)
def test_normalised_groups_have_zero_mean_and_unit_std(data):
    size, groups = data
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    result = group_advantages(rewards, size, eps=0.0)
    per_group = result.advantages.view(-1, size)
    for g, group in enumerate(groups):
        if len(set(group)) == 1:
            assert (per_group[g] == 0).all()
        else:
            assert abs(float(per_group[g].mean())) < 1e-12
            assert abs(float(per_group[g].std()) - 1.0) < 1e-12
    assert int(result.num_zero_variance_groups) == sum(len(set(g)) == 1 for g in groups)


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.ones(4, 2), 2, "rewards: expected a 1-D"),
        (torch.ones(4, dtype=torch.long), 2, "rewards: expected a 1-D floating"),
        (torch.ones(5), 2, "do not split into groups"),
        (torch.ones(4), 1, "group_size"),
        (torch.ones(4), 2.0, "group_size"),
        (torch.tensor([1.0, float("nan")]), 2, "NaN"),
    ],
)
def test_bad_input(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)
