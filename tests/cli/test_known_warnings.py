"""The console keeps megatron-core's known, harmless warnings off and lets every other warning
through; RUN_DIR/warnings.log and --verbose keep them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

from megatron_rl.cli.known_warnings import KNOWN_WARNINGS, WarningRouter

APEX = "Apex is not installed. Falling back to Torch Norm"
UPSTREAM = "/site-packages/megatron/core/models/backends.py"


def _warn(router: WarningRouter, message: str, filename: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        router.install()
        warnings.warn_explicit(message, UserWarning, filename, 21)


def test_known_warnings_go_to_the_log_with_the_rank_and_others_to_the_console(tmp_path):
    console = io.StringIO()
    router = WarningRouter(console=console)
    _warn(router, APEX, UPSTREAM)  # before the log exists: held
    _warn(router, "something new", UPSTREAM)
    _warn(router, APEX, "/home/user/my_code.py")  # the same text from elsewhere is not known
    assert console.getvalue() == (
        f"{UPSTREAM}:21: UserWarning: something new\n"
        f"/home/user/my_code.py:21: UserWarning: {APEX}\n"
    )
    router.log_to(tmp_path / "run" / "warnings.log", prefix="[rank 1] ")
    _warn(router, APEX, UPSTREAM)
    lines = (tmp_path / "run" / "warnings.log").read_text().splitlines()
    assert lines == [f"[rank 1] {UPSTREAM}:21: UserWarning: {APEX}"] * 2
    assert console.getvalue().count(APEX) == 1
    assert router.kept == 2  # the held one counted once, the other warnings not at all


def test_verbose_shows_the_known_ones_too(tmp_path):
    console = io.StringIO()
    router = WarningRouter(verbose=True, console=console)
    router.log_to(tmp_path / "warnings.log")
    _warn(router, APEX, UPSTREAM)
    assert APEX in console.getvalue()
    assert APEX in (tmp_path / "warnings.log").read_text()


def test_every_entry_says_why_it_is_harmless():
    assert all(len(entry.reason) > 40 for entry in KNOWN_WARNINGS)


def test_megatron_cores_import_warnings_are_caught(tmp_path):
    """A real megatron-core import: its warnings reach the router, and the console sees none."""
    code = (
        "from megatron_rl.cli.known_warnings import WarningRouter\n"
        "router = WarningRouter()\n"
        "router.install()\n"
        "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n"
        "print(len(router.held))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 5  # Apex / Transformer Engine, one per module
    assert "UserWarning" not in done.stderr
