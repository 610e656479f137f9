"""Llama-family decoder (Llama incl. llama3 RoPE, SmolLM2, Qwen2, Qwen3) for flat batches over paged
KV.

Projections are fused at load time (q|k|v into one matrix, gate|up into one) so a layer is
three matmuls plus the attention: fewer, larger ops is what pays on the CPU at batch 1.
"""

from __future__ import annotations

from typing import Any

import torch

from dynaspec.attention.backend import AttentionBackend
from dynaspec.attention.paged import EagerPagedBackend
from dynaspec.model_arch import ModelArchConfig
from dynaspec.models import huge_pages
from dynaspec.models.int8_dot import Int8DotHead, Int8DotLinear, output_head
from dynaspec.models.layers import FusedOps, RotaryCache, SmallOps, apply_rope, keep, rms_norm
from dynaspec.models.quant import cat_rows
from dynaspec.models.quant_linear import WeightPlan, make_embedding, make_linear, make_lm_head
from dynaspec.models.weight_arena import place_weights

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class DecoderLayer(torch.nn.Module):
    ln1: torch.Tensor  # [hidden], registered by keep()
    ln2: torch.Tensor
    q_norm: torch.Tensor | None  # [D]; both or neither (Qwen3)
    k_norm: torch.Tensor | None

    def __init__(self, w: dict, cfg: ModelArchConfig, plan: WeightPlan, ops: SmallOps) -> None:
        super().__init__()
        self.ops = ops
        self.qkv = make_linear(w["qkv"], w.get("qkv_bias"), plan)  # [(H + 2*Hkv) * D, hidden]
        self.o = make_linear(w["o"], None, plan)  # [hidden, H * D]
        self.gate_up = make_linear(w["gate_up"], None, plan)  # [2 * inter, hidden]
        self.down = make_linear(w["down"], None, plan)  # [hidden, inter]
        for name in ("ln1", "ln2", "q_norm", "k_norm"):  # [hidden] / [D]; q/k norms only on Qwen3
            keep(self, name, w.get(name))
        self.eps = cfg.rms_norm_eps
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.D ** -0.5

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        md,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden]; delta: the previous layer's MLP output, not yet
        added (so the add fuses with this layer's norm). Returns (residual, this MLP's output)."""
        T = x.shape[0]
        if delta is None:
            h = self.ops.rms_norm(x, self.ln1, self.eps)
        else:
            x, h = self.ops.add_rms_norm(x, delta, self.ln1, self.eps)
        qkv = self.qkv(h)  # [T, (H + 2*Hkv) * D]
        v = qkv[:, (self.H + self.Hkv) * self.D:].view(T, self.Hkv, self.D)
        if self.q_norm is not None:
            assert self.k_norm is not None
            qk = qkv[:, : (self.H + self.Hkv) * self.D].view(T, self.H + self.Hkv, self.D)
            qk = torch.cat((rms_norm(qk[:, : self.H], self.q_norm, self.eps),
                            rms_norm(qk[:, self.H:], self.k_norm, self.eps)), dim=1)
            qk = apply_rope(qk, cos, sin)  # [T, H + Hkv, D]
        else:  # q and k rotated in one pass, in place in qkv on the fused path: [T, H + Hkv, D]
            qk = self.ops.rope_qk(qkv, cos, sin, self.H + self.Hkv, self.D)
        q, k = qk[:, : self.H], qk[:, self.H:]
        a = attn.forward(q, k, v, kv_cache, md, self.scale)  # [T, H, D]
        x, h = self.ops.add_rms_norm(x, self.o(a.reshape(T, self.H * self.D)), self.ln2, self.eps)
        return x, self.down(self.ops.silu_and_mul(self.gate_up(h)))


class LlamaModel(torch.nn.Module):
    """Weights and forward; KV tensors are owned by the caller and passed in per step.

    state_dict values are float tensors or, for weights kept quantized, QuantizedTensors;
    `weights` says which kernels they become (default: dense, the reference path). Float
    weights are frozen parameters, packed kernel layouts buffers; the kernels are built for the
    device and dtype given here, so the model is not meant to be moved with `.to()` after load.
    """

    ARCHITECTURES: tuple[str, ...] = SUPPORTED_ARCHITECTURES  # a subclass names its own
    norm: torch.Tensor  # [hidden], registered by keep()

    def __init__(
        self,
        cfg: ModelArchConfig,
        state_dict: dict,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        weights: WeightPlan | None = None,
    ) -> None:
        if cfg.architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {cfg.architecture!r} for {type(self).__name__}: "
                f"supported are {', '.join(self.ARCHITECTURES)}"
            )
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.weights = plan = weights or WeightPlan("none", 0, dtype, device)
        sd = state_dict

        def raw(name: str):  # a matrix as loaded: the kernel factory converts it
            if name not in sd:
                raise ValueError(f"missing tensor {name!r} in the checkpoint")
            return sd[name]

        def t(name: str) -> torch.Tensor:  # a vector (norm weight, bias) in the compute dtype
            return raw(name).to(device=device, dtype=dtype).contiguous()

        tied = cfg.tie_word_embeddings or "lm_head.weight" not in sd
        self.embed, head = make_embedding(raw("model.embed_tokens.weight"), plan, tied)
        self.lm_head = output_head(
            head if tied else make_lm_head(raw("lm_head.weight"), plan),
            getattr(self.embed, "table", None) if tied else None,
        )  # [vocab, hidden]
        keep(self, "norm", t("model.norm.weight"))  # [hidden]
        # The fused small ops run wherever the C++ kernels build (fp32 too: same rounding).
        self.ops: SmallOps = FusedOps(enabled=device.type == "cpu")
        if device.type == "cuda":  # one Triton kernel per small op (models/gpu_ops.py)
            try:
                from dynaspec.models.gpu_ops import TritonFusedOps

                self.ops = TritonFusedOps()
            except ImportError:  # no Triton: the eager ops
                pass
        self.layers = torch.nn.ModuleList(self._build_layers(raw, t, sd, plan))
        self.rope = RotaryCache(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device
        )
        self.attn: AttentionBackend = EagerPagedBackend()  # used when forward() is given none
        place_weights(self, Int8DotLinear)  # before the C++ layer stack takes the tensors
        self._stack = layer_stack(self)  # all layers in one C++ call, where every part is C++
        # Hidden states an EAGLE-style drafter reads: the residual stream after each listed
        # number of layers (num_hidden_layers: the final normed state). Empty: nothing captured,
        # nothing paid. After a forward, aux_hidden holds them for every token [T, len * hidden].
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def _build_layers(self, raw, t, sd: dict, plan: WeightPlan) -> list:
        """The decoder layers from the checkpoint (`raw`: a matrix as loaded, `t`: a vector in
        the compute dtype); the architecture-specific part of construction."""
        return [DecoderLayer(self._layer_weights(raw, t, sd, i), self.cfg, plan, self.ops)
                for i in range(self.cfg.num_hidden_layers)]

    @staticmethod
    def _layer_weights(raw, t, sd: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w = {
            "qkv": cat_rows(
                [raw(a + "q_proj.weight"), raw(a + "k_proj.weight"), raw(a + "v_proj.weight")]
            ),
            "o": raw(a + "o_proj.weight"),
            "gate_up": cat_rows([raw(p + "mlp.gate_proj.weight"), raw(p + "mlp.up_proj.weight")]),
            "down": raw(p + "mlp.down_proj.weight"),
            "ln1": t(p + "input_layernorm.weight"),
            "ln2": t(p + "post_attention_layernorm.weight"),
        }
        if a + "q_proj.bias" in sd:
            w["qkv_bias"] = torch.cat(
                [t(a + "q_proj.bias"), t(a + "k_proj.bias"), t(a + "v_proj.bias")]
            )
        if a + "q_norm.weight" in sd:
            w["q_norm"], w["k_norm"] = t(a + "q_norm.weight"), t(a + "k_norm.weight")
        return w

    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode forward reads, in the kernels' formats (quantized bytes
        where weights are quantized): the bandwidth floor of a decode step."""
        # The kernel modules (layers.KernelModule subclasses), each with its nbytes.
        mats: list[Any] = [self.lm_head]
        for layer in self.layers:
            mats += (layer.qkv, layer.o, layer.gate_up, layer.down)
        return sum(m.nbytes for m in mats)

    def allocate_kv(self, num_slots: int) -> list[torch.Tensor]:
        c = self.cfg
        # Huge pages: decode attention reads blocks scattered over the whole pool (see huge_pages).
        shape = (2, num_slots, c.num_key_value_heads, c.head_dim)
        n = c.num_hidden_layers
        return [huge_pages.zeros(shape, self.dtype, self.device) for _ in range(n)]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md,
        logits_indices: torch.Tensor,
        attn: AttentionBackend | None = None,
        argmax_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; logits_indices: [R]; md: the metadata `attn` built for this
        step (default backend: eager paged SDPA); argmax_rows: [R] bool, rows read only for their
        argmax (see `head`). Returns float32 logits [R, vocab]."""
        h = self.forward_traceable(input_ids, positions, kv_caches, md, logits_indices,
                                   self.attn if attn is None else attn, head=False)
        return self.head(h, argmax_rows)

    def head(self, h: torch.Tensor, argmax_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden states [R, hidden] -> float32 logits [R, vocab]. Rows flagged in
        argmax_rows may get exact logits only near their maximum (Int8DotHead)."""
        if argmax_rows is not None and isinstance(self.lm_head, Int8DotHead):
            return self.lm_head(h, argmax_rows)
        return self.lm_head(h).float()

    def forward_traceable(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          kv_caches: list[torch.Tensor], md, logits_indices: torch.Tensor | None,
                          attn: AttentionBackend, head: bool = True) -> torch.Tensor:
        """`forward` without inference mode, which torch.compile cannot trace through while the
        step writes the KV cache in place; compiled callers run it under `torch.no_grad()`.
        head=False: the normed hidden states [R, hidden] instead of the logits."""
        x = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rope.lookup(positions, self.dtype)
        if (
            self._stack is not None
            and attn.name == "cpu_paged"
            and not torch.compiler.is_compiling()
        ):
            T = x.shape[0]  # the same kernels in the same order as the loop below, bit for bit
            args = (
                x,
                cos.reshape(T, -1),
                sin.reshape(T, -1),
                kv_caches,
                md.slot_mapping,
                md.block_tables,
                md.context_lens,
                md.query_start,
                md.query_lens,
                md.block_size,
                self.layers[0].scale,
                md.tree_mask,  # a draft tree's visibility among its rows, or None (causal)
            )
            if self.aux_layers:
                inner = [i for i in self.aux_layers if i < self.cfg.num_hidden_layers]
                x, delta, got = self._stack.forward_capture(*args, inner)
                self.aux_hidden = self._aux(dict(zip(inner, got)), x, delta)
            else:
                x, delta = self._stack.forward(*args)
        else:
            delta, feats = None, {}
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                if (
                    i in self.aux_layers
                ):  # the stream entering layer i (x is updated in place: a copy)
                    feats[i] = x.clone() if delta is None else x + delta
                x, delta = layer(x, delta, cos, sin, kv, md, attn)  # Module call: hooks fire
            if self.aux_layers:
                self.aux_hidden = self._aux(feats, x, delta)
        if logits_indices is not None:  # None: every token's logits (the fixed-shape path)
            x, delta = x[logits_indices], delta[logits_indices]
        h = self.ops.rms_norm(x + delta, self.norm, self.cfg.rms_norm_eps)  # [R, hidden]
        return self.lm_head(h).float() if head else h

    def _aux(self, feats: dict, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The captured streams in aux_layers order: [T, len(aux_layers) * hidden]."""
        n = self.cfg.num_hidden_layers
        if n in self.aux_layers:  # the final normed state (EAGLE-1 reads it)
            feats[n] = self.ops.rms_norm(x + delta, self.norm, self.cfg.rms_norm_eps)
        return torch.cat([feats[i] for i in self.aux_layers], dim=-1)


def layer_stack(model: LlamaModel):
    """The C++ LayerStack for this model's layers, or None where some part of a layer is not on
    the int8dot + fused-ops path (bias, QK-norm, another kernel): those run the Python loop."""
    ext = model.ops.ext
    if (
        ext is None
        or not hasattr(ext, "LayerStack")
        or model.dtype not in (torch.bfloat16, torch.float32)
    ):
        return None
    layers: list[object] = []
    for layer in model.layers:
        if type(layer) is not DecoderLayer:  # another architecture's layer (Gemma-3): its own loop
            return None
        mats = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if layer.q_norm is not None or not all(
            isinstance(m, Int8DotLinear) and m.bias is None for m in mats
        ):
            return None
        q = [
            ext.QLinear(m.packed, m.scales, m.mins, m.out_features, m.group_size, m.bits)
            for m in mats
        ]
        layers.append(ext.Layer(*q, layer.ln1, layer.ln2))
    first = model.layers[0]
    return ext.LayerStack(layers, first.H, first.Hkv, first.D, first.eps)
