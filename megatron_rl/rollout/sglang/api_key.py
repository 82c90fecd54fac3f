"""The run's SGLang API key: a secret in a file of the run directory that only its owner reads.

Every SGLang server and sglang-router of a run takes it (through `launch_with_key.py`, which keeps
it off command lines and out of logs), and every request of the trainer carries it as
`Authorization: Bearer KEY` (docs/sglang.md, "Who can drive the servers"). The key itself is
never printed: `ApiKey`'s repr shows the file it came from.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

RUN_KEY_FILE = "sglang_api_key"
"""The key's file in the run directory (RUN_DIR/sglang_api_key)."""
KEY_BYTES = 32
MIN_KEY_CHARS = 32


@dataclass(frozen=True)
class ApiKey:
    """A key and the file it was read from."""

    path: Path
    value: str = field(repr=False)

    @property
    def header(self) -> dict[str, str]:
        """What every request carries."""
        return {"Authorization": f"Bearer {self.value}"}


def run_key_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RUN_KEY_FILE


def run_key(run_dir: str | Path) -> ApiKey:
    """The run's key, in RUN_DIR/sglang_api_key, made on first use."""
    return read_key(ensure_key_file(run_key_path(run_dir)), given_as="the run's API key file")


def ensure_key_file(path: Path) -> Path:
    """`path`, holding a fresh random key (mode 0600) unless it exists already. Processes that
    start at once (a job's rollout servers) all end up reading the one key: each writes a key of
    its own to a temporary file and links it to `path`, which only the first link creates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return path
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(secrets.token_hex(KEY_BYTES) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process's key came first
            os.link(temporary, path)
    finally:
        temporary.unlink()
    return path


def read_key(path: str | Path, *, given_as: str) -> ApiKey:
    """The key in `path`; a ValueError naming `given_as` when the file is missing, readable by
    others than its owner, or does not hold one line of at least 32 letters and digits."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        value = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{given_as}: cannot read the API key file {path} ({error})") from None
    if stat.S_IMODE(mode) & 0o077:
        raise ValueError(
            f"{given_as}: {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"`chmod 600 {path}`"
        )
    if len(value) < MIN_KEY_CHARS or not value.isalnum() or not value.isascii():
        raise ValueError(
            f"{given_as}: {path} must hold one line of at least {MIN_KEY_CHARS} letters and "
            "digits (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return ApiKey(path, value)
