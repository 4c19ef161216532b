"""The Qwen3.5 family's own ops: the references of the Gated DeltaNet mixer's maths, in plain torch.

They are named ops (`lucebox_core.ops`): the model calls them on `QWEN35_OPS.bind(backend)`, and a backend that
registers a kernel under the same name (`lucebox_op_kernels`, e.g. lucebox-cuda's Triton scans) runs it
wherever its check accepts the arguments; elsewhere these run. Each reference takes `ops` first (the bound
backend), so its calls to generic ops (`l2norm`, `silu`...) and to the other ops here are routed too.

Conventions (those of the core's `TorchBackend`): token-major `[B, T, H, D]`; the recurrent state is fp32
`[B, H_v, D_k, D_v]`; functional except the ops ending in `_`, which update a state in place (the fused
one-token ops of the decode step, which a CUDA graph replays over fixed buffers). When there are more value
heads than key heads, value head `h` reads key head `h % H_k`: the tiled order llama.cpp's converter leaves
in a GGUF, so the GGUF tensors are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lucebox_core.ops import OpSet

QWEN35_OPS = OpSet("qwen35")


# -- the gates of the mixer --------------------------------------------------------------------------------


@QWEN35_OPS.reference
def gdn_gates(ops: Any, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head gates from the `a` and `b` projections `[..., H_v]`, with `ssm_a`
    (= -exp(A_log)) and `dt_bias` `[H_v]` fp32: g, the log of the state's decay (<= 0), in fp32, as exp(A_log)
    can be large; and beta = sigmoid(b), the write strength, in b's dtype. Returns (g, beta)."""
    return ssm_a * ops.softplus(a.float() + dt_bias), ops.sigmoid(b)


# -- the fused one-token and tree forms of the mixer (what the decode step and a verify pass run) -------


@QWEN35_OPS.reference
def conv_silu_update_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of the causal convolution, then SiLU: x `[B, C]` -> `[B, C]`; `state` `[B, K-1, C]`
    is shifted in place."""
    y, new_state = ops.causal_conv1d_step(x, weight, state)
    state.copy_(new_state)
    return ops.silu(y)


@QWEN35_OPS.reference
def gated_delta_decode_(
    ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> torch.Tensor:
    """One Gated DeltaNet token from the convolved channels to the core output, the state updated in
    place. `mixed` `[B, C]` (after SiLU: q, k, v channels), `a`, `b` `[B, H_v]` (the decay and write
    projections), `ssm_a` (= -exp(A_log)) and `dt_bias` `[H_v]` fp32, `state` `[B, H_v, D_k, D_v]`
    fp32. Returns o `[B, 1, H_v, D_v]`: q and k L2-normalised, g and beta from `gdn_gates`, then
    `gated_delta_rule_recurrent`."""
    batch = mixed.shape[0]
    key_dim = num_k_heads * head_k_dim
    value_heads = state.shape[1]
    query, key, value = mixed[:, None].split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    query = ops.l2norm(query.reshape(batch, 1, num_k_heads, head_k_dim))
    key = ops.l2norm(key.reshape(batch, 1, num_k_heads, head_k_dim))
    value = value.reshape(batch, 1, value_heads, -1)
    g, beta = ops.gdn_gates(a, b, ssm_a, dt_bias)
    out, new_state = ops.gated_delta_rule_recurrent(query, key, value, g[:, None], beta[:, None], state)
    state.copy_(new_state)
    return out


@QWEN35_OPS.reference
def gated_delta_net_decode_(ops: Any, x: torch.Tensor, mixer: Any, state: Any) -> torch.Tensor:
    """One token through a whole Gated DeltaNet mixer (`model.GatedDeltaNet`), from its normed input x `[1, 1,
    hidden]` to its output, `state` (`model.GatedDeltaNetState`) updated in place: the mixer's own one-token path
    (its input projections, `conv_silu_update_`, `gated_delta_decode_`, `gated_rms_norm`, its output projection).
    One op so that a backend may run the whole mixer as one launch (lucebox-cuda's `LUCEBOX_PERSISTENT_GDN`)."""
    return mixer.decode_token(x, state)


@QWEN35_OPS.reference
def add_rms_norm_gated_delta_net_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  mixer: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's linear-attention layer up to its mixer's output: the residual add and the input norm
    (`add_rms_norm`), then `gated_delta_net_decode_`. Returns `(the mixer's output, residual + x)`."""
    normed, summed = ops.add_rms_norm(x, residual, weight, eps)
    return ops.gated_delta_net_decode_(normed, mixer, state), summed


@QWEN35_OPS.reference
def gated_attention_decode_(ops: Any, x: torch.Tensor, attention: Any, kv: Any, position: torch.Tensor,
                            window: int) -> torch.Tensor:
    """One token through a whole gated attention (`model.GatedAttention`) in a static decode step, from its normed
    input x `[1, 1, hidden]` at the device position `position` `[1]` to its output, its K/V row written in `kv`:
    the attention's own path (`GatedAttention.decode_unfused`: its projections, `qk_norm_rope`, the cache's write,
    `decode_attention` over the first `window` rows, `sigmoid_mul`, its output projection). One op so that a
    backend may run the whole attention as one launch (lucebox-cuda's `LUCEBOX_PERSISTENT_ATTENTION`)."""
    return attention.decode_unfused(x, position, kv, window)


@QWEN35_OPS.reference
def add_rms_norm_gated_attention_(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float, attention: Any, kv: Any, position: torch.Tensor,
                                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's full-attention layer up to its attention's output: the residual add and the input norm
    (`add_rms_norm`), then `gated_attention_decode_`. Returns `(the attention's output, residual + x)`."""
    normed, summed = ops.add_rms_norm(x, residual, weight, eps)
    return ops.gated_attention_decode_(normed, attention, kv, position, window), summed


@QWEN35_OPS.reference
def decode_layers_(ops: Any, model: Any, state: Any, embedded: torch.Tensor, position: torch.Tensor,
                   window: int) -> torch.Tensor:
    """A static decode step's whole decoder stack (`model.Qwen35Model`), from the token's embedding `[1, 1, hidden]`
    at the device position `position` `[1]` to the final-normed hidden state, the recurrent states and the KV cache
    (a `window` of rows read) updated in place: the model's own layer loop (`static_layers`). One op so that a
    backend may run the whole stack as one launch (lucebox-cuda's megakernel, `LUCEBOX_MEGAKERNEL`)."""
    return model.static_layers(state, embedded, position, window)


@QWEN35_OPS.reference
def gated_delta_tree(
    ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_decode_` for the nodes of a candidate tree, each from its parent's state:
    mixed `[1, N, C]` (after SiLU), a, b `[1, N, H_v]`, state `[1, H_v, D_k, D_v]` fp32 (not modified),
    parents `[N]` -> (o `[1, N, H_v, D_v]`, the fp32 state after every node `[N, H_v, D_k, D_v]`)."""
    nodes = mixed.shape[1]
    key_dim = num_k_heads * head_k_dim
    value_heads = state.shape[1]
    query, key, value = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    query = ops.l2norm(query.reshape(1, nodes, num_k_heads, head_k_dim))
    key = ops.l2norm(key.reshape(1, nodes, num_k_heads, head_k_dim))
    value = value.reshape(1, nodes, value_heads, -1)
    g, beta = ops.gdn_gates(a, b, ssm_a, dt_bias)
    return ops.gated_delta_rule_tree(query, key, value, g, beta, state, parents)


@QWEN35_OPS.reference
def gated_delta_tree_reloaded(
    ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_tree`, whose node states need hold only the nodes a later node steps from though it is not
    their next node (a backend may leave the others unwritten: `gated_delta_path_` replays a path instead).
    Why: a 27B verify of 23 nodes writes 3.5 GB of node states, most never read (H100, session 32)."""
    return ops.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim)


@QWEN35_OPS.reference
def gated_delta_path_(
    ops: Any, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, path: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> None:
    """`state` `[1, H_v, D_k, D_v]` advanced in place along `path` `[L]` (nodes of a tree whose inputs are
    `gated_delta_tree`'s, each the parent of the next, on the device): the state `gated_delta_tree` gives the
    path's last node when its first node's parent state is `state`. Here the tree op on the path's rows as a
    chain, so each step is that op's arithmetic."""
    steps = path.shape[0]
    if steps == 0:
        return
    rows = [t.index_select(1, path) for t in (mixed, a, b)]
    chain = torch.arange(-1, steps - 1, device=path.device)
    _, states = ops.gated_delta_tree(*rows, ssm_a, dt_bias, state, chain, num_k_heads, head_k_dim)
    state.copy_(states[steps - 1 :])


@QWEN35_OPS.reference
def gated_delta_commit_(
    ops: Any, conv_live: Sequence[torch.Tensor], conv_nodes: Sequence[torch.Tensor], state_live: Sequence[torch.Tensor],
    mixed: Sequence[torch.Tensor], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
    ssm_a: Sequence[torch.Tensor], dt_bias: Sequence[torch.Tensor], path: torch.Tensor, last: torch.Tensor,
    num_k_heads: int, head_k_dim: int,
) -> None:
    """The commit of a replayed verification in every linear-attention layer (lists, a layer an entry): the
    conv state `conv_live[l]` `[1, K-1, C]` from the node states `conv_nodes[l]` `[N, K-1, C]` at node `last`
    `[1]`, and the recurrent state `state_live[l]` advanced along `path` (`gated_delta_path_` with the layer's
    `mixed`, `a`, `b`, `ssm_a`, `dt_bias`). A backend may run all the layers in one launch."""
    for layer in range(len(mixed)):
        conv_live[layer].copy_(conv_nodes[layer].index_select(0, last))
        ops.gated_delta_path_(mixed[layer], a[layer], b[layer], ssm_a[layer], dt_bias[layer], state_live[layer], path,
                              num_k_heads, head_k_dim)


# -- short convolution -----------------------------------------------------------------------------


@QWEN35_OPS.reference
def causal_conv1d(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over tokens, continuing from `state`. No bias, no activation.

    x `[B, T, C]`, weight `[C, K]`, state `[B, K-1, C]` (the previous K-1 inputs, zeros at the start).
    Returns y `[B, T, C]` with `y[t] = sum_j weight[:, j] * window[t + j]` over the window
    `cat(state, x)`, so `weight[:, K-1]` multiplies the current token; and the new state, the last
    K-1 inputs of that window.
    """
    kernel = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    tokens = x.shape[1]
    w = weight.to(x.dtype)
    y = sum(window[:, j : j + tokens] * w[:, j] for j in range(kernel))
    return y, window[:, tokens:]


@QWEN35_OPS.reference
def causal_conv1d_silu_(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d`, then SiLU on y, `state` `[B, K-1, C]` replaced in place by the new state (the prefill
    form of `conv_silu_update_`): x `[B, T, C]` -> `[B, T, C]`."""
    y, new_state = ops.causal_conv1d(x, weight, state)
    state.copy_(new_state)
    return ops.silu(y)


@QWEN35_OPS.reference
def causal_conv1d_step(ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token `causal_conv1d` (the decode kernel): x `[B, C]` -> y `[B, C]`, new state `[B, K-1, C]`."""
    window = torch.cat([state.to(x.dtype), x[:, None]], dim=1)  # [B, K, C]
    y = (window * weight.to(x.dtype).t()).sum(dim=1)
    return y, window[:, 1:]


@QWEN35_OPS.reference
def causal_conv1d_tree(
    ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_step` for the nodes of a candidate tree: x `[1, N, C]`, weight `[C, K]`, state
    `[1, K-1, C]` (the committed inputs), parents `[N]` long (-1 for the root) -> (y `[1, N, C]`, each
    node's conv state `[N, K-1, C]`). Node i's window, oldest first, is the last K rows of the
    committed inputs followed by the inputs along the path root -> i; its state is the window's last
    K-1 rows. The windows are found on the device (no host read of `parents`)."""
    nodes, kernel = x.shape[1], weight.shape[1]
    history = torch.cat([state[0].to(x.dtype), x[0]], dim=0)  # rows 0..K-2 committed, K-1+i node i
    node = torch.arange(nodes, device=x.device)
    state_row = torch.full_like(node, kernel - 2)
    newest_first = []
    for _ in range(kernel):  # walk up the ancestry; past the root, down the committed rows
        in_tree = node >= 0
        newest_first.append(torch.where(in_tree, kernel - 1 + node, state_row))
        state_row = torch.where(in_tree, state_row, state_row - 1)
        node = torch.where(in_tree, parents.to(node.device)[node.clamp(min=0)], node)
    windows = history[torch.stack(newest_first[::-1], dim=1)]  # [N, K, C]
    y = (windows * weight.to(x.dtype).t()).sum(dim=1)  # as causal_conv1d_step
    return y[None], windows[:, 1:]


@QWEN35_OPS.reference
def conv_silu_tree(
    ops: Any, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_tree`, then SiLU on y: the tree form of `conv_silu_update_` (a backend fuses the
    two as it fuses the decode step's, with the same arithmetic)."""
    y, node_states = ops.causal_conv1d_tree(x, weight, state, parents)
    return ops.silu(y), node_states


# -- Gated DeltaNet --------------------------------------------------------------------------------


def _gdn_inputs(q, k, v, g, beta, state, scale):
    """Shared preparation of the rule's forms: broadcast key heads, move heads before tokens, fp32, scale q."""
    batch, _, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[-2:]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    if value_heads != key_heads:
        # Tiled: value head h reads key head h % H_k (the GGUF order; see `gated_delta_rule_recurrent`).
        repeats = value_heads // key_heads
        q, k = q.repeat(1, 1, repeats, 1), k.repeat(1, 1, repeats, 1)
    scale = key_dim**-0.5 if scale is None else scale
    q = q.transpose(1, 2).float() * scale
    k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    if state is None:
        state = torch.zeros(batch, value_heads, key_dim, value_dim, device=v.device, dtype=torch.float32)
    return q, k, v, g, beta, state.float()


@QWEN35_OPS.reference
def gated_delta_rule_recurrent(
    ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode; the definition the chunked form must match).

    q, k `[B, T, H_k, D_k]` (already L2-normalised), v `[B, T, H_v, D_v]`, g (log decay, <= 0) and
    beta `[B, T, H_v]`, state `[B, H_v, D_k, D_v]` fp32 or None for zeros. When H_v > H_k, value head
    `h` uses key head `h % H_k` (tiled, the order a GGUF stores after llama.cpp's converter reorders V
    heads). q is multiplied by `scale` (default `D_k**-0.5`). Per value head and token:

        S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q

    Returns o `[B, T, H_v, D_v]` in v's dtype and the new fp32 state.
    """
    input_dtype = v.dtype
    q, k, v, g, beta, state = _gdn_inputs(q, k, v, g, beta, state, scale)
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        update = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    out = torch.stack(outputs, dim=1) if outputs else v.transpose(1, 2).clone()
    return out.to(input_dtype), state


@QWEN35_OPS.reference
def gated_delta_rule_tree(
    ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the nodes of a candidate tree, each node one step from its parent's
    state (speculative verification): the recurrent form with the nodes as tokens, except that node
    `i` starts from the state after node `parents[i]`, the root (parent -1) from `state`.

    q, k `[1, N, H_k, D_k]`, v `[1, N, H_v, D_v]`, g, beta `[1, N, H_v]`, state `[1, H_v, D_k, D_v]`
    fp32 (not modified), parents `[N]` long with `parents[i] < i`. Returns o `[1, N, H_v, D_v]` and
    the fp32 state after every node, `[N, H_v, D_k, D_v]`, so a committed path can keep its last one.
    """
    input_dtype = v.dtype
    q, k, v, g, beta, root_state = _gdn_inputs(q, k, v, g, beta, state, scale)
    nodes = q.shape[2]
    node_states = torch.empty(nodes, *root_state.shape[1:], device=v.device, dtype=torch.float32)
    outputs = []
    for i, parent in enumerate(parents.tolist()):
        s = (root_state[0] if parent < 0 else node_states[parent]) * g[0, :, i, None, None].exp()
        predicted = torch.einsum("hk,hkv->hv", k[0, :, i], s)
        update = (v[0, :, i] - predicted) * beta[0, :, i, None]
        s = s + k[0, :, i, :, None] * update[:, None, :]
        node_states[i] = s
        outputs.append(torch.einsum("hk,hkv->hv", q[0, :, i], s))
    out = torch.stack(outputs, dim=0)[None] if outputs else v.transpose(1, 2).clone()
    return out.to(input_dtype), node_states


@QWEN35_OPS.reference
def gated_delta_rule_chunked(
    ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, chunk_size: int = 64, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over chunks of tokens (prefill): same inputs and results as the recurrent form.

    Within a chunk starting from state S0, let G_t be the cumulative log decay from the chunk start to
    token t and D_ts = exp(G_t - G_s) for s <= t. Unrolling the recurrence gives, for the updates u,
    a unit lower-triangular system (I + A) U = beta*V - beta*exp(G)*K S0 with
    A_ts = beta_t D_ts (k_t . k_s) for s < t, solved once per chunk for both right-hand sides; then
    outputs O = (exp(G)*Q) S0 + ((Q K^T) * D) U and the next state exp(G_last) S0 + (exp(G_last - G) K)^T U.
    Only the short scan over chunks is sequential.
    """
    input_dtype = v.dtype
    q, k, v, g, beta, state = _gdn_inputs(q, k, v, g, beta, state, scale)
    batch, heads, tokens, _ = k.shape
    value_dim = v.shape[-1]
    # Pad to whole chunks with tokens that change nothing: beta = 0 writes nothing, g = 0 decays nothing.
    pad = (-tokens) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (tokens + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))

    log_decay = g.cumsum(-1)  # G_t, [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_log_decay = log_decay[..., :, None] - log_decay[..., None, :]
    # Mask before exp: above the diagonal G_t - G_s > 0 could overflow.
    pair_decay = pair_log_decay.masked_fill(~causal, float("-inf")).exp()  # D, [B, H, N, C, C]

    key_affinity = (k @ k.transpose(-1, -2)) * pair_decay * beta[..., :, None]
    system = key_affinity.tril(-1) + torch.eye(chunk_size, device=q.device)
    updates_from_values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    updates_per_state = torch.linalg.solve_triangular(
        system, k * (beta * log_decay.exp())[..., None], upper=False, unitriangular=True
    )
    intra_attention = (q @ k.transpose(-1, -2)) * pair_decay
    decayed_q = q * log_decay.exp()[..., None]
    chunk_log_decay = log_decay[..., -1]  # [B, H, N]
    keys_to_end = k * (chunk_log_decay[..., None] - log_decay).exp()[..., None]

    outputs = torch.empty(batch, heads, chunks, chunk_size, value_dim, device=q.device, dtype=torch.float32)
    for n in range(chunks):
        updates = updates_from_values[:, :, n] - updates_per_state[:, :, n] @ state
        outputs[:, :, n] = decayed_q[:, :, n] @ state + intra_attention[:, :, n] @ updates
        state = state * chunk_log_decay[:, :, n, None, None].exp() + keys_to_end[:, :, n].transpose(-1, -2) @ updates

    out = outputs.reshape(batch, heads, chunks * chunk_size, value_dim)[:, :, :tokens]
    return out.transpose(1, 2).to(input_dtype), state


@QWEN35_OPS.reference
def gated_delta_rule_chunked_(
    ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int = 64, scale: float | None = None,
) -> torch.Tensor:
    """`gated_delta_rule_chunked` with `state` (fp32 `[B, H_v, D_k, D_v]`) replaced in place by the new
    state (the prefill's form: a backend writes it from the scan, without a copy). Returns o."""
    out, new_state = ops.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size, scale=scale)
    state.copy_(new_state)
    return out


# -- the MoE router (qwen35moe) ------------------------------------------------------------------------------


@QWEN35_OPS.reference
def softmax_topk_route(ops: Any, x: torch.Tensor, proj: Any, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE's router on the normed input `x` `[T, hidden]`: probabilities `softmax(x proj^T)` in fp32, the
    `top_k` largest kept and renormalised to sum 1 (transformers always renormalises; llama.cpp's `norm_w`).
    Weights `[T, top_k]` fp32 and expert ids `[T, top_k]` long."""
    probs = torch.softmax(ops.linear(x, proj).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


@QWEN35_OPS.reference
def softmax_topk_route_gated(ops: Any, x: torch.Tensor, proj: Any, shared_gate: Any,
                             top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`softmax_topk_route` and the shared expert's gate logit `x shared_gate^T` (`[T, 1]`, the activations'
    dtype, as `linear` gives it) of the same input: one op so a backend can read both matrices in one launch."""
    weights, ids = ops.softmax_topk_route(x, proj, top_k)
    return weights, ids, ops.linear(x, shared_gate)
