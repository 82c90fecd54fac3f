"""The four test-only CPU shims (tests/sglang/cpu_shims): each works, and each is still
needed by the installed SGLang 0.5.23 (the day one of them is not, this test says so). The
host-register and MLA-handler shims are checked by calling SGLang's own code with the shims
otherwise in place (SGLang cannot be imported at all without the first two)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.sglang.conftest import REPO, SGLANG_PYTHON

SHIMS = REPO / "tests" / "sglang" / "cpu_shims"


def _outcomes(with_shims: bool) -> dict[str, str]:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run `bash scripts/install_sglang_cpu.sh`")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if with_shims:
        env["PYTHONPATH"] = str(SHIMS)
    result = subprocess.run(
        [str(SGLANG_PYTHON), str(REPO / "tests" / "sglang" / "shim_probe.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_with_the_shims_sglang_runs_on_a_cpu_only_torch():
    outcomes = _outcomes(with_shims=True)
    assert outcomes["torchvision_imports"].startswith("ok")
    # Request 0 -> row 2, columns 1..2; request 1 -> row 0, columns 0..2; slots in order.
    expected = [[9, 10, 11, 0, 0, 0], [0] * 6, [0, 7, 8, 0, 0, 0]]
    assert outcomes["assign_req_to_token_pool"] == f"ok: {expected}"
    assert (
        "NotImplementedError: sgl_kernel.fused_experts_cpu" in outcomes["other_kernels_fail_loudly"]
    )
    assert outcomes["pinned_host_register"] == "ok: registered"
    # Without its shim, the routed-experts buffer would be pinned through CUDA.
    assert outcomes["pinned_host_register_unpatched"].startswith("error"), outcomes
    assert "CUDA" in outcomes["pinned_host_register_unpatched"]
    assert outcomes["mla_torch_native_handler"] == "ok: _dispatch_mla_subtype"
    # SGLang itself has no MLA handler for torch_native: it falls back to triton's
    assert outcomes["mla_torch_native_handler_unpatched"] == "ok: handle_attention_triton"


def test_without_the_shims_torchvision_and_sgl_kernel_fail():
    outcomes = _outcomes(with_shims=False)
    assert "torchvision::nms does not exist" in outcomes["torchvision_imports"]
    assert "No module named 'sgl_kernel'" in outcomes["assign_req_to_token_pool"]
