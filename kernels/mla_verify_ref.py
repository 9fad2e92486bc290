"""Slow fp32 reference for MLA tree-verify attention (letters as in ``mla_verify.py``)."""

from __future__ import annotations

from typing import Optional

import torch

V_DIM = 512


def tree_mask_rows(mask: Optional[torch.Tensor], layout: str, batch: int, D: int, N: int,
                   d_max: int, mask_indptr: Optional[torch.Tensor],
                   device: torch.device) -> torch.Tensor:
    """[D, D] bool: draft row i may see draft token j, for request ``batch``."""
    if layout == "causal":
        return torch.ones(D, D, dtype=torch.bool, device=device).tril()
    flat = mask.reshape(-1).to(torch.bool)
    if layout == "qlen_only":
        base = int(mask_indptr[batch]) if mask_indptr is not None else batch * d_max * d_max
        return flat[base:base + D * D].view(D, D)
    base = int(mask_indptr[batch])
    return flat[base:base + D * (N + D)].view(D, N + D)[:, N:]


def mla_verify_ref(q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor,
                   kv_pool: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, sm_scale: float, mask: Optional[torch.Tensor] = None,
                   mask_layout: str = "causal", mask_indptr: Optional[torch.Tensor] = None,
                   d_max: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, 512] fp32, lse [T, H] fp32 natural log), computed per request in fp32.

    Same arguments as ``MlaVerify.forward``; every prefix column is visible to every draft row.
    Runs on q's device (fp32 there, so a GPU reference stays exact and fast).
    """
    dev = q.device
    qo = qo_indptr.cpu().tolist()
    kvp = kv_indptr.cpu().tolist()
    d_max = d_max or max(b - a for a, b in zip(qo[:-1], qo[1:]))
    T, H, _ = q.shape
    out = torch.zeros(T, H, V_DIM, dtype=torch.float32, device=dev)
    lse = torch.zeros(T, H, dtype=torch.float32, device=dev)
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        D = q1 - q0
        if D == 0:
            continue
        N = kvp[b + 1] - kvp[b]
        slots = kv_indices[kvp[b]:kvp[b + 1]].long()
        pre = kv_pool[slots, 0].float()  # [N, 576]
        keys = torch.cat([pre, k_ext[q0:q1, 0].float()])  # [N + D, 576]
        vals = torch.cat([pre[:, :V_DIM], v_ext[q0:q1, 0, :V_DIM].float()])
        visible = torch.cat([torch.ones(D, N, dtype=torch.bool, device=dev),
                             tree_mask_rows(mask, mask_layout, b, D, N, d_max, mask_indptr,
                                            dev)], 1)
        qb = q[q0:q1].float()  # [D, H, 576]
        # fp32 matmuls in full precision (no TF32) so the reference stays a reference.
        scores = torch.einsum("dhc,nc->dhn", qb, keys) * sm_scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse[q0:q1] = torch.logsumexp(scores, -1)
        out[q0:q1] = torch.einsum("dhn,nc->dhc", torch.softmax(scores, -1), vals)
    return out, lse
