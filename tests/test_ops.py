"""Named ops: a backend's kernels for generic and family ops, each behind its check, else the reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lucebox_core import OpKernel
from lucebox_core.errors import PluginError
from lucebox_core.ops import OpSet, kernel_table, with_family_ops
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

ROOT = Path(__file__).resolve().parent.parent
calls: list[str] = []


def doubled_rms_norm(ops, x, weight, eps, *, out=None):
    calls.append("doubled")
    return 2 * TorchBackend.rms_norm(ops, x, weight, eps)


def plain_rms_norm(ops, x, weight, eps, *, out=None):
    calls.append("plain")
    return TorchBackend.rms_norm(ops, x, weight, eps)


def only_wide(ops, x, weight, eps, *, out=None):
    return x.shape[-1] >= 8


def step_kernel(ops, x, weight, state):
    calls.append("conv step")
    return x * 0, state


def test_kernels_run_by_priority_behind_their_checks_else_the_reference():
    specs = [
        OpKernel(op="rms_norm", backend="test", kernel=plain_rms_norm, priority=1),
        OpKernel(op="rms_norm", backend="test", kernel=doubled_rms_norm, accepts=only_wide, priority=5),
        OpKernel(op="rms_norm", backend="other", kernel=doubled_rms_norm),  # another backend's: never here
    ]
    backend = TorchBackend(kernel_table_for=kernel_table("test", specs))
    wide, narrow, weight8, weight4 = torch.randn(3, 8), torch.randn(3, 4), torch.rand(8) + 0.5, torch.rand(4) + 0.5
    reference = TorchBackend(kernel_table_for={})
    calls.clear()
    torch.testing.assert_close(backend.rms_norm(wide, weight8, 1e-6), 2 * reference.rms_norm(wide, weight8, 1e-6))
    torch.testing.assert_close(backend.rms_norm(narrow, weight4, 1e-6), reference.rms_norm(narrow, weight4, 1e-6))
    assert calls == ["doubled", "plain"]  # the higher priority first, where its check accepts
    assert backend.rms_norm.choice(narrow, weight4, 1e-6) == "test.rms_norm"
    # A reference that calls another op reaches that op's kernel: add_rms_norm has none, its norm has.
    calls.clear()
    backend.add_rms_norm(wide, wide, weight8, 1e-6)
    assert calls == ["doubled"]
    # An op without kernels is the plain reference: no dispatch object at all.
    assert not hasattr(backend.silu, "kernels")


def test_family_ops_reach_the_backends_kernels_for_their_names():
    backend = TorchBackend(kernel_table_for=kernel_table("test", [
        OpKernel(op="causal_conv1d_step", backend="test", kernel=step_kernel)]))
    ops = QWEN35_OPS.bind(backend)
    x, weight, state = torch.randn(1, 6), torch.randn(6, 4), torch.randn(1, 3, 6)
    calls.clear()
    out = ops.conv_silu_update_(x, weight, state.clone())  # the reference composition, whose step has a kernel
    assert calls == ["conv step"] and torch.equal(out, torch.zeros_like(out))
    # Everything else reads through to the backend, and the family's view is not written to.
    assert ops.device == backend.device and ops.rms_norm == backend.rms_norm
    with pytest.raises(AttributeError, match="on the backend itself"):
        ops.dtype = torch.float16
    plain = QWEN35_OPS.bind(TorchBackend(kernel_table_for={}))
    y, _ = plain.causal_conv1d_step(x, weight, state)
    window = torch.cat([state, x[:, None]], dim=1)
    torch.testing.assert_close(y, (window * weight.t()).sum(dim=1))


def test_a_family_op_may_not_hide_a_backend_op_and_names_are_unique():
    clash = OpSet("clash")

    @clash.reference
    def rms_norm(ops, x):  # noqa: ARG001
        return x

    with pytest.raises(PluginError, match="would hide the backend's own op"):
        clash.bind(TorchBackend(kernel_table_for={}))
    with pytest.raises(ValueError, match="defined twice"):
        clash.reference(rms_norm)


def test_a_kernel_that_does_not_import_is_left_out_with_a_warning_naming_it():
    specs = [OpKernel(op="silu", backend="test", kernel="lucebox_core.no_such_module:silu"),
             OpKernel(op="rms_norm", backend="test", kernel=plain_rms_norm)]
    with pytest.warns(RuntimeWarning, match=r"kernel test\.silu is left out: cannot import"):
        table = kernel_table("test", specs)
    assert list(table) == ["rms_norm"]  # the rest of the backend's kernels stay


def test_installed_families_ops_are_found_by_name():
    ops = with_family_ops(TorchBackend(kernel_table_for={}))
    assert callable(ops.gated_delta_rule_chunked) and callable(ops.causal_conv1d_tree)


def test_the_cuda_backend_registers_a_kernel_for_every_op_it_names():
    table = kernel_table("cuda")
    from lucebox_cuda.plugin import COMMIT_KERNEL_OPS, FAMILY_KERNEL_OPS, GENERIC_KERNEL_OPS, NORM_KERNEL_OPS

    assert set(table) == (set(GENERIC_KERNEL_OPS) | set(FAMILY_KERNEL_OPS) | set(NORM_KERNEL_OPS)
                          | set(COMMIT_KERNEL_OPS))
    # Each generic op it names is one of the reference backend's, each family op one of an installed family's.
    from lucebox_gemma4.ops import GEMMA4_OPS
    from lucebox_laguna.ops import LAGUNA_OPS

    assert all(callable(getattr(TorchBackend, op, None)) for op in GENERIC_KERNEL_OPS)
    family_ops = set(QWEN35_OPS.references) | set(GEMMA4_OPS.references) | set(LAGUNA_OPS.references)
    assert set(FAMILY_KERNEL_OPS) | set(NORM_KERNEL_OPS) | set(COMMIT_KERNEL_OPS) <= family_ops


def test_family_maths_lives_with_the_family():
    """The core names no family's maths (data names such as a pre-tokenizer id are fine)."""
    found = subprocess.run(["grep", "-rliE", "gated_delta|deltanet|conv1d|qwen3_5", str(ROOT / "lucebox_core")],
                           capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def test_no_source_file_is_over_800_lines():
    sources = [p for folder in ("lucebox_core", "plugins", "backends", "scripts") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


def test_plugins_list_the_verifiers_drafters_kv_policies_and_kernels():
    import json

    out = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "plugins", "--json"], capture_output=True,
                         text=True, check=True).stdout
    provided = {p["name"]: {(i["kind"], i["name"]) for i in p["provides"]} for p in json.loads(out)}
    assert {("verifier", "chain"), ("verifier", "ddtree"), ("kv_policy", "full"), ("drafter", "dflash")} <= \
        provided["builtin"]
    assert ("drafter", "dflash") in provided["qwen35"]  # the family's own draft files
    assert ("kernel", "cuda.gated_delta_rule_chunked") in provided["cuda"]
