"""Other libraries' warnings that the console does not need to show, each with the reason.

megatron-core and torch warn about things that are expected in this project's setting and change
nothing: the entries of KNOWN_WARNINGS. `megatron-rl` keeps them off the console: `train` writes
them to RUN_DIR/warnings.log, and `--verbose` shows them as Python shows any warning. Every other
warning reaches the console as usual.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class KnownWarning:
    """A warning recognised by its category, the start of its message and where it is raised."""

    category: type[Warning]
    message: str  # regular expression, matched at the start of the message
    origin: str  # a piece of the path of the file that warns
    reason: str  # why it is harmless here

    def matches(self, message: str, category: type[Warning], filename: str) -> bool:
        return (
            issubclass(category, self.category)
            and self.origin in Path(filename).as_posix()
            and re.match(self.message, message) is not None
        )


KNOWN_WARNINGS = (
    KnownWarning(
        UserWarning,
        r"(Transformer Engine and Apex are|Apex is) not installed",
        "megatron/core/",
        "Apex and Transformer Engine are GPU extras (setup.py's `gpu`); without them megatron-core "
        "uses its torch implementations, which is what the CPU path runs on",
    ),
    KnownWarning(
        UserWarning,
        r"full scope is deprecated",
        "megatron/core/transformer/transformer_config.py",
        "megatron-core 0.16.1 sets the deprecated cuda_graph_scope itself when none is given "
        "(transformer_config.py:1705); megatron-rl captures no CUDA graphs",
    ),
    KnownWarning(
        UserWarning,
        r"The \.grad attribute of a Tensor that is not a leaf Tensor",
        "megatron/core/optimizer/optimizer.py",
        "megatron-core's optimizer zeroes gradients by reading `.grad` of the distributed "
        "optimizer's parameter views (optimizer.py:66), which torch never fills; the gradients "
        "live in `main_grad`",
    ),
    KnownWarning(
        FutureWarning,
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        "torch/distributed/",
        "megatron-core 0.16.1's distributed optimizer calls collectives that torch 2.13 has "
        "renamed; they work unchanged",
    ),
)


class WarningRouter:
    """Shows each warning as Python does (on stderr), except the known ones, which are held until
    `log_to` names a file and then written there (and also shown, with `verbose`).

    Args:
        verbose: show the known warnings on the console too.
        known: the warnings to keep off the console.
        console: where warnings are shown; None: the process's stderr at the time.
    """

    def __init__(
        self,
        *,
        verbose: bool = False,
        known: tuple[KnownWarning, ...] = KNOWN_WARNINGS,
        console: TextIO | None = None,
    ) -> None:
        self.verbose, self.known, self.console = verbose, known, console
        self.held: list[str] = []
        self.kept = 0  # known warnings held or written to the log so far
        self._log: TextIO | None = None
        self._prefix = ""

    def install(self) -> None:
        """Route this process's warnings through `show` from now on."""
        warnings.showwarning = self.show

    def show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """`warnings.showwarning`'s signature (see the class docstring)."""
        text = warnings.formatwarning(message, category, filename, lineno, line)
        known = any(entry.matches(str(message), category, filename) for entry in self.known)
        if known:
            self.kept += 1
            self._keep(text)
        if self.verbose or not known:
            (self.console or file or sys.stderr).write(text)

    def log_to(self, path: Path, *, prefix: str = "") -> None:
        """Append the known warnings to `path` from now on, the ones held so far first, each
        line after `prefix` (which rank wrote it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (process-long)
        self._prefix = prefix
        held, self.held = self.held, []
        for text in held:
            self._keep(text)

    def _keep(self, text: str) -> None:
        if self._log is None:
            self.held.append(text)
        else:
            self._log.write("".join(f"{self._prefix}{line}\n" for line in text.splitlines()))
