"""A server killed mid-run: the engine restarts it from the latest weights on disk, or, when
there are none, stops with an error that says what happened and what to do."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SGLangEngine, SGLangError, make_weight_sync
from tests.processes import group_gone
from tests.sglang.conftest import TINY_MODEL, tiny_tensor_shapes
from tests.sglang.test_weight_sync import PROBE, _perturbed_buckets


def test_a_killed_server_is_restarted_from_the_latest_weights_or_reported(
    sglang_servers, base_weights, tmp_path
):
    def engine(method: str) -> SGLangEngine:
        sync = make_weight_sync(method, tp_sizes=[1], directory=tmp_path, hf_dir=TINY_MODEL)
        return SGLangEngine(
            sglang_servers.urls, sync, managed=sglang_servers, tensor_shapes=tiny_tensor_shapes()
        )

    from_disk, from_memory = engine("disk"), engine("tensor")
    buckets = _perturbed_buckets(21)
    from_memory.update_weights(buckets, 1)
    from_disk.update_weights(buckets, 1)  # the server now holds version 1, also kept on disk
    reference = LocalEngine.from_pretrained(TINY_MODEL)
    reference.update_weights(buckets, 1)
    server = sglang_servers.servers[0]
    killed = server.process.pid
    os.killpg(killed, signal.SIGKILL)
    server.process.wait()
    params = SamplingParams(max_new_tokens=3)

    # Tensor sync keeps no copy a server could restart from: a clear error, no silent fall-back.
    with pytest.raises(SGLangError, match=r"died \(exit code -9; log .*sglang_0\.log\).*version 1"):
        from_memory.generate([[3, 4, 5]], params)
    assert not server.alive()

    # Disk sync: restarted from the latest weight directory, tagged with its version.
    samples = from_disk.generate([[3, 4, 5]], params, n=2)
    assert [len(group) for group in samples] == [2]
    assert server.alive() and server.process.pid != killed and server.starts == 2
    assert server.connection.get("/model_info")["weight_version"] == "1"
    assert torch.allclose(from_disk.score([PROBE])[0], reference.score([PROBE])[0], atol=1e-4)
    assert group_gone(killed)  # none of the killed server's processes is left
    from_disk.close()
