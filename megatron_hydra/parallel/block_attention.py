"""Attention over one block of keys, returning its log-sum-exp, and the matching backward.

Context-parallel ring attention sees the keys one block at a time. Each block's output is only a
partial softmax; what makes partial outputs mergeable is the log-sum-exp of each query row's
scores (``lse = log sum_j exp(s_j)``): ``merge_into`` combines them exactly (online softmax). In
backward the block's share of the gradient is FlashAttention's recomputation given the *final*
output and lse (Dao 2023): ``P = exp(S*scale - lse)``, ``D = rowsum(dO*O)``, ``dV = P^T dO``,
``dS = P*(dO V^T - D)``, ``dQ = dS K*scale``, ``dK = dS^T Q*scale``; with the final lse, ``P``
is the block's slice of the full softmax, so the block gradients sum to the full ones.

Torch's fused kernels already return the lse and take it back, so each device uses its own:
the CPU flash kernel, an accelerator's memory-efficient kernel (every device that is not the CPU
takes the GPU's path), and plain torch (one block's scores materialised) for the shapes and
dtypes that kernel does not take. Keys and values come with as many heads as the queries.

A block may also carry an additive ``mask`` ([b or 1, 1, sq, sk], 0 or -inf: documents of a
packed sequence, a sliding window), which replaces ``causal``. On a GPU a masked block takes the
plain-torch kernels: the memory-efficient kernel's bias has alignment rules of its own, and
nothing here has checked them on a GPU.

Soft-capping (``softcap`` c, Gemma 2) bends the scores before the mask: ``S = c tanh(QK^T scale / c)``.
No fused kernel takes it, so a capped block runs the plain-torch kernels on every device; its
backward is the chain rule through the tanh: with ``t = tanh(QK^T scale / c)``, the scores'
gradient ``dS`` becomes ``dS (1 - t^2)`` before ``dQ`` and ``dK`` (which carry ``scale`` as ever).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_FUSED_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial outputs and lse add up: float64 stays, anything narrower works in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_with_lse(q, k, v, causal: bool, scale: float, mask=None, softcap=None):
    """(out, lse): ``out`` [b, h, sq, d] in q's dtype, ``lse`` [b, h, sq] in the accumulation
    dtype. ``causal`` is top-left aligned (query i sees keys 0..i). ``mask``: additive, in q's
    dtype, instead of ``causal``; a row it masks entirely gets out 0 and lse -inf (so merging
    it changes nothing) where the kernel would leave lse 0. ``softcap``: the scores' cap, or None."""
    if mask is None:
        return _kernels(q, capped=softcap is not None)[0](q, k, v, causal, scale, softcap=softcap)
    out, lse = _kernels(q, masked=True, capped=softcap is not None)[0](q, k, v, False, scale, mask, softcap=softcap)
    empty = (mask == float("-inf")).all(-1)  # [b or 1, 1, sq]
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def attention_with_lse_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None, softcap=None):
    """(dq, dk, dv) of this block, given the final ``out`` and ``lse`` of the rows (and the
    block's ``mask`` and ``softcap``, if it had them)."""
    kernel = _kernels(q, masked=mask is not None, capped=softcap is not None)[1]
    if mask is None:
        return kernel(dout, q, k, v, out, lse, causal, scale, softcap=softcap)
    return kernel(dout, q, k, v, out, lse, False, scale, mask, softcap=softcap)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running ones, in place (``out``/``lse`` may be views
    of the rows the block covers): the rows' softmax is rescaled to the combined normaliser. A row
    still empty on both sides (lse -inf, out 0) stays so, rather than turning NaN."""
    total = torch.logaddexp(lse, block_lse)
    norm = total.masked_fill(total == float("-inf"), 0)
    out.mul_(torch.exp(lse - norm).unsqueeze(-1)).add_(torch.exp(block_lse - norm).unsqueeze(-1) * block_out)
    lse.copy_(total)


def _kernels(q: torch.Tensor, masked: bool = False, capped: bool = False):
    if capped:
        return _math_forward, _math_backward
    if q.device.type == "cpu":
        return _cpu_forward, _cpu_backward
    if not masked and q.dtype in _FUSED_GPU_DTYPES and q.shape[-1] % 8 == 0:
        return _efficient_forward, _efficient_backward
    return _math_forward, _math_backward


def _cpu_forward(q, k, v, causal, scale, mask=None, softcap=None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _efficient_forward(q, k, v, causal, scale, softcap=None):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse.narrow(-1, 0, q.shape[2])  # the kernel pads lse's rows to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, causal, scale, softcap=None):
    # lse padded back to the forward's layout; without dropout the random-state tensors are unread.
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))
    unused = torch.empty((), dtype=torch.long)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _scores(q, k, causal, scale, mask=None, softcap=None):
    """(scores, t): the block's scores in the accumulation dtype, capped and masked; ``t`` the
    tanh of the capped ones (what their backward needs), None without a cap."""
    acc = accumulation_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if mask is not None:
        s = s + mask.to(acc)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s, t


def _math_forward(q, k, v, causal, scale, mask=None, softcap=None):
    s, _ = _scores(q, k, causal, scale, mask, softcap)
    lse = s.logsumexp(-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    s, t = _scores(q, k, causal, scale, mask, softcap)
    p = torch.exp(s - lse.unsqueeze(-1))
    dout = dout.to(p.dtype)
    delta = (dout * out.to(p.dtype)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.to(p.dtype).transpose(-2, -1)) - delta)
    if t is not None:  # through the cap: d(c tanh(x/c))/dx = 1 - t^2
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, k.to(p.dtype)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(p.dtype)) * scale
    dv = torch.matmul(p.transpose(-2, -1), dout)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
