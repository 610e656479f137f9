"""Gemma-3 decoder (text) for flat batches over paged KV, behind the same interface as LlamaModel.

What differs from Llama: local layers attend to a sliding window with their own RoPE base and
every `sliding_window_pattern`-th layer is global; q and k get a per-head RMSNorm; each block is
sandwiched (norm -> attention -> norm -> residual, norm -> MLP -> norm -> residual); the MLP is
GELU-tanh gated; the embedding is scaled by sqrt(hidden) and tied to the output; logits may be
soft-capped. Norm weights are used as stored: llama.cpp's converter (and our HF reference in
the tests) already folds Gemma's (1 + w) into the weight.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
import torch.nn.functional as F

from dynaspec.attention.backend import AttentionBackend
from dynaspec.attention.paged import EagerPagedBackend
from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.layers import RotaryCache, SmallOps, keep, rms_norm
from dynaspec.models.llama import LlamaModel
from dynaspec.models.quant import cat_rows
from dynaspec.models.quant_linear import WeightPlan, make_linear

log = logging.getLogger("dynaspec")


class Gemma3Layer(torch.nn.Module):
    # Registered by keep(): (input, post-attention, pre-MLP, post-MLP) norms [hidden] and the
    # q|k norm [H + Hkv, D].
    ln_in: torch.Tensor
    ln_post_attn: torch.Tensor
    ln_pre_mlp: torch.Tensor
    ln_post_mlp: torch.Tensor
    qk_norm: torch.Tensor

    def __init__(
        self, w: dict, cfg: ModelArchConfig, plan: WeightPlan, ops: SmallOps, i: int
    ) -> None:
        super().__init__()
        self.ops = ops
        self.qkv = make_linear(w["qkv"], None, plan)  # [(H + 2*Hkv) * D, hidden]
        self.o = make_linear(w["o"], None, plan)  # [hidden, H * D]
        self.gate_up = make_linear(w["gate_up"], None, plan)  # [2 * inter, hidden]
        self.down = make_linear(w["down"], None, plan)  # [hidden, inter]
        # (input, post-attention, pre-MLP, post-MLP), each [hidden]
        for name, norm in zip(("ln_in", "ln_post_attn", "ln_pre_mlp", "ln_post_mlp"), w["norms"]):
            keep(self, name, norm)
        H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        keep(
            self, "qk_norm", torch.cat([w["q_norm"].expand(H, -1), w["k_norm"].expand(Hkv, -1)])
        )  # [H + Hkv, D]
        self.eps = cfg.rms_norm_eps
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.D ** -0.5
        self.window = cfg.layer_window(i)
        self.local = self.window is not None  # local layers also use the local RoPE base

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        return self.ln_in, self.ln_post_attn, self.ln_pre_mlp, self.ln_post_mlp

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        md,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden]; delta: the previous block's output, not yet added
        (so the add fuses with this layer's input norm). rope: (cos, sin) of this layer's kind."""
        T = x.shape[0]
        ln_in, ln_post_attn, ln_pre_mlp, ln_post_mlp = self.norms
        if delta is None:
            h = self.ops.rms_norm(x, ln_in, self.eps)
        else:
            x, h = self.ops.add_rms_norm(x, delta, ln_in, self.eps)
        qkv = self.qkv(h)  # [T, (H + 2*Hkv) * D]
        heads = self.H + self.Hkv
        v = qkv[:, heads * self.D:].view(T, self.Hkv, self.D)
        qk = qkv[:, : heads * self.D].view(T, heads, self.D)
        # q and k normed in one pass (per-head weights [H + Hkv, D]), written back into qkv so
        # RoPE rotates them in place there, as the Llama layer does.
        qk.copy_(rms_norm(qk, self.qk_norm, self.eps))
        qk = self.ops.rope_qk(qkv, *rope, heads, self.D)  # [T, H + Hkv, D]
        q, k = qk[:, : self.H], qk[:, self.H:]
        if self.window is None:  # global layers call the plain seam (any backend runs them)
            a = attn.forward(q, k, v, kv_cache, md, self.scale)
        else:
            a = attn.forward(q, k, v, kv_cache, md, self.scale, window=self.window)  # [T, H, D]
        o = self.ops.rms_norm(
            self.o(a.reshape(T, self.H * self.D)).contiguous(), ln_post_attn, self.eps
        )
        x, h = self.ops.add_rms_norm(x, o, ln_pre_mlp, self.eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)  # [T, inter] each
        mlp = self.down(F.gelu(gate, approximate="tanh") * up)
        return x, self.ops.rms_norm(mlp.contiguous(), ln_post_mlp, self.eps)


class Gemma3Model(LlamaModel):
    """Gemma-3 text decoder; KV tensors are owned by the caller (same layout as LlamaModel)."""

    ARCHITECTURES = ("gemma3",)

    def __init__(
        self,
        cfg: ModelArchConfig,
        state_dict: dict,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        weights: WeightPlan | None = None,
    ) -> None:
        super().__init__(cfg, state_dict, dtype, device, max_positions, weights)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        self.rope_local = RotaryCache(cfg.head_dim, local_theta, None, max_positions, device)
        # sqrt(hidden) as llama.cpp applies it (a float; HF rounds it to the weight dtype first)
        self.embed_scale = math.sqrt(cfg.hidden_size)

    def _build_layers(self, raw, t, sd: dict, plan: WeightPlan) -> list:
        return [Gemma3Layer(self._gemma_weights(raw, t, i), self.cfg, plan, self.ops, i)
                for i in range(self.cfg.num_hidden_layers)]

    @staticmethod
    def _gemma_weights(raw, t, i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        return {
            "qkv": cat_rows(
                [raw(a + "q_proj.weight"), raw(a + "k_proj.weight"), raw(a + "v_proj.weight")]
            ),
            "o": raw(a + "o_proj.weight"),
            "gate_up": cat_rows([raw(p + "mlp.gate_proj.weight"), raw(p + "mlp.up_proj.weight")]),
            "down": raw(p + "mlp.down_proj.weight"),
            "norms": tuple(
                t(p + n + ".weight")
                for n in (
                    "input_layernorm",
                    "post_attention_layernorm",
                    "pre_feedforward_layernorm",
                    "post_feedforward_layernorm",
                )
            ),
            "q_norm": t(a + "q_norm.weight"),
            "k_norm": t(a + "k_norm.weight"),
        }

    @property
    def attn(self) -> AttentionBackend:
        return self._attn

    @attn.setter
    def attn(self, backend: AttentionBackend) -> None:
        self._attn = windowed_attention(backend)

    def forward_traceable(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          kv_caches: list[torch.Tensor], md, logits_indices: torch.Tensor | None,
                          attn: AttentionBackend, head: bool = True) -> torch.Tensor:
        x = self.embed(input_ids) * self.embed_scale  # [T, hidden]
        ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {
            None: self.rope.lookup(positions, self.dtype)
        }
        if any(layer.local for layer in self.layers):
            ropes["local"] = self.rope_local.lookup(positions, self.dtype)
        delta: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches):
            rope = ropes["local" if layer.local else None]
            x, delta = layer(x, delta, rope, kv, md, attn)
        assert delta is not None  # a model has layers
        if logits_indices is not None:  # None: every token's logits (the fixed-shape path)
            x, delta = x[logits_indices], delta[logits_indices]
        h = self.ops.rms_norm(
            (x + delta).contiguous(), self.norm, self.cfg.rms_norm_eps
        )  # [R, hidden]
        return self.head(h) if head else h

    def head(self, h: torch.Tensor, argmax_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden states [R, hidden] -> float32 logits [R, vocab], soft-capped. Every row
        gets all its logits (argmax_rows is accepted for the model interface and not used)."""
        logits = self.lm_head(h).float()  # [R, vocab]
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def windowed_attention(backend: AttentionBackend) -> AttentionBackend:
    """The backend Gemma-3's layers run on: `backend`, or the eager one where it has no window."""
    # Local layers need the `window` keyword; a backend without it would fail mid-generation.
    if "window" in inspect.signature(backend.forward).parameters:
        return backend
    log.info("attention backend %s has no sliding window; Gemma-3 runs the eager backend",
             getattr(backend, "name", type(backend).__name__))
    return EagerPagedBackend()


def model_attention(cfg: ModelArchConfig, backend: AttentionBackend) -> AttentionBackend:
    """The backend the model `create_model(cfg, ...)` runs its layers on when given `backend`
    (known before the model is built: the tree setting depends on it)."""
    return windowed_attention(backend) if cfg.architecture == "gemma3" else backend


def create_model(cfg: ModelArchConfig, state_dict: dict, dtype: torch.dtype, device: torch.device,
                 max_positions: int, weights: WeightPlan | None = None) -> LlamaModel:
    """The model class for an architecture (every class has LlamaModel's interface)."""
    cls = Gemma3Model if cfg.architecture == "gemma3" else LlamaModel
    return cls(cfg, state_dict, dtype, device, max_positions, weights)
