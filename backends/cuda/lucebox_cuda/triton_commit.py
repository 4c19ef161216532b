"""The commit of a verified path's Gated DeltaNet states for every linear-attention layer at once (the qwen35
family's `gated_delta_commit_`): each layer's conv state after the path's last node copied from the verify
pass's node states, and its recurrent state advanced along the path by the tree walk's own step
(`triton_fused._delta_node_step`, so the bits are the walk's).

Why one launch for all layers: a 27B commit was ~170 small launches, 0.88 ms of GPU time a speculative step even
recorded (H100, session 32); 96 of them were these two per layer. The layers' tensors are reached through a table
of their addresses (int64 on the device), made once per set of tensors and kept: a recorded commit reads the same
verify-pass buffers at every replay, so its table is made at the warm-up, before the capture (a capture may not
copy from the host).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .triton_fused import _replay_path
from .triton_ops import DELTA_BLOCK_VALUES, _device_scope

# A row of the recurrent table (6 int64): where layer l's mixed, a, b, ssm_a, dt_bias and live state are, in elements
# from layer 0's (which the kernel takes as arguments). A row of the conv table (3): the node states, the live state,
# the node states' row stride.
#
# Why offsets from real arguments, not addresses: Triton lays a kernel's loads out from what it knows of their
# pointers (an argument's alignment, which it specialises on; nothing for an address loaded from memory), and the
# layout orders the sums of the delta step (the q and k norms, the state's product with k). The walk and the per-layer
# path kernel take pointers as arguments; a table of addresses made this kernel differ from them in last bits on the
# H100 (session 34), where the interpreter, which has no layouts, found them equal. Layer 0's pointers plus offsets
# that are multiples of 16 elements (`tl.multiple_of`; the table is refused otherwise) give the compiler the
# per-layer kernel's knowledge of every layer.
_OFFSET_MULTIPLE = 16  # what `_gated_delta_paths_kernel` tells the compiler (`tl.multiple_of(..., 16)`)
TABLE_SWITCH = "LUCEBOX_GDN_COMMIT_TABLE"
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_KEPT = 256  # tables of recent tensor sets (a verify recording per window and node count)
_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
COPY_BLOCK = 1024


@triton.jit
def _gated_delta_paths_kernel(
    offsets_ptr, mixed_ptr, a_ptr, b_ptr, ssm_a_ptr, dt_bias_ptr, state_ptr, path_ptr, steps, scale, key_heads,
    value_heads, key_channels, stride_mn, stride_an, stride_bn,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """`_gated_delta_path_kernel` for one (layer, value head, slice of value dims) of many layers: the pointer
    arguments are layer 0's, each layer's tensors `offsets_ptr[layer]` elements from them."""
    layer = tl.program_id(0) // value_heads
    head = tl.program_id(0) % value_heads
    row = offsets_ptr + layer * 6
    mixed = mixed_ptr + tl.multiple_of(tl.load(row), 16)
    a = a_ptr + tl.multiple_of(tl.load(row + 1), 16)
    b = b_ptr + tl.multiple_of(tl.load(row + 2), 16)
    a_log = tl.load(ssm_a_ptr + tl.multiple_of(tl.load(row + 3), 16) + head)
    dt = tl.load(dt_bias_ptr + tl.multiple_of(tl.load(row + 4), 16) + head)
    state = state_ptr + tl.multiple_of(tl.load(row + 5), 16)
    _replay_path(state, mixed, a, b, path_ptr, steps, stride_mn, stride_an, stride_bn, head, head % key_heads,
                 key_channels, scale, a_log, dt, mixed_ptr.dtype.element_ty, KEY_DIM, VALUE_DIM, BLOCK_K, BLOCK_V)


@triton.jit
def _copy_node_rows_kernel(table_ptr, node_ptr, row_elements, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Layer l's row `node` of its node tensor (table[l, 0], rows `table[l, 2]` elements apart, each
    `row_elements` contiguous) into its live one (table[l, 1])."""
    layer = tl.program_id(0)
    source = tl.load(table_ptr + layer * 3).to(tl.pointer_type(DTYPE))
    destination = tl.load(table_ptr + layer * 3 + 1).to(tl.pointer_type(DTYPE))
    node_stride = tl.load(table_ptr + layer * 3 + 2)
    node = tl.load(node_ptr).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < row_elements
    tl.store(destination + offsets, tl.load(source + node * node_stride + offsets, mask=ok), mask=ok)


def _table(columns: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor | None:
    """The device table of these rows of addresses and strides, made once (None while a capture runs: a capture
    may not copy it from the host, and a table made then would not be this set's)."""
    key = (device, tuple(tuple(row) for row in columns))
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    table = torch.tensor(columns, dtype=torch.int64, device=device)
    _TABLES[key] = table
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return table


def _element_offsets(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    """Each tensor's distance from the first in elements, where every one is a multiple of `_OFFSET_MULTIPLE`."""
    first, size = tensors[0].data_ptr(), tensors[0].element_size()
    distances = [t.data_ptr() - first for t in tensors]
    if any(d % (size * _OFFSET_MULTIPLE) for d in distances):
        return None
    return [d // size for d in distances]


def commit_tables(conv_live, conv_nodes, state_live, mixed, a, b, ssm_a, dt_bias) -> tuple | None:
    """The two tables of a `gated_delta_commit_` call (the conv rows', the recurrence's offsets from layer 0), or
    None where they cannot be had now (see `_table`) or a layer's tensors are not a multiple of 16 elements from
    layer 0's."""
    device = mixed[0].device
    rows = [(nodes.data_ptr(), live.data_ptr(), nodes.stride(0)) for nodes, live in zip(conv_nodes, conv_live)]
    columns = [_element_offsets(tensors) for tensors in (mixed, a, b, ssm_a, dt_bias, state_live)]
    if any(column is None for column in columns):
        return None
    conv_table, recurrent_table = _table(rows, device), _table(list(zip(*columns)), device)
    if conv_table is None or recurrent_table is None:
        return None
    return conv_table, recurrent_table


def accepts_gated_delta_commit_(ops, conv_live, conv_nodes, state_live, mixed, a, b, ssm_a, dt_bias, path, last,
                                num_k_heads, head_k_dim) -> bool:
    """Same shapes, dtypes and layouts in every layer (one kernel serves them all), and a table to be had.
    `LUCEBOX_GDN_COMMIT_TABLE=0` refuses every call (the per-layer reference kernels then commit): an A/B."""
    if os.environ.get(TABLE_SWITCH, "1") == "0":
        return False
    if not mixed or mixed[0].dtype not in _TRITON_DTYPES or mixed[0].device.type != "cuda" or last.shape != (1,):
        return False
    if conv_live[0].numel() != conv_nodes[0][0].numel() or path.dtype not in (torch.int64, torch.int32):
        return False
    _, value_heads, key_dim, value_dim = state_live[0].shape
    nodes = mixed[0].shape[1]
    if (mixed[0].dim() != 3 or mixed[0].shape[0] != 1 or key_dim != head_k_dim or value_heads % num_k_heads
            or mixed[0].shape[2] != 2 * num_k_heads * head_k_dim + value_heads * value_dim
            or a[0].shape != (1, nodes, value_heads) or b[0].shape != (1, nodes, value_heads)):
        return False
    first = (conv_live[0], conv_nodes[0], state_live[0], mixed[0], a[0], b[0], ssm_a[0], dt_bias[0])
    for tensors in zip(conv_live, conv_nodes, state_live, mixed, a, b, ssm_a, dt_bias):
        for tensor, reference in zip(tensors, first):
            if (tensor.shape != reference.shape or tensor.dtype != reference.dtype or tensor.device != path.device
                    or tensor.stride()[1:] != reference.stride()[1:]):
                return False
    conv, node_rows, state = first[:3]
    if not (conv.is_contiguous() and node_rows[0].is_contiguous() and state.is_contiguous()
            and conv.dtype == node_rows.dtype
            and conv.dtype in _TRITON_DTYPES and state.dtype == torch.float32 and ssm_a[0].dtype == torch.float32
            and dt_bias[0].dtype == torch.float32 and a[0].dtype == b[0].dtype == mixed[0].dtype
            and ssm_a[0].is_contiguous() and dt_bias[0].is_contiguous()
            and all(t.stride(-1) == 1 for t in (mixed[0], a[0], b[0]))):
        return False
    return commit_tables(conv_live, conv_nodes, state_live, mixed, a, b, ssm_a, dt_bias) is not None


def gated_delta_commit_(
    ops, conv_live: Sequence[torch.Tensor], conv_nodes: Sequence[torch.Tensor], state_live: Sequence[torch.Tensor],
    mixed: Sequence[torch.Tensor], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
    ssm_a: Sequence[torch.Tensor], dt_bias: Sequence[torch.Tensor], path: torch.Tensor, last: torch.Tensor,
    num_k_heads: int, head_k_dim: int,
) -> None:
    """the qwen35 family's `gated_delta_commit_` reference (`lucebox_qwen35.ops`) in two launches for all the
    layers (`accepts_gated_delta_commit_` first)."""
    tables = commit_tables(conv_live, conv_nodes, state_live, mixed, a, b, ssm_a, dt_bias)
    if tables is None:
        raise ValueError("gated_delta_commit_: no address table (none is made while a capture runs, nor for layers "
                         "not 16 elements apart: accepts_gated_delta_commit_ first)")
    conv_table, recurrent_table = tables
    layers = len(mixed)
    row_elements = conv_nodes[0][0].numel()
    _, value_heads, key_dim, value_dim = state_live[0].shape
    with _device_scope(mixed[0]):
        _copy_node_rows_kernel[(layers, triton.cdiv(row_elements, COPY_BLOCK))](
            conv_table, last, row_elements, DTYPE=_TRITON_DTYPES[conv_nodes[0].dtype], BLOCK=COPY_BLOCK)
        if path.shape[0] == 0:
            return
        block_values = min(DELTA_BLOCK_VALUES, triton.next_power_of_2(value_dim))
        _gated_delta_paths_kernel[(layers * value_heads, math.ceil(value_dim / block_values))](
            recurrent_table, mixed[0], a[0], b[0], ssm_a[0], dt_bias[0], state_live[0], path, path.shape[0],
            key_dim**-0.5, num_k_heads, value_heads, num_k_heads * head_k_dim,
            mixed[0].stride(1), a[0].stride(1), b[0].stride(1),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_values,
        )
