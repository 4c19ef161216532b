"""What the core provides itself, registered through the same hooks as any plugin."""

from . import hookimpl
from .specs import Converter, Drafter, KernelBackend, KVPolicy, Verifier


def _torch_available() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    return True, ""


@hookimpl
def lucebox_kernel_backends():
    return [
        KernelBackend(
            name="torch",
            factory="lucebox_core.torch_backend:TorchBackend",
            priority=0,  # the fallback and the oracle: any GPU backend outranks it
            availability=_torch_available,
            description="pure-torch reference ops; runs on the CPU and on any torch device",
        )
    ]


@hookimpl
def lucebox_kv_policies():
    return [
        KVPolicy(
            name="full",
            factory="lucebox_core.kv:FullKVCache",
            cache_types=["f32", "f16", "bf16", "q8_0"],
            description="every position's K and V kept, contiguous per sequence (slot = position)",
        )
    ]


@hookimpl
def lucebox_drafters():
    return [
        Drafter(
            name="dflash",
            factory="lucebox_core.speculative.dflash:load",
            architectures=["dflash-draft"],
            description="DFlash block-diffusion drafter conditioned on captured target features",
        )
    ]


@hookimpl
def lucebox_verifiers():
    return [
        Verifier(
            name="chain",
            factory="lucebox_core.speculative.loop:ChainVerifier",
            description="one drafted block verified as a chain; speculative sampling at temperature > 0",
        ),
        Verifier(
            name="ddtree",
            factory="lucebox_core.speculative.loop:DDTreeVerifier",
            description="best-first draft tree (chain pre-seed, --tree-budget 22 or auto) verified in one pass",
        ),
    ]


@hookimpl
def lucebox_converters():
    return [
        Converter(
            name="dflash",
            model_types=["qwen3"],
            hf_architectures=["DFlashDraftModel"],
            writer="lucebox_core.speculative.dflash:convert_zlab",
            types=["f32", "f16", "bf16", "q8_0"],
            description="z-lab DFlash drafter checkpoint (safetensors + config.json) to a dflash-draft GGUF",
        )
    ]
