"""A process under `StopSignals` that is signalled at one moment of its start or of a fork.

    python -m tests.process.signal_worker MOMENT SIGNAL

MOMENTs (the signal is sent to this process, or to the forked child, by the process itself):

    before-fork      in a fork hook of the parent, before the fork
    after-fork       in a fork hook of the parent, after the fork
    child-fork-hook  in a fork hook of the child, before its handlers are the child's

The hook that sends it is registered before StopSignals', as the hooks of the modules imported
before the run's (logging's) are. Prints `signalled at UNIX_TIME` to stderr, `child exit STATUS`
(as `os.waitstatus_to_exitcode` gives it) after the fork, and `not stopped` if the process goes
on for longer than the stop's watchdog takes to send the signal again.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from megatron_rl.process.stop import NUDGE_S, StopSignals


def main(moment: str, signum: int) -> None:
    def signal_self() -> None:
        print(f"signalled at {time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signum)

    hook = {"before-fork": "before", "after-fork": "after_in_parent"}.get(moment, "after_in_child")
    os.register_at_fork(**{hook: signal_self})
    with StopSignals(graceful=[signal.SIGUSR1]):
        child = os.fork()
        if child == 0:
            os._exit(0)
        _, status = os.waitpid(child, 0)
        print(f"child exit {os.waitstatus_to_exitcode(status)}", flush=True)
        time.sleep(NUDGE_S + 1.0)
    print("not stopped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(signal.Signals[sys.argv[2]]))
