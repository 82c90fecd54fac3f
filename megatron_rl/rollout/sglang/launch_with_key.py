"""`PYTHON launch_with_key.py KEY_FILE MODULE [ARGS...]`: run SGLang's server or sglang-router
(`python -m MODULE ARGS...`) with the run's API key, which never reaches a command line or a log.

Run by path with SGLang's own interpreter, which need not have megatron-rl installed: this file
imports the standard library only. It

- reads the key from KEY_FILE (a file only its owner can read: megatron_rl.rollout.sglang.api_key);
- adds it to MODULE's arguments in this process's `sys.argv` only (`/proc/PID/cmdline` keeps the
  arguments this process was started with; SGLang's spawned workers get theirs through a pipe);
- replaces it with `[redacted]` in everything written to this process's stdout and stderr, by
  this process and every process it starts: SGLang 0.5.23 logs all its settings, keys
  included, at start-up;
- runs MODULE as `python -m MODULE` would, in this process.

The key flags per module are in `KEY_FLAGS`; SGLang's server takes the one key as both its API
key and its admin key (docs/sglang.md says why one key).
"""

from __future__ import annotations

import os
import sys

# Run by path, this file's folder is first on sys.path, where its neighbours (http.py, config.py)
# would stand in for the standard library's and SGLang's modules of those names.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

import runpy
import select
import signal

KEY_FLAGS = {
    "sglang.launch_server": ("--api-key", "--admin-api-key"),
    "sglang_router.launch_router": ("--api-key",),
}
REDACTED = b"[redacted]"
_READ_BYTES = 65536


def read_key(path: str) -> str:
    """The key in `path`: one line of at least 32 characters, in a file only its owner reads."""
    with open(path, encoding="ascii") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        key = handle.read().strip()
    if mode & 0o077:
        raise SystemExit(f"{path}: readable by others (mode {mode & 0o777:o}); chmod 600 it")
    if len(key) < 32 or not key.isalnum():
        raise SystemExit(f"{path}: expected one line of at least 32 letters or digits (a key)")
    return key


def kept_back(data: bytes, secret: bytes) -> int:
    """How many bytes at the end of `data` could be the start of `secret`: they wait for what
    follows, so that a key written in two pieces is still redacted whole."""
    for length in range(min(len(data), len(secret) - 1), 0, -1):
        if secret.startswith(data[-length:]):
            return length
    return 0


def copy_redacted(sources: dict[int, int], secret: bytes) -> None:
    """Copy each readable fd of `sources` to its writable fd, `secret` replaced, until every
    source ends."""
    pending = dict.fromkeys(sources, b"")
    poller = select.poll()
    for source in sources:
        poller.register(source, select.POLLIN | select.POLLHUP)
    while pending:
        for source, _ in poller.poll():
            chunk = os.read(source, _READ_BYTES)
            data = (pending[source] + chunk).replace(secret, REDACTED)
            hold = kept_back(data, secret) if chunk else 0
            _write_all(sources[source], data[: len(data) - hold])
            if chunk:
                pending[source] = data[len(data) - hold :]
            else:
                poller.unregister(source)
                del pending[source]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BrokenPipeError:  # no one reads the log any more: drop the output
            return


def redact_output(secret: bytes) -> None:
    """From here on, this process's and its children's stdout and stderr pass through a copying
    process that redacts `secret`; it ends when the last of them closes its end."""
    pipes = {target: os.pipe() for target in (1, 2)}
    if os.fork() == 0:  # the copying process: still holds the original stdout and stderr
        # A SIGTERM to the group stops the server, which still logs its way out: the copy ends
        # when the server's last process has closed its ends.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for _, write_end in pipes.values():
            os.close(write_end)
        copy_redacted({read_end: target for target, (read_end, _) in pipes.items()}, secret)
        os._exit(0)
    for target, (read_end, write_end) in pipes.items():
        os.dup2(write_end, target)
        os.close(write_end)
        os.close(read_end)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in KEY_FLAGS:
        modules = ", ".join(KEY_FLAGS)
        raise SystemExit(f"usage: launch_with_key.py KEY_FILE MODULE [ARGS...]; MODULE: {modules}")
    key_file, module, *args = argv
    flags = KEY_FLAGS[module]
    given = [word for word in args if word.split("=", 1)[0] in flags]
    if given:
        raise SystemExit(
            f"{module}: {', '.join(given)} given; the run's key (from {key_file}) is passed by "
            "megatron-rl: remove it from the arguments (rollout.sglang.extra_args)"
        )
    key = read_key(key_file)
    redact_output(key.encode())
    sys.argv = [module, *args, *(word for flag in flags for word in (flag, key))]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
