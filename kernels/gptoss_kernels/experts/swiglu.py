"""GPT-OSS's clamped SwiGLU on ``gate_up [N, 2I]`` (gate at even, up at odd columns) → ``[N, I]``.

``h = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)`` (``L = swiglu_limit``),
the same operation order as upstream ``GptOssExperts._apply_gate``, so every variant here gives bit-identical
values for one math dtype.
"""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def math_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Elementwise math and accumulation run in fp32 for half types (more accurate than the upstream loop)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float, math_dtype: torch.dtype | None = None):
    """``h [N, I]`` from ``gate_up [N, 2I]``, computed and returned in ``math_dtype`` (default: the input's).

    ``gate_up`` is left untouched (training saves it for backward).
    """
    math_dtype = math_dtype or gate_up.dtype
    gate = gate_up[..., 0::2].to(math_dtype, copy=True).clamp_(max=limit)
    up_plus_one = gate_up[..., 1::2].to(math_dtype, copy=True).clamp_(min=-limit, max=limit).add_(1)
    glu = gate.mul_(torch.mul(gate, alpha).sigmoid_())
    return up_plus_one.mul_(glu)


# Rows per block of a half-precision eval slice's fp32 gate math: its two fp32 temporaries stay this small
# whatever the slice's rows (2 x 32 x I x 4 bytes, 0.7 MiB at I = 2880).
HALF_MATH_ROWS = 32


def swiglu_clamped_consuming(
    gate_up: torch.Tensor, alpha: float, limit: float, rows_per_block: int = HALF_MATH_ROWS
) -> torch.Tensor:
    """``h [N, I]`` in ``gate_up``'s dtype, consuming ``gate_up [N, 2I]`` (its values are garbage afterwards).

    For eval, where nothing keeps the pre-activations. fp32/fp64: the clamps run in place and the only new
    buffer is ``h``. Half inputs: the math runs in fp32 on blocks of ``rows_per_block`` rows (two fp32
    temporaries of that many rows), and ``h`` is written into ``gate_up``'s own storage (its first ``N*I``
    elements, rows already read): no ``[N, I]`` buffer at all. Same products in the same order as
    ``swiglu_clamped`` (bit-identical).
    """
    math_dtype = math_dtype_for(gate_up.dtype)
    if math_dtype == gate_up.dtype:
        gate = gate_up[..., 0::2].clamp_(max=limit)  # views of gate_up
        up_plus_one = gate_up[..., 1::2].clamp_(min=-limit, max=limit).add_(1)
        # sigmoid(alpha g) * g * (u + 1): the same products as swiglu_clamped, in commuted order.
        return torch.mul(gate, alpha).sigmoid_().mul_(gate).mul_(up_plus_one)
    rows, inter = gate_up.shape[0], gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    h = gate_up.view(-1)[: rows * inter].view(rows, inter)  # row r of h ends before row r+1 of gate_up begins
    for start in range(0, rows, rows_per_block):
        block = gate_up[start : start + rows_per_block]
        gate = block[:, 0::2].to(math_dtype).clamp_(max=limit)
        glu = torch.mul(gate, alpha).sigmoid_().mul_(gate)
        del gate
        glu.mul_(block[:, 1::2].to(math_dtype).clamp_(min=-limit, max=limit).add_(1))
        h[start : start + rows_per_block].copy_(glu)  # only rows <= start + block of gate_up are overwritten
    return h


def swiglu_clamped_with_grad(
    gate_up: torch.Tensor, grad_h: torch.Tensor, alpha: float, limit: float, grad_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_clamped(gate_up)`` ``[N, I]`` (in ``grad_h``'s dtype) and its gradient w.r.t. ``gate_up: [N, 2I]``
    (in ``grad_dtype``, default ``gate_up``'s) given ``grad_h: [N, I]``, sharing one sigmoid.

    With ``s = sigmoid(alpha*g)``, ``glu = g s``: ``dh/dg = (u+1) (s + alpha glu (1-s))``, ``dh/du = glu``; the
    clamps pass the gradient where the input lies in the closed interval (torch's convention: ``gate <= L``,
    ``-L <= up <= L``).
    """
    math_dtype = grad_h.dtype
    raw_gate, raw_up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = raw_gate.to(math_dtype, copy=True).clamp_(max=limit)
    up_plus_one = raw_up.to(math_dtype, copy=True).clamp_(min=-limit, max=limit).add_(1)
    sig = torch.mul(gate, alpha).sigmoid_()
    glu = gate.mul_(sig)
    # Write both halves straight into the interleaved (and possibly lower-precision) gradient buffer.
    d_gate_up = torch.empty(gate_up.shape, dtype=grad_dtype or gate_up.dtype, device=gate_up.device)
    d_gate, d_up = d_gate_up[..., 0::2], d_gate_up[..., 1::2]
    torch.mul(grad_h, glu, out=d_up).masked_fill_(raw_up.abs() > limit, 0)
    d_glu = torch.sub(1, sig).mul_(glu).mul_(alpha).add_(sig)
    torch.mul(d_glu.mul_(grad_h), up_plus_one, out=d_gate).masked_fill_(raw_gate > limit, 0)
    return glu.mul_(up_plus_one), d_gate_up
