"""Metrics sinks: JSONL durability and resume, console bar, a real offline wandb run, fan-out."""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import types

import pytest

from megatron_rl.trainer.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    WandbSink,
    resolve_wandb_mode,
)
from tests.processes import run_bounded
from tests.trainer.run_cli import REPO


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_are_flushed_while_open(tmp_path):
    path = tmp_path / "nested" / "dir" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"reward/mean": 0.5, "loss/policy": 1.25})
    # Read back before close: what a killed run would leave behind.
    assert _records(path) == [{"step": 1, "reward/mean": 0.5, "loss/policy": 1.25}]
    sink.log(2, {"reward/mean": 0.75, "tokens/count": 128})
    assert _records(path)[1] == {"step": 2, "reward/mean": 0.75, "tokens/count": 128}
    sink.close()


def test_jsonl_non_finite_values_are_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger([JsonlSink(path)]) as logger:
        logger.log(3, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 2.0})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    # A strict parser must accept every line.
    records = [json.loads(line, parse_constant=pytest.fail) for line in text.splitlines()]
    assert records == [{"step": 3, "a": None, "b": None, "c": None, "d": 2.0}]


def test_jsonl_rejects_a_step_metric(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        sink.log(1, {"step": 5.0})
    sink.close()


def test_jsonl_resume_truncates_and_drops_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.log(step, {"x": float(step)})
    sink.close()
    path.chmod(0o640)  # neither the umask default nor mkstemp's 0600
    with path.open("a") as handle:
        handle.write('{"step": 6, "x": 6.')  # a killed process stopped mid-line
    sink = JsonlSink(path, resume_step=3)
    assert [record["step"] for record in _records(path)] == [1, 2, 3]
    sink.log(4, {"x": 40.0})
    sink.close()
    assert [(record["step"], record["x"]) for record in _records(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    assert path.stat().st_mode & 0o777 == 0o640
    assert [entry.name for entry in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left


def test_jsonl_resume_without_file_starts_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlSink(path, resume_step=10).close()
    assert path.read_text() == ""


def test_jsonl_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\nnot json\n{"step": 3, "x": 3.0}\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2\b"):
        JsonlSink(path, resume_step=3)
    # The failed resume must leave the file as it was.
    assert path.read_text().count("\n") == 3


def test_console_shows_total_and_postfix():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=50, keys=["reward/mean", "loss/policy", "absent"], stream=stream)
    sink.log(1, {"reward/mean": 0.123456, "loss/policy": 12345.678, "time/rollout_s": 3.0})
    sink.close()
    output = stream.getvalue()
    assert "1/50" in output
    assert "reward/mean=0.1235" in output and "loss/policy=1.235e+04" in output
    assert "absent" not in output and "time/rollout_s" not in output


def test_console_resume_starts_at_start_step():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=20, keys=["reward/mean"], start_step=7, stream=stream)
    sink.log(8, {"reward/mean": 1.0})
    sink.close()
    assert "7/20" in stream.getvalue() and "8/20" in stream.getvalue()


class _RecordingSink:
    def __init__(self, name, events, close_error=None):
        self.name, self.events, self.close_error = name, events, close_error

    def log(self, step, metrics):
        self.events.append((self.name, "log", step, dict(metrics)))

    def close(self):
        self.events.append((self.name, "close"))
        if self.close_error is not None:
            raise self.close_error


def test_logger_fans_out_to_every_sink():
    events = []
    with MetricsLogger([_RecordingSink("a", events), _RecordingSink("b", events)]) as logger:
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
    assert events == [
        ("a", "log", 1, {"x": 1.0}),
        ("b", "log", 1, {"x": 1.0}),
        ("a", "log", 2, {"x": 2.0}),
        ("b", "log", 2, {"x": 2.0}),
        ("a", "close"),
        ("b", "close"),
    ]
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(3, {"x": 3.0})


def test_logger_closes_every_sink_and_raises_the_first_error():
    events = []
    first, second = OSError("disk full"), RuntimeError("network")
    sinks = [
        _RecordingSink("a", events, close_error=first),
        _RecordingSink("b", events, close_error=second),
        _RecordingSink("c", events),
    ]
    logger = MetricsLogger(sinks)
    with pytest.raises(OSError) as raised:
        logger.close()
    assert raised.value is first
    assert events == [("a", "close"), ("b", "close"), ("c", "close")]
    logger.close()  # a second close does not close the sinks again
    assert len(events) == 3


def test_logger_context_closes_sinks_when_the_body_raises():
    events = []
    with pytest.raises(KeyError), MetricsLogger([_RecordingSink("a", events)]):
        raise KeyError("training failed")
    assert events == [("a", "close")]


def test_resolve_wandb_mode():
    assert resolve_wandb_mode("auto", {}) == "offline"
    assert resolve_wandb_mode("auto", {"WANDB_API_KEY": ""}) == "offline"
    assert resolve_wandb_mode("auto", {"WANDB_API_KEY": "secret"}) == "online"
    assert resolve_wandb_mode("offline", {"WANDB_API_KEY": "secret"}) == "offline"
    assert resolve_wandb_mode("disabled", {}) == "disabled"
    with pytest.raises(ValueError, match="unknown wandb mode"):
        resolve_wandb_mode("cloud", {})


def test_wandb_init_arguments(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sink = WandbSink("proj", "run-a", tmp_path / "wb", {"lr": 1e-3}, mode="auto", resume_id="r1")
    sink.log(4, {"reward/mean": 0.5})
    sink.close()
    assert calls == [
        (
            "init",
            {
                "mode": "offline",
                "dir": tmp_path / "wb",
                "project": "proj",
                "name": "run-a",
                "config": {"lr": 1e-3},
                "id": "r1",
                "resume": "allow",
            },
        ),
        ("log", {"reward/mean": 0.5}, 4),
        ("finish",),
    ]
    assert (tmp_path / "wb").is_dir()
    WandbSink("proj", "run-b", tmp_path / "wb", {}, mode="online")
    assert calls[-1][1]["mode"] == "online" and calls[-1][1]["resume"] is None


def test_wandb_missing_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install -e \.\[wandb\].*metrics\.wandb=disabled"):
        WandbSink("proj", "run", tmp_path, {}, mode="offline")


def _wandb_records(path):
    """Decode a `.wandb` transaction log into wandb's protobuf records.

    The file is a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with
    a 7-byte header (checksum, length, type); a record spans chunks FIRST, MIDDLE..., LAST or sits
    in one FULL chunk. A block tail too short for a chunk header is zero padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, full, last = 32 * 1024, 1, 4
    records, payload, offset = [], b"", 7
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:
            offset += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        payload += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (full, last):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


# The run is written by a fresh interpreter, as the trainer's rank 0 writes it: wandb keeps
# process-wide state (its setup singleton, its service process) that an earlier test of this
# session must not be able to change.
_OFFLINE_RUN = """
import sys
from pathlib import Path
from megatron_rl.trainer.metrics import MetricsLogger, WandbSink
config = {
    "lr": 0.5,
    "rollout": {"sglang": {"env": {"HF_TOKEN": "hf_SECRET1"}, "extra_args": ["--hf-token=x2"]}},
}
logger = MetricsLogger(
    [WandbSink("megatron-rl-test", "offline", Path(sys.argv[1]), config, mode="offline")]
)
logger.log(1, {"reward/mean": 0.25, "loss/policy": 1.5})
logger.log(2, {"reward/mean": 0.75, "loss/policy": -2.0})
logger.close()
"""


def test_wandb_offline_run_writes_logged_values(tmp_path):
    pytest.importorskip("wandb")
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith("WANDB_")
    }
    # Nothing may leave the machine: a dead local port as server, no crash reports, and wandb's
    # settings, caches and data kept inside tmp_path.
    environment |= {
        "WANDB_SILENT": "true",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
    }
    with open(tmp_path / "out.txt", "w") as out:
        finished = run_bounded(
            [sys.executable, "-c", _OFFLINE_RUN, str(tmp_path / "runs")],
            timeout=240,
            cwd=REPO,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert finished.returncode == 0, (tmp_path / "out.txt").read_text()[-3000:]

    (run_dir,) = (tmp_path / "runs" / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    records = _wandb_records(log_file)
    history = {
        record.history.step.num: {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        for record in records
        if record.WhichOneof("record_type") == "history"
    }
    kinds = [record.WhichOneof("record_type") for record in records]
    assert sorted(history) == [1, 2], f"records in {log_file}: {kinds}"
    assert history[1]["reward/mean"] == 0.25 and history[1]["loss/policy"] == 1.5
    assert history[2]["reward/mean"] == 0.75 and history[2]["loss/policy"] == -2.0
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "megatron-rl-test" and run.display_name == "offline"
    assert config["lr"] == 0.5
    # secrets of the recipe (rollout.sglang.env, extra_args) are not in wandb's config
    assert config["rollout"]["sglang"] == {
        "env": {"HF_TOKEN": "[redacted]"},
        "extra_args": ["--hf-token=[redacted]"],
    }
    for path in (tmp_path / "runs").rglob("*"):
        assert not path.is_file() or b"hf_SECRET1" not in path.read_bytes(), path
    # The run ended cleanly: the log closes with an exit record.
    assert records[-1].WhichOneof("record_type") == "exit"
