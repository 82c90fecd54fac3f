"""SGLang server processes that the trainer starts, watches and stops.

Each server is `python -m sglang.launch_server` in a session of its own, logging to
`<log_dir>/sglang_<i>.log`, started through `launch_with_key.py` with the run's API key (off its
command line, redacted from its log), and ready once it answers as the run's own (`is_ours`).
Stopping signals that session's process group by the PID this manager recorded (SGLang's
scheduler and detokenizer are child processes), never by name.
A server that died can be started again with the same arguments, optionally from another
model directory (the latest weights on disk).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.process import children
from megatron_rl.process.redaction import redacted_argv
from megatron_rl.process.supervise import supervised_command
from megatron_rl.rollout.sglang.api_key import ApiKey
from megatron_rl.rollout.sglang.config import SGLangConfig
from megatron_rl.rollout.sglang.http import (
    IDENTITY_PATH,
    RetryPolicy,
    ServerConnection,
    SGLangError,
)

# Run by SGLang's interpreter, by path: it imports nothing of megatron-rl.
KEYED_LAUNCHER = Path(__file__).with_name("launch_with_key.py")

# What torchrun (torch.distributed.run) tells its workers. A server started by a worker must not
# see them: SGLang initialises torch.distributed from the environment and would try to join the
# trainer's job instead of starting its own.
LAUNCHER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)

# SGLang returns the log-probs of the temperature-scaled distribution unless this is set; the
# trainer's log-probs are those of the model's own distribution (temperature 1).
ORIGINAL_LOGPROBS_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def server_argv(
    config: SGLangConfig,
    model_path: str,
    index: int,
    *,
    key_file: Path,
    random_seed: int,
    routed_experts: bool = False,
) -> list[str]:
    """The command line of server `index` of `config`, serving the checkpoint at `model_path`
    with the API key in `key_file`; `random_seed` seeds its sampler (SGLang draws a random one
    otherwise, and a run's samples would differ from start to start); `routed_experts` has it
    return each token's experts (R3)."""
    args = [
        config.python or sys.executable,
        str(KEYED_LAUNCHER),
        str(key_file),
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        config.host,
        "--port",
        str(config.base_port + index),
        "--tp-size",
        str(config.tp_size),
        "--ep-size",
        str(config.ep_size),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--dtype",
        config.dtype,
        # The trainer sends token ids and reads token ids; no text on either side.
        "--skip-tokenizer-init",
        # Servers are idle while the trainer trains; without this the scheduler's event
        # loop spins and takes a core from it.
        "--sleep-on-idle",
        "--random-seed",
        str(random_seed),
    ]
    if routed_experts:
        args.append("--enable-return-routed-experts")
    return args + list(config.extra_args)


def server_environment(config: SGLangConfig) -> dict[str, str]:
    """A server's environment: this process's, less the launcher's variables, with the
    recipe's `env` and the one that makes SGLang's log-probs comparable with the trainer's."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith("TORCHELASTIC_")
    }
    return inherited | config.env | ORIGINAL_LOGPROBS_ENV


class ManagedServer:
    """One server process; see the module docstring."""

    def __init__(
        self,
        config: SGLangConfig,
        model_path: str,
        index: int,
        log_dir: Path,
        *,
        api_key: ApiKey,
        random_seed: int,
        routed_experts: bool = False,
    ) -> None:
        self.config, self.model_path, self.index = config, model_path, index
        self.api_key = api_key
        self.random_seed = random_seed
        self.routed_experts = routed_experts
        self.url = f"http://{config.host}:{config.base_port + index}"
        self.log_path = Path(log_dir) / f"sglang_{index}.log"
        self.connection = ServerConnection(
            self.url,
            RetryPolicy(deadline_s=config.request_deadline_s),
            api_key=api_key,
            alive=self.alive,
        )
        self.process: subprocess.Popen | None = None
        self._lifeline = -1  # the write end of the supervisor's pipe while a process runs
        self.starts = 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, model_path: str | None = None) -> None:
        """Launch the process (returns at once; see `wait_ready`)."""
        if self.alive():
            raise RuntimeError(f"{self.url}: already running (pid {self.process.pid})")
        if self.connection.ping():
            raise SGLangError(
                f"{self.url}: something already answers on this port; choose another "
                "rollout.sglang.base_port, or give its url in rollout.sglang.urls to use it"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_environment(self.config)
        argv = server_argv(
            self.config,
            model_path or self.model_path,
            self.index,
            key_file=self.api_key.path,
            random_seed=self.random_seed,
            routed_experts=self.routed_experts,
        )
        # The server's group is stopped when this process dies, whatever kills it
        # (megatron_rl.process.supervise): the pipe's read end goes to the supervisor.
        watched, self._lifeline = os.pipe()
        with open(self.log_path, "ab") as log:
            command = " ".join(redacted_argv(argv))
            log.write(f"\n=== start {self.starts + 1}: {command}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    supervised_command(argv, watched),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    pass_fds=(watched,),
                )
            except BaseException:
                os.close(self._lifeline)
                raise
            finally:
                os.close(watched)
            children.started_group(self.process.pid)
            log.write(f"=== pid {self.process.pid}\n".encode())
        self.starts += 1

    def wait_ready(self) -> None:
        """Until the server answers as this run's (`ServerConnection.is_ours`); an error (with
        the log's tail) when the process exits or the start-up deadline passes."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = None if self.process is None else self.process.returncode
                raise SGLangError(
                    f"SGLang server {self.url} exited during start-up (exit code {code}); "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            if self.connection.is_ours():
                return
            time.sleep(1.0)
        self.stop()
        raise SGLangError(
            f"SGLang server {self.url} did not answer as this run's server (GET "
            f"{IDENTITY_PATH}: 401 without its API key, 200 with it) within "
            f"{self.config.startup_timeout_s:g} s (rollout.sglang.startup_timeout_s); its log "
            f"{self.log_path} ends with:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
        if self.process is None:
            return
        pid = self.process.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The launcher is gone; its children may linger in the group a moment longer.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            break
        children.stopped_group(pid)
        os.close(self._lifeline)
        self.process = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ServerGroup:
    """The trainer's SGLang servers: started together, stopped together (a context manager).
    Server i samples from `seed + i` (the run's seed: a run repeats its samples); all take
    `api_key`."""

    def __init__(
        self,
        config: SGLangConfig,
        model_path: str,
        log_dir: str | Path,
        *,
        api_key: ApiKey,
        seed: int,
        routed_experts: bool = False,
    ) -> None:
        if config.num_servers < 1:
            raise ValueError(f"num_servers: expected >= 1, got {config.num_servers}")
        self.servers = [
            ManagedServer(
                config,
                model_path,
                index,
                Path(log_dir),
                api_key=api_key,
                random_seed=seed + index,
                routed_experts=routed_experts,
            )
            for index in range(config.num_servers)
        ]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def start(self) -> ServerGroup:
        """Start every server, then wait for all of them (they load in parallel)."""
        try:
            for server in self.servers:
                server.start()
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, index: int, model_path: str | None = None) -> None:
        """Start server `index` again (it died), from `model_path` if given."""
        server = self.servers[index]
        server.stop()
        server.start(model_path)
        server.wait_ready()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
