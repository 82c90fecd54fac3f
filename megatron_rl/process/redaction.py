"""What counts as a secret in a recipe, an environment or a command line, and how it is hidden
wherever those are shown: logs, printed command lines, wandb's config.

A name is secret when one of its words (split at anything but letters and digits) is KEY, TOKEN,
SECRET, PASSWORD, PASSWD or CREDENTIALS, in any case, and its last word is not FILE, PATH or DIR
(a key's file is not the key): `HF_TOKEN`, `WANDB_API_KEY`, `--api-key`, `--hf-token` are;
`--tokenizer-path`, `api_key_file` are not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

REDACTED = "[redacted]"
_SECRET_WORDS = frozenset({"key", "token", "secret", "password", "passwd", "credentials"})
_PLACE_WORDS = frozenset({"file", "path", "dir"})
_WORD = re.compile(r"[A-Za-z0-9]+")


def is_secret_name(name: str) -> bool:
    words = [word.lower() for word in _WORD.findall(name)]
    return bool(words) and words[-1] not in _PLACE_WORDS and not _SECRET_WORDS.isdisjoint(words)


def redacted_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of every secret flag (`--api-key KEY`, `--hf-token=KEY`)
    replaced."""
    shown: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next and not word.startswith("-"):
            shown.append(REDACTED)
            hide_next = False
            continue
        flag, equals, _ = word.partition("=")
        is_flag = word.startswith("-") and is_secret_name(flag)
        shown.append(f"{flag}={REDACTED}" if is_flag and equals else word)
        hide_next = is_flag and not equals
    return shown


def redacted_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the value of every secret name replaced."""
    return {name: REDACTED if is_secret_name(name) else value for name, value in env.items()}


def redacted_config(config: Any) -> Any:
    """A copy of `config` (nested dicts and lists, as `dataclasses.asdict` gives a recipe) with
    secret-named values replaced, and secret flags' values in lists of strings (command-line
    arguments, such as rollout.sglang.extra_args) too."""
    if isinstance(config, Mapping):
        return {
            name: REDACTED
            if isinstance(name, str) and is_secret_name(name) and value
            else redacted_config(value)
            for name, value in config.items()
        }
    if isinstance(config, list | tuple):
        if all(isinstance(item, str) for item in config):
            return redacted_argv(config)
        return [redacted_config(item) for item in config]
    return config
