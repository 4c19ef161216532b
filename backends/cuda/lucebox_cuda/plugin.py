"""The hooks `lucebox-cuda` implements. Listing plugins imports only this module and probes cheaply."""

from __future__ import annotations

import importlib.util

from lucebox_core import KernelBackend, OpKernel, hookimpl

# Compute capability the kernels need: bf16 conversions (`cvt.rn.bf16.f32`) arrived with sm_80.
MIN_CAPABILITY = (8, 0)

# The ops with a kernel on this backend (each `op_kernels.<op>`, checked by `op_kernels.accepts_<op>`): the core's
# generic ops, then the Qwen3.5 family's Gated DeltaNet and convolution ops (names only: the backend does not
# import the family).
GENERIC_KERNEL_OPS = (
    "linear", "embedding", "fuse_rows", "rms_norm", "add_rms_norm", "silu_mul", "sigmoid_mul", "gated_rms_norm", "l2norm",
    "add_sigmoid_gated",  # a gated shared expert joining the routed ones (Qwen3.5-MoE): one launch, not three
    "add_rms_norm_swiglu",  # a decode step's add + norm and SwiGLU MLP, one persistent launch (LUCEBOX_PERSISTENT_FFN)
    "add_rms_norm_moe",  # a decode step's add + norm and MoE block, one persistent launch (LUCEBOX_PERSISTENT_MOE)
    "qk_norm_rope", "attention", "decode_attention", "tree_attention",
    "write_kv_rows",  # a static step's K/V rows stored in one launch (the cache's write is two copies and a modulo)
    "moe_experts_swiglu",  # routed SwiGLU experts over separate gate and up stacks (Laguna, Qwen3.5-MoE)
    "moe_experts_swiglu_paged",  # the same over Spark's paged stacks (device slots, pinned host copy, table)
    "block_sparse_attention",  # FlashPrefill's block-sparse causal prefill (PFlash's scorer at long prompts)
)
FAMILY_KERNEL_OPS = (
    "gated_delta_rule_recurrent", "gated_delta_rule_chunked", "gated_delta_rule_tree", "gated_delta_decode_",
    "gated_delta_tree", "causal_conv1d", "causal_conv1d_step", "causal_conv1d_tree", "conv_silu_update_",
    "gated_delta_tree_reloaded", "gated_delta_path_",  # a verify pass's node states for a commit that replays
    "conv_silu_tree", "gdn_gates", "causal_conv1d_silu_", "gated_delta_rule_chunked_",
    "moe_experts",  # Gemma-4's (and any family's of that name and signature) routed experts, GeGLU
    "moe_experts_paged",  # the same over Spark's paged stacks (device slots, pinned host copy, table)
    "gated_delta_net_decode_",  # a decode step's Gated DeltaNet mixer, one persistent launch (LUCEBOX_PERSISTENT_GDN)
    "add_rms_norm_gated_delta_net_",  # the same with the layer's input add + norm
    "gated_attention_decode_",  # a decode step's gated attention, one persistent launch (LUCEBOX_PERSISTENT_ATTENTION)
    "add_rms_norm_gated_attention_",  # the same with the layer's input add + norm
    "decode_layers_",  # a Qwen3.5 decode step's whole decoder stack, one persistent launch (LUCEBOX_MEGAKERNEL)
)
# Every linear-attention layer's commit of a verified path in one op (qwen35's name), in `triton_commit`.
COMMIT_KERNEL_OPS = ("gated_delta_commit_",)
# A sandwich-norm decoder's norm chains and small ops (Gemma-4's names), in `norm_kernels`.
NORM_KERNEL_OPS = ("qkv_norm_rope", "post_norm_residual", "norm_sum", "gelu_tanh_mul", "softcap", "moe_route",
                   # a gated-attention, sigmoid-routed MoE decoder's (Laguna's names), in `triton_gates`
                   "qk_norm_rope_scaled", "sigmoid_route", "softplus_head_gate", "gated_tree_attention",
                   "softmax_topk_route",  # a softmax-routed MoE's router (Qwen3.5-MoE's name)
                   "softmax_topk_route_gated")  # the same with its shared expert's gate logit, one launch


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of returning None
        return False


def availability() -> tuple[bool, str]:
    """Whether this process can run the CUDA kernels, and if not, why (never raises)."""
    if not _installed("cuda.bindings"):
        return False, "cuda-python is not installed (pip install cuda-bindings nvidia-cuda-nvrtc)"
    if not _installed("torch"):
        return False, "torch is not installed"
    import torch

    if getattr(torch.version, "hip", None):
        # A ROCm build reports AMD GPUs through torch.cuda; the kernels here are NVIDIA's (lucebox-hip runs them).
        return False, f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build: AMD GPUs take the hip backend"
    if not torch.cuda.is_available():
        built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        return False, f"no CUDA GPU visible to torch {torch.__version__} ({built_for})"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return False, (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}; "
                       f"the kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    try:
        from .nvrtc import nvrtc_version

        nvrtc_version()
    except Exception as exc:  # the NVRTC library itself is missing or broken
        return False, f"NVRTC cannot be loaded: {exc} (pip install nvidia-cuda-nvrtc)"
    return True, ""


@hookimpl
def lucebox_kernel_backends():
    return [
        KernelBackend(
            name="cuda",
            factory="lucebox_cuda.backend:CudaBackend",
            priority=100,  # above torch (0): chosen whenever a usable NVIDIA GPU is present
            availability=availability,
            description="GGUF-native CUDA kernels (NVRTC-compiled for the device's sm_XY); torch ops elsewhere",
        )
    ]


@hookimpl
def lucebox_op_kernels():
    return [
        OpKernel(op=op, backend="cuda", kernel=f"lucebox_cuda.op_kernels:{op}", accepts=f"lucebox_cuda.op_kernels:accepts_{op}",
                 description="NVRTC matrix-vector and dequant kernels" if op in ("linear", "embedding", "fuse_rows",
                                                                                  "rms_norm", "add_rms_norm_swiglu",
                                                                                  "add_rms_norm_moe",
                                                                                  "gated_delta_net_decode_",
                                                                                  "add_rms_norm_gated_delta_net_",
                                                                                  "gated_attention_decode_",
                                                                                  "add_rms_norm_gated_attention_",
                                                                                  "decode_layers_")
                 else "Triton")
        for op in GENERIC_KERNEL_OPS + FAMILY_KERNEL_OPS
    ] + [
        OpKernel(op=op, backend="cuda", kernel=f"lucebox_cuda.norm_kernels:{op}",
                 accepts=f"lucebox_cuda.norm_kernels:accepts_{op}", description="Triton")
        for op in NORM_KERNEL_OPS
    ] + [
        OpKernel(op=op, backend="cuda", kernel=f"lucebox_cuda.triton_commit:{op}",
                 accepts=f"lucebox_cuda.triton_commit:accepts_{op}", description="Triton")
        for op in COMMIT_KERNEL_OPS
    ]
