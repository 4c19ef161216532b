"""What the core provides itself, registered through the same hooks as any plugin."""

from . import hookimpl
from .specs import KernelBackend, KVPolicy


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
            description="every position's K and V kept, contiguous per sequence",
        )
    ]
