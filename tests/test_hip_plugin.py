"""The HIP backend registers through its entry point, offers every op the CUDA backend does, and without ROCm
reports why it cannot run: nothing imports hip-python's libraries, nothing crashes, torch's backend serves."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from lucebox_core.plugins import registry

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lucebox_hip") is None, reason="lucebox-hip is not installed")


# hip-python is lucebox-hip's dependency (CI has it); a machine with the package installed without its
# dependencies (the GPU machine's --no-deps install) stops the probe there, before the checks below.
needs_hip_python = pytest.mark.skipif(importlib.util.find_spec("hip") is None, reason="hip-python is not installed")


def _backend(name: str):
    [spec] = [backend for backend in registry().kernel_backends() if backend.name == name]
    return spec


def test_plugins_command_lists_it_unavailable_with_every_cuda_op():
    result = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "plugins", "--json"], capture_output=True,
                            text=True, check=True)
    plugins = {plugin["name"]: plugin for plugin in json.loads(result.stdout)}
    hip = plugins["hip"]
    assert hip["distribution"] == "lucebox-hip" and hip["module"] == "lucebox_hip.plugin"
    [backend] = [item for item in hip["provides"] if item["kind"] == "backend"]
    assert backend["name"] == "hip" and backend["available"] is False
    if importlib.util.find_spec("hip") is None:
        assert "hip-python is not installed" in backend["reason"]
    elif not getattr(torch.version, "hip", None):
        assert "not a ROCm build" in backend["reason"] and torch.__version__ in backend["reason"]
    hip_ops = {item["name"].removeprefix("hip.") for item in hip["provides"] if item["kind"] == "kernel"}
    cuda_ops = {item["name"].removeprefix("cuda.") for item in plugins["cuda"]["provides"] if item["kind"] == "kernel"}
    assert hip_ops == cuda_ops and len(hip_ops) > 20
    # Listing never loaded ROCm's libraries (they are not here; a load would have failed the command).
    assert "hiprtc" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_registry_falls_back_to_torch():
    assert registry().kernel_backend().name == "torch"
    assert _backend("hip").priority > _backend("torch").priority


@needs_hip_python
def test_a_rocm_torch_without_a_device_is_named(monkeypatch):
    from lucebox_cuda import plugin as cuda_plugin
    from lucebox_hip import plugin

    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    available, reason = plugin.availability()
    assert not available and "no AMD GPU visible" in reason and "HIP 6.4.43482" in reason
    # The CUDA backend steps aside on a ROCm build, whatever torch.cuda says, so the two never compete.
    available, reason = cuda_plugin.availability()
    assert not available and "ROCm" in reason


@needs_hip_python
def test_an_unchecked_target_is_refused_unless_asked(monkeypatch):
    from lucebox_hip import backend, hiprtc, plugin

    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "AMD Instinct MI210")
    monkeypatch.setattr(backend, "device_target", lambda device: "gfx90a")
    available, reason = plugin.availability()
    assert not available and "gfx90a" in reason and "LUCEBOX_HIP_ANY_TARGET=1" in reason
    # Asked to run anyway, the next check is hiprtc itself, which is absent here: named, not raised.
    monkeypatch.setenv("LUCEBOX_HIP_ANY_TARGET", "1")
    hiprtc.hiprtc_version.cache_clear()
    available, reason = plugin.availability()
    assert not available and reason.startswith("hiprtc cannot be loaded")
    # An RDNA target goes as far as hiprtc too, without the variable.
    monkeypatch.delenv("LUCEBOX_HIP_ANY_TARGET")
    monkeypatch.setattr(backend, "device_target", lambda device: "gfx1151")
    available, reason = plugin.availability()
    assert not available and reason.startswith("hiprtc cannot be loaded")


def test_reason_names_missing_hip_python(monkeypatch):
    from lucebox_hip import plugin

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "hip" else real_find_spec(name, *args))
    available, reason = plugin.availability()
    assert not available and "hip-python is not installed" in reason


def test_backend_refuses_a_torch_without_rocm():
    from lucebox_core.errors import LuceboxError
    from lucebox_hip.backend import HipBackend

    if getattr(torch.version, "hip", None):
        pytest.skip("torch is a ROCm build here")
    with pytest.raises(LuceboxError, match="needs a ROCm build of torch"):
        HipBackend()


def test_triton_kernels_follow_the_switch(monkeypatch):
    from lucebox_core.torch_backend import TorchBackend
    from lucebox_cuda import op_kernels as cuda_kernels
    from lucebox_hip import op_kernels

    ops = TorchBackend("cpu", torch.float32)
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    expected = cuda_kernels.accepts_silu_mul(ops, gate, up)
    monkeypatch.delenv("LUCEBOX_HIP_TRITON", raising=False)
    assert op_kernels.accepts_silu_mul(ops, gate, up) == expected
    assert op_kernels.accepts_silu_mul(ops, gate, up.double()) == cuda_kernels.accepts_silu_mul(ops, gate, up.double())
    monkeypatch.setenv("LUCEBOX_HIP_TRITON", "0")
    assert op_kernels.accepts_silu_mul(ops, gate, up) is False
    with pytest.raises(AttributeError):
        op_kernels.accepts_no_such_op  # noqa: B018


def test_shared_source_ops_take_the_cuda_checks_as_they_are():
    records = {record.op: record for record in registry().op_kernels() if record.backend == "hip"}
    assert records["linear"].accepts == "lucebox_cuda.op_kernels:accepts_linear"
    assert records["rms_norm"].kernel == "lucebox_cuda.op_kernels:rms_norm"
    assert records["post_norm_residual"].kernel == "lucebox_cuda.norm_kernels:post_norm_residual"
    assert records["silu_mul"].accepts == "lucebox_hip.op_kernels:accepts_silu_mul"


def test_family_ops_do_not_collide_with_the_hip_backends_own():
    from lucebox_gemma4.ops import GEMMA4_OPS
    from lucebox_hip.backend import HipBackend
    from lucebox_qwen35.ops import QWEN35_OPS

    for family in (QWEN35_OPS, GEMMA4_OPS):
        assert not [name for name in family.references if hasattr(HipBackend, name)]
