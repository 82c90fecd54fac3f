"""A SLURM batch script for a recipe: trainer nodes under torchrun, rollout nodes with SGLang.

`render_train_script` checks the recipe against the cluster it will run on (the layout over
nodes x GPUs, the model's split, the rollout nodes' servers) and returns the script; nothing is
submitted by this module's renderer, so `--dry-run` and the tests see exactly what `sbatch` gets.

The script, in order (docs/slurm.md):
- the NCCL and network environment, in one block to edit;
- the node list from `scontrol show hostnames`: the first `nodes` train, the rest serve rollouts;
- on the rollout nodes, one job step of SGLang servers (`megatron_rl.launch.rollout_server`),
  waited for on /health, with an sglang-router in front when there are several; their URLs are
  handed to the trainer as overrides;
- one job step on the trainer nodes, one task per node (`megatron_rl.launch.node`: torchrun for
  that node's ranks, its node rank by its place in the node list);
- preemption and time limits: SLURM sends the recipe's first `checkpoint.save_on_signals`
  signal to the batch shell (`--signal=B:...`), which passes it to the trainer's step; the
  trainer finishes its step, saves and exits 128 + signum, and the script requeues the job; a
  requeued job (SLURM_RESTART_COUNT > 0) trains with `--resume`;
- a dead trainer node: after a failed step the script tries every trainer node, and when one does
  not answer it waits for SLURM to declare that node down and requeue the job, instead of ending
  it FAILED first.
Every step and process the script starts is stopped by its PID when the script exits.
"""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_rl.files.hf_checkpoint import read_config
from megatron_rl.launch.plan import cluster_layout
from megatron_rl.models.families import family_for
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.recipe import Recipe

Device = Literal["cuda", "cpu"]
# What SLURM itself parses (#SBATCH lines cannot be quoted).
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,+-]+$")
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
# A network interface's name (Linux: up to 15 characters, no slash or space).
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_TIME_LIMIT = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2}):(\d{2})$")
# How long the trainer step's other nodes may take to end after one node's task ended (_NODE_STEP)
NODE_EXIT_WAIT_S = 30
# How long a job step of `true` on every trainer node may take to answer, after a failed step: a
# dead node's launch fails after MessageTimeout (10 s by default)
NODE_PROBE_S = 30


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """Where a recipe runs: the options of `megatron-rl launch slurm` (docs/slurm.md)."""

    nodes: int
    """Nodes that train (one torchrun each)."""
    gpus_per_node: int = 8
    """Trainer ranks per node (one per GPU; with device=cpu, processes)."""
    rollout_nodes: int = 0
    """Further nodes that only serve rollouts (SGLang); 0: the recipe's rollout.backend as it is
    (the local engine, or SGLang servers the trainer starts on its first node)."""
    partition: str | None = None
    """SLURM partition; None: the cluster's default."""
    account: str | None = None
    """SLURM account; None: the user's default."""
    time_limit: str | None = None
    """Time limit, [D-]HH:MM:SS; None: the partition's."""
    signal_before_s: int = 900
    """Seconds before the time limit at which the trainer is told to checkpoint and stop: at
    least one RL step and one checkpoint save."""
    device: Device = "cuda"
    """cuda: GPUs and NCCL; cpu: processes and gloo (a CPU cluster, or the tests)."""
    master_port: int = 29500
    """Port of the trainer's rendezvous on its first node."""
    router_port: int = 29900
    """Port of the sglang-router on the batch node (several rollout servers)."""
    python: str
    """Interpreter with megatron-rl installed, on a path every node sees."""
    workdir: str
    """Directory the job runs in (relative paths of the recipe are relative to it)."""
    resume: bool = False
    """Continue the run in run.dir from its newest checkpoint even on the job's first start."""
    network_interface: str | None = None
    """The cluster fabric's interface (e.g. ib0), where NCCL and gloo bootstrap
    (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); None: each chooses by itself."""

    def validate(self) -> None:
        if self.network_interface is not None and not _INTERFACE.match(self.network_interface):
            raise ValueError(
                f"--network-interface: {self.network_interface!r} is not an interface name "
                "(e.g. ib0, eth0)"
            )
        if self.nodes < 1:
            raise ValueError(f"--nodes: expected >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node: expected >= 1, got {self.gpus_per_node}")
        if self.rollout_nodes < 0:
            raise ValueError(f"--rollout-nodes: expected >= 0, got {self.rollout_nodes}")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not _SLURM_WORD.match(value):
                raise ValueError(f"{flag}: {value!r} is not a SLURM name (letters, digits, _.,+-)")
        if self.signal_before_s < 1:
            raise ValueError(f"--signal-before: expected >= 1 s, got {self.signal_before_s}")
        if self.time_limit is not None:
            limit_s = time_limit_seconds(self.time_limit)
            if self.signal_before_s >= limit_s:
                raise ValueError(
                    f"--signal-before: {self.signal_before_s} s is not less than --time "
                    f"{self.time_limit} ({limit_s} s): the job would be told to stop as it starts"
                )
        for flag, port in (
            ("--master-port", self.master_port),
            ("--router-port", self.router_port),
        ):
            if not 1024 <= port <= 65535:
                raise ValueError(f"{flag}: expected a port in [1024, 65535], got {port}")


def time_limit_seconds(limit: str) -> int:
    """`[D-]HH:MM:SS` in seconds; a ValueError naming --time otherwise."""
    match = _TIME_LIMIT.match(limit)
    if not match or int(match[3]) > 59 or int(match[4]) > 59:
        raise ValueError(
            f"--time: expected [D-]HH:MM:SS, e.g. 04:00:00 or 1-12:00:00, got {limit!r}"
        )
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


@dataclass(frozen=True)
class RolloutNodes:
    """SGLang servers on the job's rollout nodes: `per_node` servers of `tp_size` GPUs each."""

    nodes: int
    per_node: int
    tp_size: int
    ports: tuple[int, ...]
    startup_timeout_s: int

    @property
    def servers(self) -> int:
        return self.nodes * self.per_node


def check_layout(recipe: Recipe, job: SlurmJob, *, model_must_exist: bool) -> ParallelDims:
    """The recipe's layout over the job's trainer ranks, with the model's split checked when its
    config.json is readable (always, when `model_must_exist`)."""
    dims = cluster_layout(recipe.parallel, job.nodes, job.gpus_per_node)
    hf_path = Path(recipe.model.hf_path)
    if not hf_path.is_absolute():
        hf_path = Path(job.workdir) / hf_path
    if model_must_exist or hf_path.is_dir():
        hf_config = read_config(hf_path, given_as="model.hf_path")
        family_for(hf_config).config_from_hf(hf_config).check_split(dims)
    return dims


def plan_rollout_nodes(recipe: Recipe, job: SlurmJob) -> RolloutNodes | None:
    """The servers of `job.rollout_nodes`, checked against the recipe; None without them."""
    if job.rollout_nodes == 0:
        return None
    config = recipe.rollout.sglang
    if recipe.rollout.backend != "sglang":
        raise ValueError(
            f"--rollout-nodes {job.rollout_nodes}: the recipe's rollout.backend is "
            f"{recipe.rollout.backend}; rollout nodes serve rollout.backend=sglang"
        )
    if config.urls or config.router_url:
        raise ValueError(
            "--rollout-nodes: the recipe names its servers (rollout.sglang.urls/router_url); "
            "the job starts its own on the rollout nodes: leave those empty"
        )
    if config.weight_sync == "tensor":
        raise ValueError(
            "rollout.sglang.weight_sync=tensor shares tensors on one host; servers on rollout "
            "nodes take weight_sync=distributed (NCCL) or disk (a filesystem both see)"
        )
    if job.gpus_per_node % config.tp_size != 0:
        raise ValueError(
            f"rollout.sglang.tp_size: {config.tp_size} does not divide --gpus-per-node "
            f"{job.gpus_per_node} (each rollout node runs gpus-per-node / tp_size servers)"
        )
    per_node = job.gpus_per_node // config.tp_size
    return RolloutNodes(
        nodes=job.rollout_nodes,
        per_node=per_node,
        tp_size=config.tp_size,
        ports=tuple(config.base_port + index for index in range(per_node)),
        startup_timeout_s=int(config.startup_timeout_s),
    )


def save_signal(recipe: Recipe) -> signal.Signals:
    """The signal SLURM sends before the time limit: the recipe's first save_on_signals."""
    numbers = recipe.checkpoint.save_signal_numbers()
    if not numbers:
        raise ValueError(
            "checkpoint.save_on_signals: empty; a SLURM job needs one (e.g. [SIGUSR1]) to "
            "checkpoint before its time limit and be requeued"
        )
    return signal.Signals(numbers[0])


def render_train_script(
    recipe_path: Path,
    overrides: list[str],
    recipe: Recipe,
    job: SlurmJob,
    *,
    log_dir: Path,
) -> str:
    """The sbatch script that trains `recipe` (read from `recipe_path` with `overrides`) as
    `job`, logging to `log_dir` (which must exist before the job starts)."""
    job.validate()
    check_printable("the recipe's path", str(recipe_path))
    for override in overrides:
        check_printable("override", override)
    dims = check_layout(recipe, job, model_must_exist=False)
    rollout = plan_rollout_nodes(recipe, job)
    stop = save_signal(recipe)
    short = stop.name.removeprefix("SIG")
    graceful = " ".join(
        signal.Signals(number).name for number in recipe.checkpoint.save_signal_numbers()
    )
    rollout_header = (
        f"{rollout.nodes} node(s) x {rollout.per_node} SGLang server(s) of TP {rollout.tp_size}"
        if rollout
        else f"rollout.backend={recipe.rollout.backend}, on the trainer's nodes"
    )
    values = _common_values(job, log_dir) | {
        "@HEADER@": "\n".join(
            [
                f"# megatron-rl: {recipe_path} on SLURM, rendered by `megatron-rl launch slurm` "
                "(docs/slurm.md).",
                f"# Trainer: {dims.describe()}",
                f"# Rollout: {rollout_header}",
            ]
        ),
        "@SBATCH@": "\n".join(
            _sbatch_lines(job, job_name(recipe.run.name), log_dir, requeue_on=short)
        ),
        "@SIGNAL@": short,
        "@SIGNAL_BEFORE@": str(job.signal_before_s),
        "@STOP_CODE@": str(128 + stop.value),
        "@RESUME@": "--resume" if job.resume else "",
        # the job steps of one start: the rollout servers' (with rollout nodes), the trainer's,
        # the probe of the trainer nodes after a failed step
        "@STEPS_PER_START@": str(2 + (rollout is not None)),
        "@NODE_PROBE_S@": str(NODE_PROBE_S),
        "@STEP_NAME@": "train",
        "@GRACEFUL@": f" --graceful {graceful}" if graceful else "",
        "@COMMAND@": shlex.join(["train", str(recipe_path), *overrides])
        + ' "${rollout[@]}" "${resume[@]}"',
    }
    rollout_block = ""
    if rollout:
        values |= _rollout_values(rollout, job, recipe_path, overrides)
        rollout_block = _ROLLOUT_BLOCK + (_ROUTER_BLOCK if rollout.servers > 1 else "")
    template = _PREAMBLE + _TRAIN_BODY.replace("@ROLLOUT_BLOCK@", rollout_block)
    return _fill(template.replace("@NODE_STEP@", _NODE_STEP), values)


def render_command_script(
    command: list[str], job: SlurmJob, *, dims: ParallelDims, name: str, log_dir: Path
) -> str:
    """The sbatch script that runs the megatron-rl `command` (e.g. `convert hf-to-mcore ...`)
    on `job`'s nodes under torchrun, its ranks laid out as `dims`; not requeued."""
    job.validate()
    for word in command:
        check_printable("the command's arguments", word)
    if job.rollout_nodes:
        raise ValueError("--rollout-nodes: only a training job has rollout nodes")
    if dims.world_size != job.nodes * job.gpus_per_node:
        raise ValueError(
            f"--nodes {job.nodes} x --gpus-per-node {job.gpus_per_node} = "
            f"{job.nodes * job.gpus_per_node} ranks, but the layout ({dims.describe()}) is for "
            f"{dims.world_size}"
        )
    values = _common_values(job, log_dir) | {
        "@HEADER@": f"# megatron-rl {command[0]} on SLURM, rendered by `megatron-rl launch "
        f"slurm-{command[0]}` (docs/slurm.md).\n# Ranks: {dims.describe()}",
        "@SBATCH@": "\n".join(_sbatch_lines(job, job_name(name), log_dir, requeue_on=None)),
        "@STEP_NAME@": command[0],
        "@GRACEFUL@": "",
        "@COMMAND@": shlex.join(command),
    }
    return _fill(_PREAMBLE + _COMMAND_BODY.replace("@NODE_STEP@", _NODE_STEP), values)


def check_printable(what: str, text: str) -> None:
    """Refuse `text` (`what`, e.g. an override) holding a control character (a newline, a tab,
    an escape): in a batch script it would start a line of its own, a command."""
    for character in text:
        if ord(character) < 32 or ord(character) == 127:
            raise ValueError(
                f"{what}: {text!r} holds the control character {character!r}; a batch script "
                "cannot carry it"
            )


def job_name(text: str) -> str:
    """`text` as a SLURM job name: every character but letters, digits and `_.-` becomes `-`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text) or "megatron-rl"


def _common_values(job: SlurmJob, log_dir: Path) -> dict[str, str]:
    if not _SLURM_WORD.match(str(log_dir).replace("/", "")):
        raise ValueError(f"{log_dir}: has characters an #SBATCH line cannot carry")
    for flag, value in (("--python", job.python), ("the working directory", job.workdir)):
        check_printable(flag, value)
    return {
        "@THREADS_PER_RANK@": str(job.gpus_per_node),
        "@WORKDIR@": shlex.quote(job.workdir),
        "@PYTHON@": shlex.quote(job.python),
        "@LOG_DIR@": shlex.quote(str(log_dir)),
        "@NETWORK@": _network_lines(job.network_interface),
        "@TOTAL_NODES@": str(job.nodes + job.rollout_nodes),
        "@TRAINER_NODES@": str(job.nodes),
        "@MASTER_PORT@": str(job.master_port),
        "@GPUS@": str(job.gpus_per_node),
        "@NODE_EXIT_WAIT_S@": str(NODE_EXIT_WAIT_S),
    }


def _network_lines(interface: str | None) -> str:
    if interface is None:
        return (
            "# The interface NCCL and gloo bootstrap on (--network-interface); unset, each\n"
            "# chooses by itself.\n"
            "# export NCCL_SOCKET_IFNAME=ib0\n"
            "# export GLOO_SOCKET_IFNAME=ib0"
        )
    return (
        "# The interface NCCL and gloo bootstrap on (--network-interface).\n"
        f"export NCCL_SOCKET_IFNAME={interface}\n"
        f"export GLOO_SOCKET_IFNAME={interface}"
    )


def _fill(template: str, values: dict[str, str]) -> str:
    """Every `@NAME@` of `template` replaced by its value, in one pass over the template only: a
    value is never read for placeholders itself."""

    def value(match: re.Match[str]) -> str:
        if match[0] not in values:
            raise KeyError(f"batch script template: no value for {match[0]}")
        return values[match[0]]

    return _PLACEHOLDER.sub(value, template)


def _sbatch_lines(job: SlurmJob, name: str, log_dir: Path, *, requeue_on: str | None) -> list[str]:
    """The #SBATCH lines; with `requeue_on` (a signal name) the job is told to stop by it before
    its time limit and may requeue itself."""
    options = [
        f"--job-name={name}",
        f"--nodes={job.nodes + job.rollout_nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
    ]
    if job.device == "cuda":
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    options += [f"--partition={job.partition}"] if job.partition else []
    options += [f"--account={job.account}"] if job.account else []
    options += [f"--time={job.time_limit}"] if job.time_limit else []
    if requeue_on:
        options += [f"--signal=B:{requeue_on}@{job.signal_before_s}", "--requeue"]
    options += ["--open-mode=append", f"--output={log_dir}/%x-%j.out"]
    return [f"#SBATCH {option}" for option in options]


def _rollout_values(
    rollout: RolloutNodes, job: SlurmJob, recipe_path: Path, overrides: list[str]
) -> dict[str, str]:
    return {
        "@ROLLOUT_NODES@": str(rollout.nodes),
        "@PER_NODE@": str(rollout.per_node),
        "@SERVERS@": str(rollout.servers),
        "@GPUS_PER_TASK@": f" --gpus-per-task={rollout.tp_size}" if job.device == "cuda" else "",
        "@SERVE_ARGS@": shlex.join([str(recipe_path), *overrides]),
        "@PORTS@": " ".join(map(str, rollout.ports)),
        "@STARTUP_S@": str(rollout.startup_timeout_s),
        "@ROUTER_PORT@": str(job.router_port),
    }


_PREAMBLE = """\
#!/bin/bash
@HEADER@
@SBATCH@
set -euo pipefail

# ---- Where megatron-rl runs: the checkout it was submitted from and that checkout's Python -------
# Rendered from the submitting shell; the job's environment overrides them
# (sbatch --export=ALL,MEGATRON_RL_DIR=DIR,MEGATRON_RL_PYTHON=DIR/.venv/bin/python), or edit here.
workdir=${MEGATRON_RL_DIR:-@WORKDIR@}
python=${MEGATRON_RL_PYTHON:-@PYTHON@}

# ---- Network and NCCL: edit for your cluster ----------------------------------------------------
@NETWORK@
# The InfiniBand adapters NCCL uses (`ibv_devinfo` lists them); unset, NCCL chooses by itself.
# export NCCL_IB_HCA=mlx5
# NCCL's messages (INFO shows the rings and transports when a start-up hangs).
export NCCL_DEBUG=WARN
# A failed collective raises instead of hanging until the timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# Megatron-Core orders its tensor-parallel communication on one CUDA connection per device.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# CPU threads per trainer rank: the node's cores shared by its ranks.
threads=$((SLURM_CPUS_ON_NODE / @THREADS_PER_RANK@))
export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
# --------------------------------------------------------------------------------------------------

cd "$workdir"
log_dir=@LOG_DIR@
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${#nodes[@]}" -ne @TOTAL_NODES@ ]; then
  echo "megatron-rl: job $SLURM_JOB_ID has ${#nodes[@]} nodes; this script is for @TOTAL_NODES@" >&2
  exit 1
fi
trainer_nodes=("${nodes[@]:0:@TRAINER_NODES@}")
trainer_list=$(IFS=,; echo "${trainer_nodes[*]}")
master_addr=${trainer_nodes[0]}
master_port=@MASTER_PORT@

# The job steps and processes this script starts, stopped by PID when it exits.
started=()
# shellcheck disable=SC2317  # called by the trap below
stop_started() {
  local pid
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_started EXIT
"""

_TRAIN_BODY = """
# SLURM sends SIG@SIGNAL@ to this shell @SIGNAL_BEFORE@ s before the time limit; the trainer's step
# gets it from here, finishes its RL step, saves a checkpoint and exits @STOP_CODE@.
trainer=""
signals=0
# shellcheck disable=SC2317  # called by the trap below
pass_stop_to_trainer() {
  signals=$((signals + 1))
  if [ -n "$trainer" ]; then kill -@SIGNAL@ "$trainer" 2>/dev/null || true; fi
}
trap pass_stop_to_trainer @SIGNAL@

# A requeued job numbers its job steps from 0 again, and SLURM may still deliver a signal it
# queued for a step of an earlier start whose node had died, once that node is back (seen: the
# kill srun sends the dead node's task, re-sent ~70 s later): the step of that number in this
# start would die of it. Each start k first spends the numbers the earlier starts used (k x
# @STEPS_PER_START@ steps that do nothing), so that no two starts share a step number.
for ((spent = 0; spent < ${SLURM_RESTART_COUNT:-0} * @STEPS_PER_START@; spent++)); do
  srun --nodes=1 --ntasks=1 --nodelist="${nodes[0]}" --output=/dev/null true
done

# SLURM may take a node out of a running job without declaring it down: a node that died and came
# back can get the stop SLURM queued for the job's earlier start after this start began (seen on
# the test cluster, 2026-12-07), which ends this start's task there and releases the node. No
# verdict follows and the job cannot go on without the node: it requeues itself.
requeued_for_a_node_taken_out() {
  local job held members node
  job=$(scontrol show job --oneliner "$SLURM_JOB_ID") || return 1
  # a job SLURM has requeued already is no longer RUNNING (and this script is being stopped)
  if [[ $job != *" JobState=RUNNING "* ]]; then return 1; fi
  held=$(grep -o ' NodeList=[^ ]*' <<<"$job" | cut -d= -f2) || true
  members=$(scontrol show hostnames "$held" 2>/dev/null) || true
  for node in "${trainer_nodes[@]}"; do
    if ! grep -qx "$node" <<<"$members"; then
      echo "megatron-rl: SLURM took trainer node $node out of job $SLURM_JOB_ID (it holds" \\
        "${held:-none}); requeueing it" >&2
      scontrol requeue "$SLURM_JOB_ID"
      return 0
    fi
  done
  return 1
}

# A trainer node that dies (power, kernel, network) fails the step on every node. SLURM requeues
# the job once it declares that node down (SlurmdTimeout after its last answer; 300 s by default),
# but only while this script still runs, and srun gives up on the dead node's task about a minute
# after the other nodes' tasks ended (--wait, then KillWait). So after a failed step, a job step
# of `true` on every trainer node (sharing the failed step's CPUs, which SLURM holds until the dead
# node answers): when it does not run, a node died, and this script waits for SLURM's verdict,
# which requeues the job and stops the script. A step that failed on nodes that all answer fails
# the job at once.
await_requeue_if_a_node_died() {
  if timeout @NODE_PROBE_S@ srun --overlap --nodes=@TRAINER_NODES@ --ntasks=@TRAINER_NODES@ \\
    --ntasks-per-node=1 --nodelist="$trainer_list" --output=/dev/null true; then
    return
  fi
  if requeued_for_a_node_taken_out; then return; fi
  local silent_s
  silent_s=$(scontrol show config | awk '$1 == "SlurmdTimeout" {print $3}')
  if ! [ "${silent_s:-0}" -gt 0 ] 2>/dev/null; then
    echo "megatron-rl: a trainer node does not answer, and this cluster declares no node down" \\
      "(SlurmdTimeout=${silent_s:-?}); resubmit with --resume once it is back" >&2
    return
  fi
  # SLURM looks at its nodes every third of SlurmdTimeout
  local wait_s=$((silent_s + silent_s / 3 + @NODE_PROBE_S@))
  echo "megatron-rl: a trainer node does not answer; waiting up to $wait_s s for SLURM to" \\
    "declare it down and requeue job $SLURM_JOB_ID" >&2
  sleep "$wait_s" &
  started+=("$!")
  wait "$!" || true
  echo "megatron-rl: SLURM did not requeue job $SLURM_JOB_ID within $wait_s s" >&2
}

rollout=()
@ROLLOUT_BLOCK@
resume=(@RESUME@)
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume); fi
if [ "$signals" -gt 0 ]; then
  echo "megatron-rl: SIG@SIGNAL@ before the trainer started; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi

echo "megatron-rl: job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}: training on $trainer_list"
@NODE_STEP@ &
trainer=$!
started+=("$trainer")

# `wait` returns early when a trapped signal arrives: wait again for the step's own status
# (127: the wait before had already collected it).
status=""
while :; do
  before=$signals
  code=0
  wait "$trainer" || code=$?
  if [ -z "$status" ] || [ "$code" -ne 127 ]; then status=$code; fi
  if [ "$signals" -eq "$before" ] || [ "$code" -eq 127 ]; then break; fi
done
if [ "$status" -eq @STOP_CODE@ ]; then
  echo "megatron-rl: the trainer saved a checkpoint on SIG@SIGNAL@; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
elif [ "$status" -ne 0 ]; then
  await_requeue_if_a_node_died
fi
exit "$status"
"""

_COMMAND_BODY = """
echo "megatron-rl: job $SLURM_JOB_ID on $trainer_list"
@NODE_STEP@
"""

# One job step on the trainer nodes: megatron_rl.launch.node (torchrun) on each. When one node's
# task ends, the others get NODE_EXIT_WAIT_S to end too before srun stops them: after a graceful
# stop every node exits 128 + signum within moments of the others, and a node's exit must not
# stop the next one between its save and its own exit (--kill-on-bad-exit would: the step's
# status would then be the stopped node's, not the graceful one the batch script requeues on);
# after a crash the rest is stopped within that time.
_NODE_STEP = """\
srun --nodes=@TRAINER_NODES@ --ntasks=@TRAINER_NODES@ --ntasks-per-node=1 \\
  --nodelist="$trainer_list" --cpus-per-task="$SLURM_CPUS_ON_NODE" --wait=@NODE_EXIT_WAIT_S@ \\
  --output="$log_dir/%x-%j-@STEP_NAME@-%N.out" --open-mode=append \\
  "$python" -m megatron_rl.launch.node --nodes "$trainer_list" --nproc-per-node @GPUS@ \\
  --master-addr "$master_addr" --master-port "$master_port"@GRACEFUL@ -- \\
  @COMMAND@"""

_ROLLOUT_BLOCK = """\
# ---- Rollout: @PER_NODE@ SGLang server(s) on each of the @ROLLOUT_NODES@ rollout node(s) ----
# Each listens on its node's cluster address and takes the run's API key (RUN_DIR/sglang_api_key,
# never on a command line); the trainer's requests carry it (docs/sglang.md).
rollout_nodes=("${nodes[@]:@TRAINER_NODES@:@ROLLOUT_NODES@}")
# --ntasks: the job's own count (every node's task) would reach this step from its environment
srun --nodes=@ROLLOUT_NODES@ --ntasks=@SERVERS@ --ntasks-per-node=@PER_NODE@@GPUS_PER_TASK@ \\
  --nodelist="$(IFS=,; echo "${rollout_nodes[*]}")" \\
  --output="$log_dir/%x-%j-rollout-%N-%t.out" --open-mode=append \\
  "$python" -m megatron_rl.launch.rollout_server serve @SERVE_ARGS@ &
servers=$!
started+=("$servers")
urls=()
for node in "${rollout_nodes[@]}"; do
  for port in @PORTS@; do urls+=("http://$node:$port"); done
done
url_list=$(IFS=,; echo "${urls[*]}")
# Until every server answers as this run's (its API key), while their step runs.
if ! "$python" -m megatron_rl.launch.rollout_server await --within @STARTUP_S@ \\
  --while-running "$servers" --urls "$url_list" @SERVE_ARGS@; then
  echo "megatron-rl: the rollout servers did not start; logs in $log_dir" >&2
  exit 1
fi
rollout=(
  "rollout.sglang.urls=[$url_list]"
  "rollout.sglang.master_address=$master_addr"
)
"""

_ROUTER_BLOCK = """\
# One sglang-router in front of the servers, on this (the batch) node; generation goes through it.
router_url="http://$SLURMD_NODENAME:@ROUTER_PORT@"
"$python" -m megatron_rl.launch.rollout_server route --port @ROUTER_PORT@ --urls "$url_list" \\
  @SERVE_ARGS@ >>"$log_dir/router-$SLURM_JOB_ID.out" 2>&1 &
started+=("$!")
if ! "$python" -m megatron_rl.launch.rollout_server await --router --within @STARTUP_S@ \\
  --while-running "$!" --urls "$router_url" @SERVE_ARGS@; then
  echo "megatron-rl: the sglang-router did not start; see $log_dir/router-$SLURM_JOB_ID.out" >&2
  exit 1
fi
rollout+=("rollout.sglang.router_url=$router_url")
"""
