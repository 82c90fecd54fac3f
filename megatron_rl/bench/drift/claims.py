"""The literature's claims, checked on a drift grid's summary rows: PASS, FAIL or NOT TESTED,
with the numbers and the drift regime behind each verdict.

Pure functions of the rows (summary.py; the ones of finished runs), so that each claim is tested
on synthetic rows in both directions. The thresholds are fixed here, before any checked-in run:
- `STRONG_DRIFT`: the papers' regime starts at 5% of (token, layer) pairs routed differently per
  step; claim 5 is tested only there;
- `CLIP_RATIO`: "far larger" is at least 10x (the GSPO paper reports ~100x);
- `REPLAY_TIME_OVERHEAD`: replay is cheap if the learning phases take < 10% longer with it.
"Stable as" means no more collapse events than the reference arm over its seeds, and a mean
final held-out accuracy no lower than the reference's minus the larger of the two arms' seed
standard deviations.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STRONG_DRIFT = 0.05
CLIP_RATIO = 10.0
REPLAY_TIME_OVERHEAD = 0.10

PASS, FAIL, NOT_TESTED = "PASS", "FAIL", "NOT TESTED"

Row = dict[str, Any]


@dataclass(frozen=True)
class Claim:
    number: int
    statement: str
    verdict: str
    evidence: str
    regime: str


def _is(loss: str, replay: str, mismatch: str = "none") -> Callable[[Row], bool]:
    def matches(row: Row) -> bool:
        return (
            row["loss"] == loss and row["routing_replay"] == replay and row["mismatch"] == mismatch
        )

    return matches


GRPO = _is("grpo", "none")
GRPO_R2 = _is("grpo", "r2")
GSPO = _is("gspo", "none")
GSPO_ENGINE = _is("gspo", "none", mismatch="bypass")


def _no_replay(row: Row) -> bool:
    return row["routing_replay"] == "none" and row.get("drift_token_layer") is not None


def _mean(rows: list[Row], column: str) -> float | None:
    values = [row[column] for row in rows if row.get(column) is not None]
    return statistics.fmean(values) if values else None


def _std(rows: list[Row], column: str) -> float:
    values = [row[column] for row in rows if row.get(column) is not None]
    return statistics.stdev(values) if len(values) > 1 else 0.0


def group_by(rows: list[Row], column: str) -> dict[Any, list[Row]]:
    """The rows by their value of `column`, in first-seen order."""
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[row[column]].append(row)
    return groups


def _cells(rows: list[Row], *arms: Callable[[Row], bool]) -> list[list[list[Row]]]:
    """Per cell holding every one of `arms`: that cell's rows of each arm."""
    cells = []
    for cell_rows in group_by(rows, "cell").values():
        per_arm = [[row for row in cell_rows if arm(row)] for arm in arms]
        if all(per_arm):
            cells.append(per_arm)
    return cells


def _pooled(cells: list[list[list[Row]]], arm: int) -> list[Row]:
    """The rows of the `arm`-th arm of `_cells` over all of `cells`."""
    return [row for cell in cells for row in cell[arm]]


def _regime(rows: list[Row]) -> str:
    drift = _mean([row for row in rows if _no_replay(row)], "drift_token_layer")
    if drift is None:
        return "no drift measured (no run without replay)"
    return f"{drift:.2%} token-layer drift per step (mean of the runs without replay)"


def _stable_as(candidate: list[Row], reference: list[Row]) -> tuple[bool, str]:
    """`candidate` is as stable as `reference` (module docstring), and the numbers."""
    events = sum(row["collapse_events"] for row in candidate)
    reference_events = sum(row["collapse_events"] for row in reference)
    accuracy, reference_accuracy = (
        _mean(candidate, "final_accuracy"),
        _mean(reference, "final_accuracy"),
    )
    spread = max(_std(candidate, "final_accuracy"), _std(reference, "final_accuracy"))
    if accuracy is None or reference_accuracy is None:
        return False, "no final accuracy"
    stable = events <= reference_events and accuracy >= reference_accuracy - spread
    text = (
        f"collapses {events} vs {reference_events}, final accuracy {accuracy:.3f} vs "
        f"{reference_accuracy:.3f} (spread {spread:.3f}, n={len(candidate)}/{len(reference)})"
    )
    return stable, text


def drift_after_update(rows: list[Row]) -> Claim:
    statement = (
        "Without replay the routing drifts after an update (> 0); with R2 the routing used in "
        "the training forward equals the recorded one."
    )
    free = [r for r in rows if _no_replay(r) and r["updates_per_batch"] > 1]
    r2 = [r for r in rows if r["routing_replay"] == "r2" and r.get("replay_miss_max") is not None]
    if not free or not r2:
        return Claim(
            1,
            statement,
            NOT_TESTED,
            "needs runs without replay (>1 update per batch) and with R2",
            _regime(rows),
        )
    smallest = min(r["drift_token_layer"] for r in free)
    miss = max(r["replay_miss_max"] for r in r2)
    verdict = PASS if smallest > 0 and miss == 0 else FAIL
    evidence = (
        f"without replay: drift {_mean(free, 'drift_token_layer'):.2%} of (token, layer) pairs "
        f"per step (smallest run {smallest:.2%}, {len(free)} runs); R2: replayed vs used "
        f"routing differ in at most {miss:.2%} of pairs ({len(r2)} runs)"
    )
    return Claim(1, statement, verdict, evidence, _regime(free))


def drift_grows_with_depth(rows: list[Row]) -> Claim:
    statement = (
        "Drift grows with depth: tokens with at least one changed layer rise with the number of "
        "layers, and later layers drift more than earlier ones."
    )
    base = [r for r in rows if r["cell"] == "base"]
    if not base:
        return Claim(2, statement, NOT_TESTED, "no base point", _regime(rows))
    at_base = {(r["updates_per_batch"], r["lr"]) for r in base}
    free = [r for r in rows if _no_replay(r) and (r["updates_per_batch"], r["lr"]) in at_base]
    by_depth: dict[int, list[Row]] = defaultdict(list)
    for row in free:
        by_depth[row["layers"]].append(row)
    if len(by_depth) < 2:
        return Claim(
            2,
            statement,
            NOT_TESTED,
            "needs runs without replay at two depths or more",
            _regime(rows),
        )
    depths = sorted(by_depth)
    token_any = [_mean(by_depth[d], "drift_token_any") for d in depths]
    rising = all(a < b for a, b in itertools.pairwise(token_any))
    later_more, halves = True, []
    for depth in depths:
        if depth < 2:
            continue
        half = depth // 2
        first = statistics.fmean(
            _mean(by_depth[depth], f"drift_layer_{i}") or 0 for i in range(half)
        )
        last = statistics.fmean(
            _mean(by_depth[depth], f"drift_layer_{i}") or 0 for i in range(depth - half, depth)
        )
        later_more &= last > first
        halves.append(f"{depth} layers: first half {first:.2%}, last half {last:.2%}")
    verdict = PASS if rising and later_more else FAIL
    evidence = (
        "tokens with a changed layer: "
        + ", ".join(f"{d} layers {v:.2%}" for d, v in zip(depths, token_any, strict=True))
        + "; "
        + "; ".join(halves)
    )
    return Claim(2, statement, verdict, evidence, _regime(free))


def tails_fatten_without_replay(rows: list[Row]) -> Claim:
    statement = (
        "Routing changes fatten the token log-ratio's tail: max |log w| and the share outside "
        "[0.8, 1.25] are larger without replay than with R2 at the same learning rate."
    )
    cells = [c for c in _cells(rows, GRPO, GRPO_R2) if c[0][0]["updates_per_batch"] > 1]
    if not cells:
        return Claim(
            3,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at >1 update per batch",
            _regime(rows),
        )
    free = _pooled(cells, 0)
    r2 = _pooled(cells, 1)
    parts, larger = [], True
    for column, label in (
        ("log_ratio_abs_max", "max |log w|"),
        ("log_ratio_outside_0.8_1.25", "outside [0.8, 1.25]"),
    ):
        a, b = _mean(free, column), _mean(r2, column)
        if a is None or b is None:
            return Claim(3, statement, NOT_TESTED, f"no {label} measured", _regime(rows))
        larger &= a > b
        parts.append(f"{label}: {a:.4g} without replay vs {b:.4g} with R2")
    evidence = "; ".join(parts) + f" ({len(cells)} cells, {len(free)}/{len(r2)} runs)"
    return Claim(3, statement, PASS if larger else FAIL, evidence, _regime(free))


def gspo_clips_far_more(rows: list[Row]) -> Claim:
    statement = (
        f"GSPO's token clip fraction is far larger (>= {CLIP_RATIO:g}x) than GRPO's at the "
        "papers' clip ranges."
    )
    cells = _cells(rows, lambda r: r["loss"] == "gspo", lambda r: r["loss"] == "grpo")
    if not cells:
        return Claim(4, statement, NOT_TESTED, "needs GSPO and GRPO runs", _regime(rows))
    gspo = _mean(_pooled(cells, 0), "clip_frac_token") or 0.0
    grpo = _mean(_pooled(cells, 1), "clip_frac_token") or 0.0
    ratio = gspo / grpo if grpo > 0 else (float("inf") if gspo > 0 else 0.0)
    evidence = (
        f"clipped tokens: GSPO {gspo:.2%}, GRPO {grpo:.3%} ({ratio:.0f}x, {len(cells)} cells)"
    )
    return Claim(4, statement, PASS if ratio >= CLIP_RATIO else FAIL, evidence, _regime(rows))


def gspo_as_stable_as_r2(rows: list[Row]) -> Claim:
    statement = (
        "GSPO without replay is at least as stable as GRPO + R2, at a drift regime of at least "
        f"{STRONG_DRIFT:.0%} token-layer drift per step."
    )
    cells = _cells(rows, GSPO, GRPO_R2)
    strong = [c for c in cells if (_mean(c[0], "drift_token_layer") or 0) >= STRONG_DRIFT]
    if not strong:
        reached = max((_mean(c[0], "drift_token_layer") or 0 for c in cells), default=0.0)
        return Claim(
            5,
            statement,
            NOT_TESTED,
            f"no cell reached {STRONG_DRIFT:.0%} (GSPO's largest mean drift: {reached:.2%})",
            _regime(rows),
        )
    results = [(c[0][0]["cell"], *_stable_as(c[0], c[1])) for c in strong]
    verdict = PASS if all(ok for _, ok, _ in results) else FAIL
    evidence = "; ".join(f"{cell}: {text}" for cell, _, text in results)
    return Claim(5, statement, verdict, evidence, _regime(_pooled(strong, 0)))


def on_policy_needs_no_replay(rows: list[Row]) -> Claim:
    statement = (
        "On-policy (1 update per rollout batch) GRPO without replay is as stable as with R2; with "
        "several off-policy updates it is not (arXiv 2512.01374)."
    )
    cells = _cells(rows, GRPO, GRPO_R2)
    on = [c for c in cells if c[0][0]["updates_per_batch"] == 1]
    off_degree = max((c[0][0]["updates_per_batch"] for c in cells), default=1)
    off = [c for c in cells if c[0][0]["updates_per_batch"] == off_degree > 1]
    if not on or not off:
        return Claim(
            6,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at 1 and at >1 updates per batch",
            _regime(rows),
        )
    on_results = [_stable_as(c[0], c[1]) for c in on]
    off_results = [_stable_as(c[0], c[1]) for c in off]
    verdict = (
        PASS if all(ok for ok, _ in on_results) and not any(ok for ok, _ in off_results) else FAIL
    )
    evidence = (
        "1 update: "
        + "; ".join(text for _, text in on_results)
        + f". {off_degree} updates: "
        + "; ".join(text for _, text in off_results)
    )
    return Claim(6, statement, verdict, evidence, _regime(_pooled(off, 0)))


def engine_logprobs_suffice(rows: list[Row]) -> Claim:
    statement = (
        "GSPO trained on the engine's log-probs (no old-policy forward) is as stable as GSPO "
        "with the forward, and saves that phase's time."
    )
    cells = _cells(rows, GSPO_ENGINE, GSPO)
    if not cells:
        return Claim(
            7,
            statement,
            NOT_TESTED,
            "needs GSPO with and without the engine's log-probs",
            _regime(rows),
        )
    engine = _pooled(cells, 0)
    forward = _pooled(cells, 1)
    stable, text = _stable_as(engine, forward)
    saved = (_mean(forward, "old_logprob_s") or 0) - (_mean(engine, "old_logprob_s") or 0)
    step = _mean(forward, "step_s") or float("nan")
    verdict = PASS if stable and saved > 0 else FAIL
    evidence = (
        f"{text}; no old-policy forward saved {saved:.3f} s per step "
        f"({saved / step:.1%} of GSPO's step)"
    )
    return Claim(7, statement, verdict, evidence, _regime(forward))


def replay_is_cheap(rows: list[Row]) -> Claim:
    statement = (
        f"Replay's overhead: R2's learning phases (old-policy pass + updates, per response token) "
        f"take less than {REPLAY_TIME_OVERHEAD:.0%} longer than without replay."
    )
    cells = _cells(rows, GRPO_R2, GRPO)
    if not cells:
        return Claim(8, statement, NOT_TESTED, "needs GRPO with and without R2", _regime(rows))
    r2 = _pooled(cells, 0)
    free = _pooled(cells, 1)
    with_replay, without = _mean(r2, "learn_s_per_1k_tokens"), _mean(free, "learn_s_per_1k_tokens")
    if with_replay is None or without is None:
        return Claim(8, statement, NOT_TESTED, "no learning-phase times", _regime(rows))
    overhead = with_replay / without - 1
    memory = _mean(r2, "record_bytes") or 0
    evidence = (
        f"{with_replay:.3f} vs {without:.3f} s per 1000 response tokens ({overhead:+.1%}); R2 "
        f"holds {memory / 2**20:.2f} MiB of recorded routing per step ({len(r2)}/{len(free)} runs)"
    )
    return Claim(
        8, statement, PASS if overhead < REPLAY_TIME_OVERHEAD else FAIL, evidence, _regime(free)
    )


CLAIMS = (
    drift_after_update,
    drift_grows_with_depth,
    tails_fatten_without_replay,
    gspo_clips_far_more,
    gspo_as_stable_as_r2,
    on_policy_needs_no_replay,
    engine_logprobs_suffice,
    replay_is_cheap,
)


def check_claims(rows: list[Row]) -> list[Claim]:
    """Every claim on the rows of the runs that finished."""
    done = [row for row in rows if row["state"] == "done"]
    return [claim(done) for claim in CLAIMS]
