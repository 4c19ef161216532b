"""The CUDA backend registers through its entry point and, without a GPU, reports why it cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lucebox_core.plugins import registry

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lucebox_cuda") is None, reason="lucebox-cuda is not installed"
)


def _cuda_spec():
    [spec] = [backend for backend in registry().kernel_backends() if backend.name == "cuda"]
    return spec


def test_registered_above_torch():
    [torch_spec] = [backend for backend in registry().kernel_backends() if backend.name == "torch"]
    assert _cuda_spec().priority > torch_spec.priority


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_unavailable_without_a_gpu_with_the_reason():
    available, reason = _cuda_spec().is_available()
    assert not available
    assert "no CUDA GPU" in reason and torch.__version__ in reason
    # The registry then picks the torch backend and creating it works.
    assert registry().kernel_backend().name == "torch"


def test_reason_names_the_missing_bindings(monkeypatch):
    from lucebox_cuda import plugin

    real_find_spec = importlib.util.find_spec

    def without_cuda(name, *args):
        if name.startswith("cuda"):
            raise ModuleNotFoundError(name)
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_cuda)
    available, reason = plugin.availability()
    assert not available and "cuda-python is not installed" in reason


def test_backend_refuses_a_cpu_device():
    from lucebox_core.errors import LuceboxError
    from lucebox_cuda.backend import CudaBackend

    with pytest.raises(LuceboxError, match="CUDA device"):
        CudaBackend("cpu")


def test_plugins_command_lists_it_unavailable(capsys):
    from lucebox_core.cli import main

    main(["plugins"])
    out = capsys.readouterr().out
    assert "lucebox-cuda" in out and "cuda" in out
