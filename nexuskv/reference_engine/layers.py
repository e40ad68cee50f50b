"""The reference model's layers. Each token mixer keeps its state in the runtime's page format.

* Attention layers take the cached rows of positions ``[0, start)`` (``[start, width]``, in the
  cache dtype) and return the rows of their new tokens in the same format, so the runtime
  copies rows between pages and layers without knowing what they mean:

  - :class:`GQAAttention` rows are ``K | V`` (K with RoPE applied), ``2 * n_kv_heads * head_dim``;
  - :class:`MLAAttention` rows are ``c_kv | k_rope`` (the latent and the *un-rotated* decoupled
    RoPE key; RoPE is applied at attention time, ``rope_deferred``), ``kv_lora_rank + qk_rope_dim``.

* :class:`RecurrentMixer` takes a flat checkpoint (``recurrent state | conv state``) and returns
  the checkpoint after its last token plus those after each offset it was asked for.

New state is rounded to the cache dtype *before* the layer uses it, as a paged engine writes K/V
to its cache and attends over the cache: so a continuation from cached state computes exactly
what a full prefill computes, in any cache dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nexuskv.reference_engine.rope import apply_rope, rope_angles
from nexuskv.reference_engine.spec import ReferenceModelSpec

__all__ = ["Init", "RMSNorm", "MLP", "GQAAttention", "MLAAttention", "RecurrentMixer"]


class Init:
    """Deterministic weights: every parameter drawn in construction order from one generator."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def linear(self, fan_in: int, fan_out: int) -> nn.Parameter:
        w = torch.randn(fan_in, fan_out, generator=self.gen) / math.sqrt(fan_in)
        return nn.Parameter(w, requires_grad=False)

    def vector(self, n: int, *, mean: float = 0.0, std: float = 1.0) -> nn.Parameter:
        return nn.Parameter(mean + std * torch.randn(n, generator=self.gen), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, init: Init, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = init.vector(dim, mean=1.0, std=0.1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, spec: ReferenceModelSpec, init: Init) -> None:
        super().__init__()
        self.gate = init.linear(spec.d_model, spec.mlp_hidden)
        self.up = init.linear(spec.d_model, spec.mlp_hidden)
        self.down = init.linear(spec.mlp_hidden, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate) * (x @ self.up)) @ self.down


def _causal_attention(scores: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax over keys of ``scores`` ``[H, T, S]``: query t (position start + t) sees keys <= it."""
    t, s = scores.shape[-2], scores.shape[-1]
    q_pos = torch.arange(start, start + t)[:, None]
    k_pos = torch.arange(s)[None, :]
    return torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)


class GQAAttention(nn.Module):
    """Grouped-query attention with RoPE; cached rows are ``K | V``."""

    def __init__(self, spec: ReferenceModelSpec, init: Init, cache_dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.hkv, self.d = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.theta = spec.rope_theta
        self.cache_dtype = cache_dtype
        self.wq = init.linear(spec.d_model, self.h * self.d)
        self.wk = init.linear(spec.d_model, self.hkv * self.d)
        self.wv = init.linear(spec.d_model, self.hkv * self.d)
        self.wo = init.linear(self.h * self.d, spec.d_model)

    @property
    def width(self) -> int:
        return 2 * self.hkv * self.d

    def forward(self, x: torch.Tensor, start: int, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        cos, sin = rope_angles(torch.arange(start, start + t), self.d, self.theta)
        q = apply_rope((x @ self.wq).view(t, self.h, self.d), cos, sin)
        k = apply_rope((x @ self.wk).view(t, self.hkv, self.d), cos, sin)
        v = (x @ self.wv).view(t, self.hkv, self.d)
        rows = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=-1).to(self.cache_dtype)
        cached = torch.cat([past, rows]).to(torch.float32)
        s = cached.shape[0]
        keys = cached[:, : self.hkv * self.d].view(s, self.hkv, self.d)
        values = cached[:, self.hkv * self.d:].view(s, self.hkv, self.d)
        rep = self.h // self.hkv
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        probs = _causal_attention(torch.einsum("thd,shd->hts", q, keys) / math.sqrt(self.d), start)
        out = torch.einsum("hts,shd->thd", probs, values).reshape(t, self.h * self.d)
        return out @ self.wo, rows


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 style, no query compression); rows are ``c_kv | k_rope``."""

    def __init__(self, spec: ReferenceModelSpec, init: Init, cache_dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.r = spec.n_heads, spec.kv_lora_rank
        self.dn, self.dr, self.dv = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
        self.theta = spec.rope_theta
        self.cache_dtype = cache_dtype
        self.wq = init.linear(spec.d_model, self.h * (self.dn + self.dr))
        self.w_dkv = init.linear(spec.d_model, self.r)
        self.kv_norm = RMSNorm(self.r, init)
        self.w_kr = init.linear(spec.d_model, self.dr)
        self.w_uk = init.linear(self.r, self.h * self.dn)
        self.w_uv = init.linear(self.r, self.h * self.dv)
        self.wo = init.linear(self.h * self.dv, spec.d_model)

    @property
    def width(self) -> int:
        return self.r + self.dr

    def forward(self, x: torch.Tensor, start: int, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q = (x @ self.wq).view(t, self.h, self.dn + self.dr)
        cos_q, sin_q = rope_angles(torch.arange(start, start + t), self.dr, self.theta)
        q_nope, q_rope = q[..., : self.dn], apply_rope(q[..., self.dn:], cos_q, sin_q)
        rows = torch.cat([self.kv_norm(x @ self.w_dkv), x @ self.w_kr], dim=-1).to(self.cache_dtype)
        cached = torch.cat([past, rows]).to(torch.float32)
        s = cached.shape[0]
        latent, k_rope_raw = cached[:, : self.r], cached[:, self.r:]
        cos_k, sin_k = rope_angles(torch.arange(s), self.dr, self.theta)
        k_rope = apply_rope(k_rope_raw, cos_k, sin_k)
        k_nope = (latent @ self.w_uk).view(s, self.h, self.dn)
        values = (latent @ self.w_uv).view(s, self.h, self.dv)
        scores = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_rope, k_rope)
        probs = _causal_attention(scores / math.sqrt(self.dn + self.dr), start)
        out = torch.einsum("hts,shd->thd", probs, values).reshape(t, self.h * self.dv)
        return out @ self.wo, rows


class RecurrentMixer(nn.Module):
    """Gated linear attention with a short causal convolution (KDA/Mamba-like); a terminal state.

    Per token: ``u = conv(x W_in)`` (depthwise, kernel ``conv_kernel``, SiLU), then per head
    ``S_t = diag(g_t) S_{t-1} + k_t v_t^T`` and ``o_t = q_t S_t``, with a per-channel decay
    ``g_t = sigmoid(u W_g + b)`` and an L2-normalised ``k_t``. The state after a prefix is
    ``S`` (``[heads, key_dim, value_dim]``) and the last ``conv_kernel - 1`` inputs of the
    convolution: nothing about earlier tokens can be recovered from pages, only from a checkpoint.
    """

    def __init__(self, spec: ReferenceModelSpec, init: Init, cache_dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.dk, self.dv = spec.recurrent_state_shape
        self.kernel, self.c = spec.conv_kernel, spec.d_model
        self.cache_dtype = cache_dtype
        self.w_in = init.linear(spec.d_model, self.c)
        self.conv = nn.Parameter(torch.randn(self.kernel, self.c, generator=init.gen) / math.sqrt(self.kernel),
                                 requires_grad=False)
        self.wq = init.linear(self.c, self.h * self.dk)
        self.wk = init.linear(self.c, self.h * self.dk)
        self.wv = init.linear(self.c, self.h * self.dv)
        self.wg = init.linear(self.c, self.h * self.dk)
        self.g_bias = init.vector(self.h * self.dk, mean=2.5, std=0.5)  # sigmoid(2.5) ~ 0.92: long memory
        self.wo = init.linear(self.h * self.dv, spec.d_model)

    @property
    def width(self) -> int:
        return self.h * self.dk * self.dv + (self.kernel - 1) * self.c

    def empty_state(self) -> torch.Tensor:
        return torch.zeros(self.width, dtype=self.cache_dtype)

    def forward(self, x: torch.Tensor, past: torch.Tensor, checkpoint_at: Sequence[int] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Output, and the flat checkpoint after each of ``checkpoint_at`` tokens of this call."""
        t = x.shape[0]
        n_state = self.h * self.dk * self.dv
        past = past.to(torch.float32)
        state = past[:n_state].view(self.h, self.dk, self.dv).clone()
        # convolution inputs pass through the cache dtype, as the conv state they become does
        new_in = (x @ self.w_in).to(self.cache_dtype).to(torch.float32)
        conv_in = torch.cat([past[n_state:].view(self.kernel - 1, self.c), new_in])
        u = sum(self.conv[j] * conv_in[j: j + t] for j in range(self.kernel))
        u = F.silu(u)
        q = (u @ self.wq).view(t, self.h, self.dk)
        k = F.normalize((u @ self.wk).view(t, self.h, self.dk), dim=-1)
        v = (u @ self.wv).view(t, self.h, self.dv)
        g = torch.sigmoid(u @ self.wg + self.g_bias).view(t, self.h, self.dk)
        wanted = set(checkpoint_at)
        checkpoints: dict[int, torch.Tensor] = {}
        outs = []
        for i in range(t):
            state = g[i, :, :, None] * state + k[i, :, :, None] * v[i, :, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[i], state))
            if i + 1 in wanted:
                conv_state = conv_in[i + 1: i + self.kernel]
                flat = torch.cat([state.reshape(-1), conv_state.reshape(-1)]).to(self.cache_dtype)
                checkpoints[i + 1] = flat
                # continue from the checkpoint as stored, exactly as a later request would
                state = flat[:n_state].to(torch.float32).view(self.h, self.dk, self.dv).clone()
        out = torch.stack(outs).reshape(t, self.h * self.dv) @ self.wo
        return out, checkpoints
