"""How the test command's two pytest-xdist workers share the suite (scripts/test.sh, `-n 2`).

Each test module runs whole on one worker, so that its module fixtures are built once. The
modules that start servers on fixed ports run on one worker, one after another: the example
recipe's SGLang server on 30100 (two at once: the second's own warm-up reached the first and got
a 401), the SGLang tier's on 30700 (tests/sglang/conftest.py), the SLURM test clusters with
their jobs' rendezvous and router ports, and the two-rank SGLang run that tests/sglang and
tests/launch share (tests/conftest.py). Being the largest unit of work, they start first.

xdist's own `--dist loadgroup` would do this with `xdist_group` marks, but with pytest 9 the
mark is lost: xdist 3.8 renames the item through `Item._nodeid`, which pytest 9 no longer reads
(measured 2026-12-07: the marked tests of one group ran on both workers). Scheduling by the
test's path needs no mark.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

SERVER_TESTS = (
    "tests/launch/",
    "tests/sglang/",
    "tests/process/test_redaction.py",
    "tests/bench/test_rl_step_bench.py",  # its SGLang arm runs the example recipe
)
SERVER_UNIT = "servers"


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's path, or `SERVER_UNIT`."""
    path = nodeid.split("::", 1)[0]
    return SERVER_UNIT if path.startswith(SERVER_TESTS) else path


class ModulesAndServers(LoadScopeScheduling):
    """xdist's scheduling by scope, with `work_unit` as the scope (largest units first)."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
