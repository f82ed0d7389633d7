"""Causal depthwise conv1d with per-request conv state, in torch (see ``sitecustomize``):
the contract of SGLang's ``causal_conv1d_fn`` / ``causal_conv1d_update``. A slot's state
holds a request's last ``width - 1`` inputs; the pool is addressed by slot index through
whatever strides its tensor has."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _conv(xx: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation) -> torch.Tensor:
    """xx [B, dim, width - 1 + L] (state, then L inputs) -> [B, dim, L], in float32."""
    b = None if bias is None else bias.to(torch.float32)
    y = F.conv1d(xx, weight.to(torch.float32).unsqueeze(1), b, groups=xx.shape[1])
    return F.silu(y) if activation in ("silu", "swish") else y


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    conv_states: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    **_: object,
) -> torch.Tensor:
    """Prefill: x [dim, tokens of every request] -> same shape; each request continues its
    slot's state when ``has_initial_state`` says it has one, and leaves its last inputs there."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        slot = int(cache_indices[i])
        if has_initial_state is not None and bool(has_initial_state[i]):
            init = conv_states[slot].to(torch.float32)
        else:
            init = torch.zeros((x.shape[0], width - 1), dtype=torch.float32, device=x.device)
        xx = torch.cat([init, x[:, s:e].to(torch.float32)], dim=1)
        out[:, s:e] = _conv(xx.unsqueeze(0), weight, bias, activation)[0].to(x.dtype)
        conv_states[slot] = xx[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    **_: object,
) -> torch.Tensor:
    """Decode: x [B, dim] (or [B, dim, L]), a request per row, each with its slot's state."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    width = weight.shape[1]
    idx = conv_state_indices.long()
    xx = torch.cat([conv_state[idx].to(torch.float32), xs.to(torch.float32)], dim=-1)
    y = _conv(xx, weight, bias, activation).to(x.dtype)
    conv_state[idx] = xx[..., -(width - 1) :].to(conv_state.dtype)
    return y.squeeze(-1) if squeeze else y
