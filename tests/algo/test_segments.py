"""Subsentence segmentation: hand-built cases and a property test against a token-by-token rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import subsentence_segment_ids
from tests.algo import reference

NL, NL2 = 1, 2  # two newline token ids (e.g. "\n" and ".\n")


def _segments(tokens, mask=None, newlines=(NL, NL2)):
    token_ids = torch.tensor([tokens])
    mask = torch.ones_like(token_ids, dtype=torch.bool) if mask is None else torch.tensor([mask])
    return subsentence_segment_ids(token_ids, mask, list(newlines))[0].tolist()


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([5, 6, 7], [0, 0, 0]),  # no newline: one segment
        ([5, NL, 6, 7, NL], [0, 0, 1, 1, 1]),  # the newline belongs to the segment it ends
        ([5, NL, NL2, NL, 6], [0, 0, 0, 0, 1]),  # a run of newlines ends one segment
        ([NL, NL, 5, 6, NL, 7], [0, 0, 0, 0, 0, 1]),  # leading newlines join the first segment
        ([5, NL, 6, 7], [0, 0, 1, 1]),  # tokens after the last newline: last segment
        ([NL, NL], [0, 0]),  # only newlines: still one segment
        ([5], [0]),  # length 1
    ],
)
def test_segment_rule_on_hand_built_rows(tokens, expected):
    assert _segments(tokens) == expected


def test_padding_left_right_and_gaps_in_the_response():
    # left padding (ids under padding are garbage and ignored), -1 off the mask
    assert _segments([NL, 9, 5, NL, 6], [False, False, True, True, True]) == [-1, -1, 0, 0, 1]
    assert _segments([5, NL, 6, NL, 9], [True, True, True, False, False]) == [0, 0, 1, -1, -1]
    # a masked-out gap (e.g. a tool's output) between response tokens: the previous *response*
    # token decides, so the newline before the gap still ends its segment
    assert _segments([5, NL, 8, 8, 6], [True, True, False, False, True]) == [0, 0, -1, -1, 1]
    assert _segments([5, 8, NL, 6], [True, True, False, True]) == [0, 0, -1, 0]


def test_rows_are_independent_and_batched():
    token_ids = torch.tensor([[5, NL, 6, 0], [NL, 5, 5, NL]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    ids = subsentence_segment_ids(token_ids, mask, torch.tensor([NL]))
    assert ids.tolist() == [[0, 0, 1, -1], [0, 0, 0, 0]]
    assert ids.dtype == torch.long


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda rows: st.integers(1, 12).flatmap(
            lambda cols: st.tuples(
                st.lists(
                    st.lists(st.integers(1, 4), min_size=cols, max_size=cols),
                    min_size=rows,
                    max_size=rows,
                ),
                st.lists(
                    st.lists(st.booleans(), min_size=cols, max_size=cols),
                    min_size=rows,
                    max_size=rows,
                ),
            )
        )
    )
)
def test_vectorised_segments_match_the_token_by_token_rule(data):
    tokens, mask = torch.tensor(data[0]), torch.tensor(data[1])
    expected = reference.segments(tokens, mask, {NL, NL2})
    assert torch.equal(subsentence_segment_ids(tokens, mask, [NL, NL2]), expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), [1]), "token_ids"),
        ((torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.bool), [1]), "token_ids"),
        ((torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), [1]), "mask"),
        ((torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), [1]), "mask"),
        ((torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), []), "newline"),
    ],
)
def test_bad_input_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        subsentence_segment_ids(*args)
