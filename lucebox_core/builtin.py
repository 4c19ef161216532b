"""What the core provides itself, registered through the same hooks as any plugin."""

from . import provides
from .specs import CONVERTED_TYPES, Converter, KernelBackend, KVPolicy, PrefillCompressor, Verifier, dflash_drafter


def _torch_available() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    return True, ""


lucebox_kernel_backends = provides(
    KernelBackend(
        name="torch",
        factory="lucebox_core.torch_backend:TorchBackend",
        priority=0,  # the fallback and the oracle: any GPU backend outranks it
        availability=_torch_available,
        description="pure-torch reference ops; runs on the CPU and on any torch device",
    )
)

lucebox_kv_policies = provides(
    KVPolicy(
        name="full",
        factory="lucebox_core.kv:FullKVCache",
        cache_types=["f32", "f16", "bf16", "q8_0", "q4_0", "tq3_0"],
        description="every position's K and V kept, contiguous per sequence (slot = position)",
    ),
    KVPolicy(
        name="kvflash",
        factory="lucebox_core.kvflash:KVFlashCache",  # assembly configures it from --kvflash, -policy, -tau, -scorer
        cache_types=["f32", "f16", "bf16", "q8_0", "q4_0", "tq3_0"],
        bounded=True,
        description="bounded KV residency: a pool of N slots per layer, 64-token chunks paged to host memory "
                    "(--kvflash N|auto, --kvflash-policy lru|qk|drafter, --kvflash-tau N, --kvflash-scorer FILE)",
    ),
)

lucebox_drafters = provides(
    dflash_drafter("dflash-draft", "DFlash block-diffusion drafter conditioned on captured target features")
)

lucebox_verifiers = provides(
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
)

lucebox_converters = provides(
    Converter(
        name="dflash",
        model_types=["qwen3"],
        hf_architectures=["DFlashDraftModel"],
        writer="lucebox_core.speculative.dflash:convert_zlab",
        types=CONVERTED_TYPES,
        description="z-lab DFlash drafter checkpoint (safetensors + config.json) to a dflash-draft GGUF",
    )
)

lucebox_prefill_compressors = provides(
    PrefillCompressor(
        name="pflash",
        factory="lucebox_core.pflash:from_config",
        description="a scorer model (qwen3, e.g. Qwen3-0.6B: --prefill-drafter) keeps the chunks of aged messages "
                    "its last tokens attend to",
    )
)
