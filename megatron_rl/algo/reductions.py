"""How each metric combines over micro-batches, data-parallel ranks and updates.

A metric declares its reduction where it is made (`LOSS_METRICS` beside the loss, the drift and
trainer metrics beside theirs), and `MetricReductions` joins the declarations: one table that
decides, for every name, whether its values average, take their extreme, add up or keep the last.
A name no one declared is refused, so no reduction is ever guessed from a name's spelling.
Non-finite values are never dropped: a NaN or inf among the values makes the result NaN or inf,
so that a broken micro-batch shows in the step's metrics instead of vanishing in an average.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence


class Reduction(enum.StrEnum):
    """How values of one metric combine into one."""

    MEAN = "mean"  # a share or an average: the mean of the parts' values
    MAX = "max"  # an extreme (`ratio/max`, `log_ratio/abs_max`)
    MIN = "min"
    SUM = "sum"  # a count: the parts' counts add up
    LAST = "last"  # a state (the learning rate): the last value, in order


# A declaration: a metric's name, or a family of names ending in "*" (e.g.
# "routing/drift_layer_*" for every layer), and its reduction.
MetricDeclarations = Mapping[str, Reduction]


class MetricReductions:
    """The reductions of every declared metric, joined from the declarations of their makers."""

    def __init__(self, *declarations: MetricDeclarations) -> None:
        self._exact: dict[str, Reduction] = {}
        self._families: dict[str, Reduction] = {}
        for declared in declarations:
            for name, reduction in declared.items():
                table = self._families if name.endswith("*") else self._exact
                key = name.removesuffix("*")
                if table.get(key, reduction) is not reduction:
                    raise ValueError(
                        f"metric {name!r} declared with two reductions: {table[key]} and "
                        f"{reduction}"
                    )
                table[key] = Reduction(reduction)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def _find(self, name: str) -> Reduction | None:
        if name in self._exact:
            return self._exact[name]
        prefixes = [prefix for prefix in self._families if name.startswith(prefix)]
        return self._families[max(prefixes, key=len)] if prefixes else None

    def of(self, name: str) -> Reduction:
        """The reduction of metric `name`; an undeclared name is an error."""
        found = self._find(name)
        if found is None:
            raise KeyError(
                f"metric {name!r} declares no reduction: add it to its maker's declarations "
                "(megatron_rl.algo.reductions)"
            )
        return found

    def combine(self, name: str, values: Sequence[float]) -> float:
        """`values` of metric `name` (in order, for LAST) as one value; NaN when there are none.
        A non-finite value is kept: NaN in, NaN out (inf in, inf out for MEAN, SUM, MAX)."""
        reduction = self.of(name)
        if not values:
            return math.nan
        if any(math.isnan(value) for value in values):
            return math.nan
        if reduction is Reduction.MEAN:
            return sum(values) / len(values)
        if reduction is Reduction.SUM:
            return sum(values)
        if reduction is Reduction.MAX:
            return max(values)
        if reduction is Reduction.MIN:
            return min(values)
        return values[-1]
