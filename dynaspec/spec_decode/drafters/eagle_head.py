"""An EAGLE-style draft head: one small decoder layer on the target's hidden states (DESIGN §4b).

Two published forms run here, both on the head's own small KV:
- eagle3: the target's hidden states after a low, a middle and a high layer, concatenated and
  fused by `fc` to one vector h; the layer attends over [norm(embed(token)), hidden_norm(h)]
  (2H wide), keeps h as its residual, and a final norm + a lm_head over a reduced draft
  vocabulary (d2t maps draft ids to target ids) give the logits.
- eagle1: the target's final (normed) hidden state and the token embedding concatenated and
  fused by `fc` (with bias), then Llama decoder layer(s) (the first without input norm); the
  target's own lm_head gives the logits.
At head position t the input is (the target's features at t, the embedding of token t+1) and
the output predicts token t+2; chained, the head's output at t stands in for the target's
features at t+1. Weights are fp32 (the head is ~1/15 of the target; fp32 keeps training exact).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dynaspec.models.layers import RotaryCache, apply_rope, rms_norm


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle3" | "eagle1"
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # eagle1: = vocab_size (the target's lm_head)
    aux_layers: tuple[int, ...]  # target features read: the stream after that many layers
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted (key, value) pairs of the rope_scaling dict
    num_layers: int = 1  # decoder layers (eagle3: always 1)
    max_positions: int = 8192

    @property
    def feature_size(self) -> int:
        """Width of the target features one position carries ([len(aux_layers) * target hidden])."""
        return len(self.aux_layers) * self.target_hidden_size


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice (as vLLM and SGLang make it): the stream entering layers 2, N/2 and N-3
    (clamped into 0..N-1 for targets of fewer than 5 layers)."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3))


class HeadLayer(nn.Module):
    """One decoder layer of the head; `wide` (eagle3) attends over [embedding | hidden] (2H)."""

    def __init__(self, c: HeadConfig, wide: bool, input_norm: bool) -> None:
        super().__init__()
        H, Hq, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        n_in = 2 * H if wide else H
        self.wide, self.eps, self.Hq, self.Hkv, self.D = wide, c.rms_norm_eps, Hq, Hkv, D
        self.q_proj = nn.Linear(n_in, Hq * D, bias=False)
        self.k_proj = nn.Linear(n_in, Hkv * D, bias=False)
        self.v_proj = nn.Linear(n_in, Hkv * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        # eagle3: input_layernorm norms the embedding, hidden_norm the fused features;
        # eagle1: input_layernorm norms the input (absent on the first layer, as published).
        self.input_layernorm = nn.Parameter(torch.ones(H)) if input_norm or wide else None
        self.hidden_norm = nn.Parameter(torch.ones(H)) if wide else None
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections (the drafting form)
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one linear each: a chained draft runs one row through the layer,
        where each linear is a kernel call (with its activation quantization) costing more than
        its arithmetic. Same outputs: a row of the fused weight is the row it came from."""
        def joined(*lins: nn.Linear) -> nn.Linear:
            out = nn.Linear(lins[0].in_features, sum(x.out_features for x in lins), bias=False)
            out.weight.data = torch.cat([x.weight.detach() for x in lins])
            return out

        self.qkv_proj = joined(self.q_proj, self.k_proj, self.v_proj)
        self.gate_up_proj = joined(self.gate_proj, self.up_proj)
        del self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj

    def qkv(self, h: torch.Tensor, emb: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h, emb: [..., H]; cos/sin: [..., 1, D/2]. Returns q [..., Hq, D], k, v [..., Hkv, D]."""
        if self.wide:  # eagle3: both norms exist and the embedding is given
            assert emb is not None and self.input_layernorm is not None
            assert self.hidden_norm is not None
            x = torch.cat(
                (
                    rms_norm(emb, self.input_layernorm, self.eps),
                    rms_norm(h, self.hidden_norm, self.eps),
                ),
                -1,
            )
        else:
            x = h if self.input_layernorm is None else rms_norm(h, self.input_layernorm, self.eps)
        lead = x.shape[:-1]
        if self.qkv_proj is not None:
            nq, nkv = self.Hq * self.D, self.Hkv * self.D
            qx, kx, vx = self.qkv_proj(x).split((nq, nkv, nkv), -1)
        else:
            qx, kx, vx = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rope(qx.reshape(*lead, self.Hq, self.D), cos, sin)
        k = apply_rope(kx.reshape(*lead, self.Hkv, self.D), cos, sin)
        return q, k, vx.reshape(*lead, self.Hkv, self.D)

    def finish(self, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """attn: [..., Hq, D] attention output; h: the residual [..., H]. Returns the layer
        output."""
        x = h + self.o_proj(attn.flatten(-2))
        m = rms_norm(x, self.post_attention_layernorm, self.eps)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(m).chunk(2, -1)
        else:
            gate, up = self.gate_proj(m), self.up_proj(m)
        return x + self.down_proj(F.silu(gate) * up)


class EagleHead(nn.Module):
    draft_to_target: torch.Tensor  # a registered buffer, see __init__

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.cfg = c
        wide = c.kind == "eagle3"
        if c.kind not in ("eagle3", "eagle1"):
            raise ValueError(f"unknown head kind {c.kind!r}: eagle3 or eagle1")
        fc_in = c.feature_size if wide else c.hidden_size + c.target_hidden_size
        self.fc = nn.Linear(fc_in, c.hidden_size, bias=not wide)
        self.layers = nn.ModuleList(
            HeadLayer(c, wide, input_norm=i > 0) for i in range(c.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(c.hidden_size)) if wide else None
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) if wide else None
        # draft id -> target id ([draft_vocab] long); the identity for eagle1.
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size))
        self.rope = RotaryCache(
            c.head_dim,
            c.rope_theta,
            dict(c.rope_scaling) if c.rope_scaling else None,
            c.max_positions,
            torch.device("cpu"),
        )

    def fuse(self, features: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input hidden from target features [..., feature_size] (eagle1: with the
        token embeddings [..., H], concatenated embedding first as published)."""
        if self.cfg.kind == "eagle3":
            return self.fc(features)
        assert emb is not None  # eagle1 reads the token embeddings
        return self.fc(torch.cat((emb, features), -1))

    def logits(self, out: torch.Tensor, target_head: torch.nn.Module | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] from layer outputs [..., H]."""
        if self.lm_head is not None:
            assert self.norm is not None  # eagle3 has both
            return self.lm_head(rms_norm(out, self.norm, self.cfg.rms_norm_eps))
        assert target_head is not None  # eagle1 reads the target's lm_head
        return target_head(out.to(target_head_dtype(target_head))).float()

    # -- training: whole sequences, with EAGLE-3's training-time unrolling ----------------------

    def unrolled(
        self, features: torch.Tensor, emb: torch.Tensor, passes: int
    ) -> list[torch.Tensor]:
        """Layer outputs of `passes` chained drafting passes over sequences (single-layer heads).

        features: [B, T, feature_size] target features at positions 0..T-1; emb: [B, T, H] the
        embeddings of tokens 1..T (row s holds token s+1). Pass 1 row s reads the target's
        features at s; pass k > 1 row s reads pass k-1's output at s-1, as drafting step k reads
        the head's own previous output at inference, and attends to pass 1's keys up to s-k+1
        (the verified part) plus the keys pass m wrote at s-k+m (its own earlier drafts).
        Returns [B, T, H] per pass; row s of pass k predicts token s+2 (rows s < k-1 are unused).
        """
        layer = self.layers[0]
        assert isinstance(layer, HeadLayer)
        B, T, _ = emb.shape
        pos = torch.arange(T, device=emb.device)
        cos, sin = self.rope.lookup(pos, emb.dtype)  # [T, 1, D/2]
        h = self.fuse(features, emb)
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        s = pos[:, None]
        j = torch.arange(T, device=emb.device)[None, :]
        for k in range(1, passes + 1):
            if k > 1:  # row s takes the previous pass's output at s-1 (row 0 has none: zeros)
                h = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            q, kk, vv = layer.qkv(h, emb, cos, sin)  # [B, T, Hq|Hkv, D]
            keys.append(kk)
            vals.append(vv)
            blocks = [j <= s - k + 1] + [j == s - k + m for m in range(2, k + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, k*T]
            K = torch.cat(keys, 1).transpose(1, 2)  # [B, Hkv, k*T, D]
            V = torch.cat(vals, 1).transpose(1, 2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask,
                                               enable_gqa=True)  # [B, Hq, T, D]
            outs.append(layer.finish(a.transpose(1, 2), h))
        return outs


class _RowsLinear(nn.Module):
    """A kernel linear taking [..., K] as nn.Linear does (the kernel takes [M, K])."""

    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x.reshape(-1, x.shape[-1]).float())  # [M, N] fp32
        return y.reshape(*x.shape[:-1], y.shape[-1])


def drafting_form(head: EagleHead) -> EagleHead:
    """The head as the drafter runs it on CPU: each linear on the engine's int8 kernel (weights
    in groups of 32 with their own scales, as Q8_0), a copy; the trained head stays fp32.

    In fp32 one chained draft read ~35 MB of weights (the 8,192-row draft lm_head alone 19 MB)
    and took ~3 ms on 2 cores, 0.7x of a target step, so the goodput policy rightly never
    drafted with it; int8 reads a quarter of that through the kernel the target uses. Drafts
    only propose: verification decides every token, so their precision cannot change output.
    Without the kernels (not built, or a shape they do not take) a linear stays fp32."""
    from dynaspec.models.int8_dot import Int8DotLinear, quantize_grouped_int8, supports

    fast = copy.deepcopy(head)
    for layer in fast.layers:
        assert isinstance(layer, HeadLayer)
        layer.fuse_projections()
    for mod in list(fast.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                w = quantize_grouped_int8(child.weight.detach())
                if supports(w):
                    bias = None if child.bias is None else child.bias.detach().float()
                    setattr(mod, name, _RowsLinear(Int8DotLinear(w, bias)))
    return fast


class HeadStep(Protocol):
    """csrc/head_step.cpp's HeadStep: catch-up and a whole greedy chain of the head in one
    call; `draft` returns the drafts [B, max k] (its arguments: EagleProposer._compiled_draft)."""

    def draft(self, *args: object) -> torch.Tensor: ...


def compiled_step(head: EagleHead) -> HeadStep | None:
    """The drafting-form head's layer and its greedy drafts as one C++ call each
    (csrc/head_step.cpp: fc, catch-up and the whole chain in one call), or None where the head
    is not on that path: eagle1 (the target's lm_head), several layers, or a linear left fp32."""
    from dynaspec.models.int8_dot import Int8DotLinear, _ext

    ext = _ext()
    if ext is None or not hasattr(ext, "HeadStep") or head.cfg.kind != "eagle3" \
            or len(head.layers) != 1:
        return None
    layer = head.layers[0]
    assert isinstance(layer, HeadLayer)
    lins = [head.fc, layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj,
            head.lm_head]
    kern: list[Int8DotLinear] = []
    for m in lins:
        k = m.lin if isinstance(m, _RowsLinear) else None
        if not (isinstance(k, Int8DotLinear) and k.bias is None):
            return None
        kern.append(k)
    q = [ext.QLinear(k.packed, k.scales, k.mins, k.out_features, k.group_size, k.bits)
         for k in kern]
    vecs = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)
    norms = [t.detach().float().contiguous() for t in vecs if t is not None]
    if len(norms) != len(vecs):  # eagle3 has all four
        return None
    c = head.cfg
    return ext.HeadStep(*q, *norms, head.draft_to_target.long().contiguous(),
                        c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps)


def target_head_dtype(head: torch.nn.Module) -> torch.dtype:
    """The activation dtype a target lm_head kernel takes (its parameters' or buffers' float
    dtype)."""
    for t in list(head.parameters()) + list(head.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32
