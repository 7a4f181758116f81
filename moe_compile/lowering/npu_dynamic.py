"""Dynamic EP on NPU: tokens travel to the ranks owning their experts (MindIE-SD §1.6).

::

    counts per expert -> all_gather -> split sizes (host sync, as MindIE-SD does)
    npu_moe_token_permute(x, ids)                 rows sorted by global expert = by destination rank
    all_to_all_single                             rows arrive ordered (source rank, local expert)
    npu_moe_token_permute(rows, local ids)        regroup by local expert (when > 1 local expert)
    mlp (grouped matmul, counts)                  every row is valid: nothing undefined to read
    npu_moe_token_unpermute(y, rev_global)        undo the regrouping
    all_to_all_single back                        rows return in the order they left
    npu_moe_token_unpermute(rows, rev_local, w)   weight and sum the k rows of each token

The split sizes are Python ints, so this path synchronises with the host: it runs eagerly (the
op is opaque under aot_eager) but neither GE mode nor aclgraph capture can take it (notes §3.2,
§5.6), and ``npu_moe_token_(un)permute`` have no GE converter (§3.5).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_compile.lowering.npu_comm import Comm, all_gather, all_to_all
from moe_compile.lowering.npu_routing import import_torch_npu


def split_tokens(comm: Comm, *tensors):
    """tokens_full=True: pad the tokens to a multiple of the EP size and keep this rank's share."""
    num_tokens = tensors[0].shape[0]
    pad = (-num_tokens) % comm.size

    def share(t):
        if t is None:
            return None
        if pad:
            t = F.pad(t, (0, 0, 0, pad))
        return t.tensor_split(comm.size)[comm.rank]

    return tuple(share(t) for t in tensors)


def _split_sizes(ids_TK: torch.Tensor, num_experts: int, num_local: int, comm: Comm):
    """(rows sent to each rank, rows received from each rank, received rows per (source rank, local expert))."""
    flat = ids_TK.reshape(-1).long()
    # histc on int32 is not implemented on CPU (notes §1.6); scatter_add works on every device.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add(
        0, flat, torch.ones_like(flat))
    counts_RE = all_gather(counts_E.view(1, num_experts), comm)  # [source rank, global expert]
    recv_RL = counts_RE.view(comm.size, comm.size, num_local)[:, comm.rank, :]
    send_splits = counts_E.view(comm.size, num_local).sum(dim=1)
    recv_splits = recv_RL.sum(dim=1)
    return send_splits.tolist(), recv_splits.tolist(), recv_RL


def run_dynamic(lowering, prepared, weights_TK: torch.Tensor, ids_TK: torch.Tensor, inputs, cfg) -> torch.Tensor:
    torch_npu = import_torch_npu()
    comm = prepared.comm
    num_experts, num_local = cfg.routing.num_experts, inputs.weights.w13.shape[0]
    if num_local * comm.size != num_experts:
        raise ValueError(f"dynamic EP needs evenly partitioned experts, but got num_experts={num_experts}, "
                         f"local experts={num_local}, ep_size={comm.size}")
    x_TH = prepared.x_TH
    on_input = cfg.experts.apply_router_weight_on_input
    if on_input:
        x_TH = x_TH * weights_TK.to(x_TH.dtype)
    num_tokens, top_k = ids_TK.shape
    send, recv, recv_RL = _split_sizes(ids_TK, num_experts, num_local, comm)
    permuted_PH, rev_local_P = torch_npu.npu_moe_token_permute(x_TH, ids_TK, num_out_tokens=num_tokens * top_k)
    received = all_to_all(permuted_PH, recv, send, comm)
    rev_global = None
    if num_local > 1:
        local_ids = torch.arange(comm.size * num_local, device=received.device) % num_local
        local_ids = torch.repeat_interleave(local_ids, recv_RL.reshape(-1)).to(torch.int32)
        received, rev_global = torch_npu.npu_moe_token_permute(received, local_ids)
    y = lowering.mlp(received, recv_RL.sum(dim=0), inputs.weights, cfg.experts)
    if rev_global is not None:
        y = torch_npu.npu_moe_token_unpermute(y, rev_global)  # no probs: the inverse permutation
    returned = all_to_all(y, send, recv, comm)
    # The weights go in the activation dtype, as MindIE-SD passes them (the op's tested form).
    probs = None if on_input else weights_TK.to(returned.dtype)
    out_TH = torch_npu.npu_moe_token_unpermute(returned, rev_local_P, probs=probs)
    if cfg.parallel.tokens_full:
        out_TH = all_gather(out_TH, comm)[: prepared.num_tokens_in]
    # reduce_results does not apply: each token's output is complete on the rank that owns it.
    return out_TH.view(inputs.hidden_states.shape)
