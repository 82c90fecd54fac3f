"""One trainer node of a SLURM job: torchrun for this node's ranks.

    python -m megatron_rl.launch.node --nodes A,B --nproc-per-node 8 \\
        --master-addr A --master-port 29500 --graceful SIGUSR1 -- train RECIPE ...

runs as the one task per trainer node of the job's trainer step (megatron_rl.launch.slurm). Its
node rank is this node's place in `--nodes` (the job's node list), so rank 0 is on the first
node, where the rendezvous is. The graceful stop signals (the recipe's checkpoint.save_on_signals)
reach the ranks directly: SLURM signals every process of a job step. torchrun, their parent,
ignores them (its default would end it, or end the ranks before they saved), and exits with the
ranks' stop status 128 + signum, which the batch script answers by requeueing the job. Another
stop signal (scancel's SIGTERM) makes torchrun stop the ranks; this task then exits 128 + signum
with one line, where torchrun itself would exit 1 with a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from megatron_rl.process.stop import signal_number

# torchrun ends its ranks on these (torch.distributed.elastic's default list).
TORCHRUN_HANDLED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def node_rank(nodes: list[str], this_node: str) -> int:
    """The place of `this_node` in the job's trainer `nodes` (short host names compared)."""
    short = [node.split(".")[0] for node in nodes]
    name = this_node.split(".")[0]
    if name not in short:
        raise ValueError(f"--nodes: this node ({this_node}) is not among {','.join(nodes)}")
    return short.index(name)


def torchrun_argv(args: argparse.Namespace, rank: int) -> list[str]:
    """torchrun's arguments for this node: a static rendezvous on the first node."""
    return [
        f"--nnodes={len(args.nodes)}",
        f"--node-rank={rank}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--master-addr={args.master_addr}",
        f"--master-port={args.master_port}",
        "--max-restarts=0",
        "-m",
        "megatron_rl.cli",
        *args.command,
    ]


def stop_status(exit_codes: list[int], graceful: list[int]) -> int | None:
    """The ranks' graceful-stop status 128 + signum when `exit_codes` (of the ranks that
    failed) are that stop: some rank exited with it, the others with it too or ended by
    torchrun's SIGTERM to the rest; None otherwise."""
    stops = {128 + number for number in graceful}
    ended_by_torchrun = {-signal.SIGTERM, 128 + signal.SIGTERM}
    found = [code for code in exit_codes if code in stops]
    if found and all(code in stops or code in ended_by_torchrun for code in exit_codes):
        return found[0]
    return None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.node", description=__doc__)
    parser.add_argument("--nodes", required=True, type=lambda text: text.split(","))
    parser.add_argument("--nproc-per-node", required=True, type=int)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", required=True, type=int)
    parser.add_argument("--graceful", nargs="*", default=[], help="signal names, e.g. SIGUSR1")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- megatron-rl arguments")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("the megatron-rl command to run follows --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    graceful = [signal_number(name) for name in args.graceful]
    rank = node_rank(args.nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    for number in graceful:
        signal.signal(number, signal.SIG_IGN)
    # torchrun installs its own handlers at start; it must leave the graceful ones alone.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        name for name in TORCHRUN_HANDLED if signal_number(name) not in graceful
    )
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv(args, rank)))
    except SignalException as stopped:  # torchrun has stopped the ranks (SIGTERM, then SIGKILL)
        name = signal.Signals(stopped.sigval).name
        print(f"megatron-rl: node {rank}: {name}: the ranks were stopped", file=sys.stderr)
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        status = stop_status([f.exitcode for f in failed.failures.values()], graceful)
        if status is None:
            raise
        print(
            f"megatron-rl: node {rank}: the ranks stopped on "
            f"{signal.Signals(status - 128).name} after saving",
            file=sys.stderr,
        )
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
