"""Weight sync into a real SGLang server, by each of the three methods: after the sync the
server's log-probs are those of the new weights, its weight version is recorded, and a
mismatched update is refused before anything reaches the server."""

from __future__ import annotations

import psutil
import pytest
import torch

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SYNC_METHODS, SGLangEngine, SGLangError, make_weight_sync
from megatron_rl.rollout.sglang.weight_sync import DistributedSync
from tests.sglang.conftest import TINY_MODEL, tiny_tensor_shapes

PROBE = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


def _perturbed_buckets(seed: int, bucket_tensors: int = 7) -> list[list[tuple[str, torch.Tensor]]]:
    """The tiny model's tensors plus noise, in buckets of `bucket_tensors` tensors."""
    checkpoint = HFCheckpoint(TINY_MODEL)
    generator = torch.Generator().manual_seed(seed)
    named = []
    for name in sorted(checkpoint.names()):
        tensor = checkpoint.tensor(name).clone()
        tensor += 0.05 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        named.append((name, tensor))
    checkpoint.close()
    return [named[i : i + bucket_tensors] for i in range(0, len(named), bucket_tensors)]


def _engine(sglang_servers, method, tmp_path) -> SGLangEngine:
    sync = make_weight_sync(method, tp_sizes=[1], directory=tmp_path, hf_dir=TINY_MODEL)
    return SGLangEngine(
        sglang_servers.urls,
        sync,
        managed=sglang_servers,
        tensor_shapes=tiny_tensor_shapes(),
    )


@pytest.mark.parametrize("method", SYNC_METHODS)
def test_after_a_sync_the_server_computes_with_the_new_weights(
    sglang_servers, base_weights, tmp_path, method
):
    engine = _engine(sglang_servers, method, tmp_path)
    reference = LocalEngine.from_pretrained(TINY_MODEL)
    try:
        for version, seed in ((1, 11), (2, 12)):  # the second sync reuses what the first set up
            buckets = _perturbed_buckets(seed)
            reference.update_weights(buckets, version)
            expected = reference.score([PROBE])[0]
            assert (engine.score([PROBE])[0] - expected).abs().max() > 1e-3  # not there yet
            engine.update_weights(buckets, version)
            assert torch.allclose(engine.score([PROBE])[0], expected, atol=1e-4)
            assert engine.weight_version == version
            served = sglang_servers.servers[0].connection.get("/model_info")["weight_version"]
            assert served == str(version)
        if method == "distributed":
            _check_the_weight_store_is_the_runs_own(engine.weight_sync)
    finally:
        engine.close()
    if method == "disk":
        assert not list(tmp_path.iterdir())  # close() removed the weight directory


def _check_the_weight_store_is_the_runs_own(sync: DistributedSync) -> None:
    """torch's store has no authentication: it listens on the servers' address for the trainer
    only (127.0.0.1 here), not on every interface, under a group name of its own."""
    port = sync._store.port
    listening = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening == ["127.0.0.1"]
    other = make_weight_sync("distributed", tp_sizes=[1], directory=".", hf_dir=TINY_MODEL)
    assert sync.group_name.startswith("megatron_rl_weights_")
    assert other.group_name != sync.group_name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b[0].append(("model.layers.0.bogus.weight", torch.zeros(2))), "no such tensor"),
        (lambda b: b.__setitem__(-1, [(b[-1][0][0], torch.zeros(3, 3))]), "has shape \\[3, 3\\]"),
        (lambda b: b.pop(), "are not in the update"),
    ],
    ids=["unknown_name", "wrong_shape", "missing_tensors"],
)
def test_an_update_that_does_not_fit_the_served_model_is_refused(
    sglang_servers, base_weights, tmp_path, change, message
):
    engine = _engine(sglang_servers, "tensor", tmp_path)
    buckets = _perturbed_buckets(13)
    change(buckets)
    url = sglang_servers.urls[0]
    with pytest.raises(
        SGLangError, match=rf"weight update 5 to SGLang server\(s\) {url}: .*{message}"
    ):
        engine.update_weights(buckets, 5)
    assert sglang_servers.servers[0].alive()  # nothing that could crash it was sent
    with pytest.raises(SGLangError, match="did not complete; refusing to generate"):
        engine.score([PROBE])
