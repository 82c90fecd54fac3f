"""Which problems each RL step trains on, and the held-out ones it is evaluated on."""

from __future__ import annotations

import random
from collections.abc import Sequence

from megatron_rl.rewards.arithmetic import Problem


class ProblemSource:
    """Training batches by step number, and a fixed evaluation set.

    The training problems are visited in epochs, each a fresh seeded shuffle; batch `step`
    (from 1) is positions `(step - 1) * per_step ...` of that endless sequence, so it depends on
    the seed and the step alone (a resumed run sees the same batches).
    """

    def __init__(
        self,
        train: Sequence[Problem],
        eval_problems: Sequence[Problem],
        *,
        per_step: int,
        seed: int,
    ) -> None:
        if not train:
            raise ValueError("train problems: none given")
        if not eval_problems:
            raise ValueError("eval problems: none given")
        if per_step < 1:
            raise ValueError(f"per_step: expected >= 1, got {per_step}")
        self.train = list(train)
        self.eval_problems = list(eval_problems)
        self.per_step = per_step
        self.seed = seed
        self._epochs: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            order = list(range(len(self.train)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._epochs = {epoch: order}  # batches move forward; keep one epoch in memory
        return self._epochs[epoch]

    def extra_batch(self, step: int, round_index: int) -> list[Problem]:
        """`per_step` further problems for generation round `round_index` (from 1) of step
        `step` (dynamic sampling): a seeded draw that depends on the seed, step and round
        alone, so that a resumed run draws the same."""
        if step < 1 or round_index < 1:
            raise ValueError(f"step, round_index: expected >= 1, got {step}, {round_index}")
        draw = random.Random(f"{self.seed}:{step}:{round_index}")
        return [self.train[draw.randrange(len(self.train))] for _ in range(self.per_step)]

    def train_batch(self, step: int) -> list[Problem]:
        """The `per_step` problems of RL step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"step: expected >= 1, got {step}")
        batch = []
        for position in range((step - 1) * self.per_step, step * self.per_step):
            epoch, index = divmod(position, len(self.train))
            batch.append(self.train[self._epoch_order(epoch)[index]])
        return batch
