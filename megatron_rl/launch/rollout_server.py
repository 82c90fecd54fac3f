"""The SGLang processes of a SLURM job's rollout nodes, as its batch script runs them
(megatron_rl.launch.slurm), each with the job's recipe and overrides:

    python -m megatron_rl.launch.rollout_server serve RECIPE [KEY=VALUE ...]
    python -m megatron_rl.launch.rollout_server route --port PORT --urls URL,... RECIPE [...]
    python -m megatron_rl.launch.rollout_server await [--router] --within S --while-running PID
        --urls URL,... RECIPE [...]

`serve`, a task of the rollout step: the recipe's server number SLURM_LOCALID on this node (port
rollout.sglang.base_port + SLURM_LOCALID), sampling from run.seed + SLURM_PROCID (the task's
number in the step), with the command line and environment the trainer uses for the servers it
starts itself (megatron_rl.rollout.sglang.servers). `route`: the sglang-router in front of the
servers, on the batch node. Both listen on their node's cluster address (the one its SLURM name
resolves to, which the trainer's nodes use in their URLs), not on every interface, and take the
run's API key (RUN_DIR/sglang_api_key, made by whichever process comes first).

`await`: until every URL answers as one of this run's servers (megatron_rl.rollout.sglang.http,
`ServerConnection.is_ours`), while process PID (the servers' job step) runs, for at most S
seconds; exit status 1 with a line saying which did not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from megatron_rl.config import load_config
from megatron_rl.process.redaction import redacted_argv
from megatron_rl.rollout.sglang.api_key import run_key
from megatron_rl.rollout.sglang.http import IDENTITY_PATH, ROUTER_IDENTITY_PATH, ServerConnection
from megatron_rl.rollout.sglang.network import listen_address
from megatron_rl.rollout.sglang.servers import KEYED_LAUNCHER, server_argv, server_environment
from megatron_rl.trainer.recipe import Recipe


def serve_argv(
    recipe: Recipe, local_index: int, job_index: int, host: str
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of this node's server `local_index`, listening on
    `host`, server `job_index` of the job's rollout servers (it samples from run.seed +
    job_index, as the trainer's own server job_index would)."""
    config = dataclasses.replace(recipe.rollout.sglang, host=host)
    argv = server_argv(
        config,
        recipe.model.hf_path,
        local_index,
        key_file=run_key(recipe.run.dir).path,
        random_seed=recipe.run.seed + job_index,
        routed_experts=recipe.algo.routing_replay.uses_engine_routing,
    )
    return argv, server_environment(config)


def route_argv(
    recipe: Recipe, host: str, port: int, urls: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The sglang-router's command line and environment: on `host`:`port`, round-robin over
    `urls`, its Prometheus metrics on 127.0.0.1:`port` + 1. It imports SGLang: it runs in the
    servers' interpreter and environment."""
    config = recipe.rollout.sglang
    argv = [
        config.python or sys.executable,
        str(KEYED_LAUNCHER),
        str(run_key(recipe.run.dir).path),
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        # The trainer sends it a request per sample, all at once; round-robin spreads them evenly.
        "--policy",
        "round_robin",
        # Its metrics exporter answers anyone (0.0.0.0:29000 unless told): this node only.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(port + 1),
        "--worker-urls",
        *urls,
    ]
    return argv, server_environment(config)


def await_servers(
    connections: list[ServerConnection], path: str, within_s: float, while_running: int
) -> str | None:
    """None once every connection's server answers as the run's; otherwise why not."""
    deadline = time.monotonic() + within_s
    waiting = list(connections)
    while waiting:
        waiting = [connection for connection in waiting if not connection.is_ours(path)]
        if not waiting:
            break
        if not _running(while_running):
            return f"{waiting[0].url}: its job step (pid {while_running}) ended before it answered"
        if time.monotonic() >= deadline:
            return (
                f"{waiting[0].url} did not answer as this run's server (GET {path}: 401 without "
                f"the run's API key, 200 with it) within {within_s:g} s"
            )
        time.sleep(1.0)
    return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.rollout_server")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve")
    route = commands.add_parser("route")
    route.add_argument("--port", type=int, required=True)
    route.add_argument("--urls", required=True, help="the servers, comma-separated")
    wait = commands.add_parser("await")
    wait.add_argument("--router", action="store_true", help="the URLs are sglang-routers")
    wait.add_argument("--within", type=float, required=True, help="seconds")
    wait.add_argument("--while-running", type=int, required=True, help="a PID")
    wait.add_argument("--urls", required=True, help="comma-separated")
    for command in commands.choices.values():
        command.add_argument("recipe")
        command.add_argument("overrides", nargs="*", help="KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    recipe = load_config(Recipe, args.recipe, args.overrides)
    if args.command == "await":
        key = run_key(recipe.run.dir)
        path = ROUTER_IDENTITY_PATH if args.router else IDENTITY_PATH
        connections = [ServerConnection(url, api_key=key) for url in args.urls.split(",")]
        problem = await_servers(connections, path, args.within, args.while_running)
        if problem is not None:
            print(f"megatron-rl: {problem}", file=sys.stderr)
            return 1
        return 0
    host = listen_address(os.environ["SLURMD_NODENAME"], given_as="SLURMD_NODENAME")
    if args.command == "serve":
        local, job = int(os.environ["SLURM_LOCALID"]), int(os.environ["SLURM_PROCID"])
        command, env = serve_argv(recipe, local, job, host)
    else:
        command, env = route_argv(recipe, host, args.port, args.urls.split(","))
    print(f"megatron-rl: {' '.join(redacted_argv(command))}", flush=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
