"""What every claim shares: the thresholds, the grid's models, the arms as row selectors, the
cells that hold them and the drift regime a verdict is given in.

The thresholds are fixed here, before any checked-in run:
- `STRONG_DRIFT`: the papers' regime starts at 5% of activated experts ((token, layer, chosen
  expert) triples) that the old policy did not choose, after each update (`REGIME_METRIC`,
  `since_old_activated`: the GSPO paper's "after each update, ~10% of the experts activated
  under the new policy differ from the old policy's"); claim 6 is tested only there, and claim
  21 asks the main model's base point to reach it. Claims about one update's own change use
  `update_activated` (the routing before that update against after it);
- `CLIP_RATIO`: "far larger" is at least 10x (the GSPO paper reports ~100x);
- `REPLAY_TIME_OVERHEAD`: replay is cheap if the learning phases take < 10% longer with it (the
  95% interval of the per-seed overhead, paired within each cell, below it);
- `ROUTING_SHARE`: routing "causes most" of the token log-ratio if replaying the old routing
  removes at least half of its variance, pooled over a run's steps
  (`log_ratio_var_share_pooled` >= 0.5);
- `RANK_CORRELATION`: the near-tie share "predicts" a layer's drift if their Spearman rank
  correlation over the layers (each a mean over runs) is at least 0.5, its 95% interval too;
- `PRECURSOR_FALSE_ALARMS`: a precursor rule tells a collapse coming only if it fires in at most
  10% of the runs that never collapse (summary.py's `false_alarm`); otherwise claim 15 is NOT
  TESTED;
- `MOE_K3`: the MoE mismatch regime is a k3 KL between engine and trainer log-probs of at least
  1e-3 (the R3 paper reports ~1.5e-3 for MoE models).
"As stable as" is decided in stability.py: paired over seeds, final accuracy's 95% interval
against a non-inferiority margin and collapses by an exact test stratified by cell, giving PASS,
FAIL or INCONCLUSIVE (or NOT TESTED where the two arms are the same computation). Every other
comparison is an uncertainty.Effect against its threshold: per seed (`per_seed`) for one arm's
value, per pair of runs (`paired`) for two arms'.

The rows name their base model in `model` (`MAIN_MODEL` is the main one; `FINE_MODELS` the
fine-grained MoE ones; `DENSE_MODEL` the one-expert control) and the rollout engine's precision
in `engine_dtype` (missing: float32). An arm is its (loss, routing_replay, mismatch) and whether
it freezes the routers (`freeze_router`, missing: not frozen). "Runs without replay" are those
with routing_replay none and trained routers, on a model with routing (not `DENSE_MODEL`).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.bench.drift.stability import distinct, paired_runs

STRONG_DRIFT = 0.05
REGIME_METRIC = "since_old_activated"
CLIP_RATIO = 10.0
REPLAY_TIME_OVERHEAD = 0.10
ROUTING_SHARE = 0.5
RANK_CORRELATION = 0.5
MOE_K3 = 1e-3
PRECURSOR_FALSE_ALARMS = 0.1

# The grid's models (grid.DEFAULT_GRID): both fine-grained ones at 128 experts, so that claim 17
# compares the router kinds at one expert count.
MAIN_MODEL = "fine_qwen3_e128"
FINE_MODELS = ("fine_qwen3_e128", "fine_deepseek_e128")
SIGMOID_MODEL = "fine_deepseek_e128"
DENSE_MODEL = "dense_control"
LOW_PRECISION = ("bfloat16", "float8_emulated")
ENGINE_DTYPES = ("float32", "bfloat16", "float8_emulated")  # in rising rounding error

Row = dict[str, Any]


@dataclass(frozen=True)
class Claim:
    number: int
    statement: str
    verdict: str
    evidence: str
    regime: str


def is_frozen(row: Row) -> bool:
    """The run froze its routers (`freeze_router`; missing: no; a CSV's "True" counts)."""
    value = row.get("freeze_router")
    return value is True or str(value).lower() in ("true", "1")


def engine_of(row: Row) -> str:
    return row.get("engine_dtype") or "float32"


def arm_is(
    loss: str, replay: str, mismatch: str = "none", frozen: bool = False
) -> Callable[[Row], bool]:
    def matches(row: Row) -> bool:
        return (
            row["loss"] == loss
            and row["routing_replay"] == replay
            and row["mismatch"] == mismatch
            and is_frozen(row) == frozen
        )

    return matches


GRPO = arm_is("grpo", "none")
GRPO_R2 = arm_is("grpo", "r2")
GRPO_R3 = arm_is("grpo", "r3")
GRPO_R3_WEIGHTS = arm_is("grpo", "r3_weights")
GRPO_FROZEN = arm_is("grpo", "none", frozen=True)
GRPO_TIS = arm_is("grpo", "none", mismatch="tis")
GRPO_MIS = arm_is("grpo", "none", mismatch="mis")
GRPO_TIS_MIS = arm_is("grpo", "none", mismatch="tis+mis_geometric")
GSPO = arm_is("gspo", "none")
GSPO_ENGINE = arm_is("gspo", "none", mismatch="bypass")


def no_replay(row: Row) -> bool:
    """A run whose routers choose freely and are trained (module docstring), on a model that has
    a choice to make: the dense control's one expert is always chosen."""
    return (
        row["routing_replay"] == "none" and not is_frozen(row) and row.get("model") != DENSE_MODEL
    )


def values_of(rows: list[Row], column: str) -> list[float]:
    return [row[column] for row in rows if row.get(column) is not None]


def mean_of(rows: list[Row], column: str) -> float | None:
    values = values_of(rows, column)
    return statistics.fmean(values) if values else None


def group_by(rows: list[Row], column: str) -> dict[Any, list[Row]]:
    """The rows by their value of `column`, in first-seen order."""
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[row[column]].append(row)
    return groups


def cells_with(rows: list[Row], *arms: Callable[[Row], bool]) -> list[list[list[Row]]]:
    """Per cell holding every one of `arms`: that cell's rows of each arm."""
    cells = []
    for cell_rows in group_by(rows, "cell").values():
        per_arm = [[row for row in cell_rows if arm(row)] for arm in arms]
        if all(per_arm):
            cells.append(per_arm)
    return cells


def pooled(cells: list[list[list[Row]]], arm: int) -> list[Row]:
    """The rows of the `arm`-th arm of `cells_with` over all of `cells`."""
    return [row for cell in cells for row in cell[arm]]


def main_base(rows: list[Row]) -> list[Row]:
    """The rows of the main model at the base point."""
    return [r for r in rows if r["cell"] == "base" and r.get("model") == MAIN_MODEL]


def regime_of(rows: list[Row]) -> str:
    """The papers' drift metric over the runs without replay among `rows`, naming the model and
    the engine when those runs share one."""
    free = [row for row in rows if no_replay(row)]
    measured = [row for row in free if row.get(REGIME_METRIC) is not None]
    if not measured:
        drift = mean_of(free, "drift_token_layer")
        if drift is None:
            return "no drift measured (no run without replay)"
        return f"{drift:.2%} token-layer drift per step (mean of the runs without replay)"
    where = ""
    models = {row.get("model") for row in measured}
    if len(models) == 1 and None not in models:
        where += f", model {models.pop()}"
    engines = {engine_of(row) for row in measured}
    if len(engines) == 1:
        where += f", engine {engines.pop()}"
    drift = mean_of(measured, REGIME_METRIC)
    return (
        f"{drift:.2%} of activated experts changed since the old policy after each update "
        f"(mean of the runs without replay{where})"
    )


def counted(counts: Counter[str]) -> str:
    """ "name n, name n" from the most common down, as the precursor's tallies are printed."""
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def machine_counts(rows: list[Row]) -> Counter[str]:
    """How many of `rows` each machine ran (as status.json records it; older runs record none)."""
    return Counter(row["machine"] for row in rows if row.get("machine"))


def machines_note(rows: list[Row]) -> str:
    """For evidence built on times: which machines ran `rows` when they were more than one
    (a grid resumed elsewhere), else nothing."""
    counts = machine_counts(rows)
    if len(counts) < 2:
        return ""
    ran = ", ".join(f"{name}: {count}" for name, count in sorted(counts.items()))
    return f"; times of runs on {len(counts)} machines ({ran} runs)"


def layer_columns(rows: list[Row], prefix: str) -> list[int]:
    """The layer numbers i of the `prefix<i>` columns any of `rows` has, in order."""
    return sorted(
        {int(key[len(prefix) :]) for row in rows for key in row if key.startswith(prefix)}
    )


# what must be equal for two runs of different models or engines to be compared (besides the
# arm): the swept fields the rows name (other swept fields are not told apart)
SETTINGS = ("updates_per_batch", "lr", "layers")


def per_seed(rows: list[Row], value: Callable[[Row], float | None]) -> list[float]:
    """One observation per seed, in seed order: the mean of `value` over the distinct runs of
    `rows` with that seed where it is measured. Runs of one seed share prompts, minibatch order
    and engine seeds, so they are not independent observations; seeds are."""
    by_seed: dict[Any, list[float]] = defaultdict(list)
    for row in distinct(rows):
        measured = value(row)
        if measured is not None:
            by_seed[row["seed"]].append(measured)
    return [statistics.fmean(by_seed[seed]) for seed in sorted(by_seed)]


def paired(
    candidate: list[Row], reference: list[Row], value: Callable[[Row, Row], float | None]
) -> list[float]:
    """`value` of each (candidate run, reference run) of one cell, model and seed
    (stability.paired_runs), where it is measured."""
    values = (value(a, b) for a, b in paired_runs(candidate, reference))
    return [v for v in values if v is not None]


def difference(column: str) -> Callable[[Row, Row], float | None]:
    """a[column] - b[column] of a pair of runs, None unless both measured it."""

    def of(a: Row, b: Row) -> float | None:
        if a.get(column) is None or b.get(column) is None:
            return None
        return a[column] - b[column]

    return of


def column(name: str) -> Callable[[Row], float | None]:
    """A run's value of column `name` (None when not measured)."""
    return lambda row: row.get(name)
