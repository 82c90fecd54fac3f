"""The `megatron-rl` CLI, run in-process and as the installed console script."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.algo import policy_loss_names
from megatron_rl.cli import main


def test_losses_prints_one_row_per_registered_loss_and_writes_json(tmp_path, capsys):
    out = tmp_path / "nested" / "losses.json"
    assert main(["losses", "--seed", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    table_rows = [line for line in printed.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in table_rows] == list(policy_loss_names())
    data = json.loads(out.read_text())
    assert [row["loss"] for row in data["rows"]] == list(policy_loss_names())
    assert data["spec"]["seed"] == 3
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    by_name = {row["loss"]: row for row in data["rows"]}
    # GSPO-token equals GSPO on this batch of per-sequence advantages
    assert by_name["gspo_token"]["value"] == pytest.approx(by_name["gspo"]["value"], rel=1e-5)
    # GSPO clips whole sequences: its token and sequence clip fractions move together, while
    # GRPO clips scattered tokens inside most sequences
    assert by_name["grpo"]["clip_frac/token"] < 0.2 < by_name["grpo"]["clip_frac/seq"]


def test_losses_rejects_a_bad_fraction(capsys):
    with pytest.raises(SystemExit):
        main(["losses", "--routing-changed-frac", "1.5"])
    assert "expected a fraction in [0, 1]" in capsys.readouterr().err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "megatron-rl"
    result = subprocess.run(
        [str(script), "losses", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "| gspo | sequence |" in result.stdout


def test_overrides_after_an_option_are_taken(capsys):
    recipe = str(Path(__file__).resolve().parents[2] / "examples" / "moe" / "tiny_gspo.yaml")
    # run.steps=0 is refused when the recipe is checked: the override after --resume was read
    assert main(["train", recipe, "--resume", "run.steps=0"]) == 2
    assert "run.steps: expected > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", recipe, "--resume", "steps"])
    assert "unrecognized arguments: steps (overrides are dotted KEY=VALUE)" in (
        capsys.readouterr().err
    )


def test_a_command_without_a_graceful_stop_leaves_ignored_signals_ignored():
    """Started ignoring SIGUSR1 (as a rank of launch/node.py is), `losses` ends ignoring it,
    for the processes it would start to inherit."""
    code = (
        "import signal; from megatron_rl.cli import main; main(['losses']); "
        "print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True", result.stdout[-2000:]
