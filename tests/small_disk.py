"""A command run with a directory on a small file system of its own: a tmpfs mounted in a
private mount namespace (`unshare`), gone with the command. Needs root; tests skip without it."""

from __future__ import annotations

import subprocess

import pytest

_MOUNT = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c"]
# After the command: what the directory holds (the mount ends with the namespace).
_SCRIPT = (
    'mount -t tmpfs -o size="$1" tmpfs "$0" || exit 77; shift 2; "$@"; code=$?; '
    'echo "left: $(ls -A "$0")"; exit $code'
)


def on_small_disk(directory: str, size: str, command: list[str]) -> list[str]:
    """`command` with `directory` on a tmpfs of `size` (`8m`); the command's last line of
    output is then `left: NAMES` (what `directory` holds after it). Skips the test where no
    file system can be mounted."""
    probe = subprocess.run([*_MOUNT, _SCRIPT, directory, size, "--", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {probe.stderr.decode()[-200:]}")
    return [*_MOUNT, _SCRIPT, directory, size, "--", *command]
