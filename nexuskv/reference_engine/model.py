"""The reference transformer: embedding, pre-norm blocks (token mixer + SwiGLU MLP), LM head.

:meth:`TinyModel.forward` computes tokens ``[start, start + T)`` of a sequence given the state of
``[0, start)``: cached rows per attention layer and a checkpoint per recurrent layer (both in the
page format of :mod:`nexuskv.reference_engine.layers`). It returns the next-token logits of the last
position, the new rows of every attention layer, and the recurrent checkpoints after each
requested boundary. Single sequence, no batching, fp32 compute; the cache dtype is the spec's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nexuskv.descriptor import DType
from nexuskv.reference_engine.layers import MLP, GQAAttention, Init, MLAAttention, RecurrentMixer, RMSNorm
from nexuskv.reference_engine.spec import LayerKind, ReferenceModelSpec, Variant

__all__ = ["TinyModel", "ForwardResult", "TORCH_DTYPES"]

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}


@dataclass(frozen=True, slots=True)
class ForwardResult:
    logits: torch.Tensor  # [vocab] next-token logits after the last position, fp32
    rows: dict[int, torch.Tensor]  # attention layer index -> [T, width] new rows (cache dtype)
    checkpoints: dict[int, dict[int, torch.Tensor]]  # boundary (absolute tokens) -> layer -> flat state


class _Block(nn.Module):
    def __init__(self, spec: ReferenceModelSpec, kind: LayerKind, init: Init, cache_dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(spec.d_model, init)
        if kind is LayerKind.RECURRENT:
            self.mixer: nn.Module = RecurrentMixer(spec, init, cache_dtype)
        elif spec.variant is Variant.MLA:
            self.mixer = MLAAttention(spec, init, cache_dtype)
        else:
            self.mixer = GQAAttention(spec, init, cache_dtype)
        self.norm2 = RMSNorm(spec.d_model, init)
        self.mlp = MLP(spec, init)


class TinyModel(nn.Module):
    """Random weights from ``spec.seed``; the same spec gives the same weights in any process."""

    def __init__(self, spec: ReferenceModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.cache_dtype = TORCH_DTYPES[spec.kv_dtype]
        init = Init(spec.seed)
        self.embed = nn.Parameter(torch.randn(spec.vocab_size, spec.d_model, generator=init.gen), requires_grad=False)
        self.blocks = nn.ModuleList(_Block(spec, kind, init, self.cache_dtype) for kind in spec.layer_kinds)
        self.norm = RMSNorm(spec.d_model, init)
        self.head = init.linear(spec.d_model, spec.vocab_size)
        self.eval()

    def width(self, layer: int) -> int:
        return self.blocks[layer].mixer.width

    def empty_rows(self, layer: int) -> torch.Tensor:
        return torch.empty(0, self.width(layer), dtype=self.cache_dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, rows: Mapping[int, torch.Tensor],
                checkpoints: Mapping[int, torch.Tensor], boundaries: Sequence[int] = ()) -> ForwardResult:
        """Compute ``tokens`` at positions ``[start, start + len(tokens))``.

        ``rows[l]`` holds attention layer l's cached rows for ``[0, start)``; ``checkpoints[l]``
        recurrent layer l's state after ``start`` tokens (absent: the zero state, only at start 0);
        ``boundaries`` are absolute token counts after which recurrent checkpoints are returned.
        """
        t = tokens.shape[0]
        offsets = [b - start for b in boundaries if start < b <= start + t]
        x = self.embed[tokens]
        new_rows: dict[int, torch.Tensor] = {}
        new_ckpts: dict[int, dict[int, torch.Tensor]] = {start + o: {} for o in offsets}
        for i, block in enumerate(self.blocks):
            h = block.norm1(x)
            if block.kind is LayerKind.RECURRENT:
                past = checkpoints.get(i)
                if past is None:
                    if start:
                        raise ValueError(f"layer {i}: recurrent state after {start} tokens is needed")
                    past = block.mixer.empty_state()
                out, ck = block.mixer(h, past, offsets)
                for o, flat in ck.items():
                    new_ckpts[start + o][i] = flat
            else:
                past_rows = rows.get(i, self.empty_rows(i))
                if past_rows.shape[0] != start:
                    raise ValueError(f"layer {i}: {past_rows.shape[0]} cached rows for a start at {start}")
                out, new_rows[i] = block.mixer(h, start, past_rows)
            x = x + out
            x = x + block.mlp(block.norm2(x))
        logits = self.norm(x[-1]) @ self.head
        return ForwardResult(logits=logits, rows=new_rows, checkpoints=new_ckpts)
