"""A plain-torch Llama for the draft head's data on an accelerator: thousands of sequences at
once, for greedy answers (left-padded prompts, a static KV cache) and teacher-forced features
(the streams the head reads, and the target's greedy choice at every position).

It is not the engine's model: no paged KV, no scheduler, one fixed batch from prefill to the
last token. That is what makes 10^5 answers take a minute or two on one GPU, where the engine
(built for serving) would spend most of it scheduling. Weights come from dynaspec's own loader
(a GGUF dequantized to float32, then cast), so the target is the model the head will draft for.
Equal to dynaspec's LlamaModel in float32 (tests/train/test_batched_llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.layers import rms_norm, rope_inv_freq


@dataclass(frozen=True)
class Features:
    """Teacher-forced outputs over a right-padded batch."""

    aux: torch.Tensor  # [B, T, A*H] the streams entering the aux layers, concatenated
    greedy: torch.Tensor  # [B, T] the target's argmax after each position


class BatchedLlama:
    """Llama weights on one device in one dtype; q|k|v and gate|up fused per layer."""

    def __init__(self, arch: ModelArchConfig, state_dict: dict, device: str | torch.device,
                 dtype: torch.dtype) -> None:
        if arch.architecture != "llama":
            raise ValueError(
                f"BatchedLlama runs llama-architecture targets, not {arch.architecture!r}"
            )
        self.cfg, self.device, self.dtype = arch, torch.device(device), dtype

        def w(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed_w = w("model.embed_tokens.weight")  # [V, H]
        self.lm_w = w("lm_head.weight") if "lm_head.weight" in state_dict else self.embed_w
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(arch.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": w(p + "input_layernorm.weight"),
                "ln2": w(p + "post_attention_layernorm.weight"),
                "qkv": torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                "o": w(p + "self_attn.o_proj.weight"),
                "gu": torch.cat([w(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]),
                "down": w(p + "mlp.down_proj.weight"),
            })
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        freqs = torch.outer(torch.arange(arch.max_position_embeddings, dtype=torch.float32), inv)
        self.cos = freqs.cos().to(self.device)  # [max_pos, D/2] fp32
        self.sin = freqs.sin().to(self.device)

    # -- pieces the head's trainer also uses (draft_head.new_head reads cfg, embed, norm) -------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_w[ids]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream [..., H] -> logits [..., V] in the model dtype."""
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps) @ self.lm_w.T

    # -- one layer --------------------------------------------------------------------------

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, S] -> cos, sin [B, S, 1, D/2] in the model dtype (once per forward: a decode
        step is bound by its kernel launches)."""
        return self.cos[pos].unsqueeze(2).to(self.dtype), self.sin[pos].unsqueeze(2).to(self.dtype)

    def _qkv(self, layer: dict, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [B, S, H], rope from _rope -> q [B, Hq, S, D], k, v [B, Hkv, S, D] (RoPE applied)."""
        c = self.cfg
        B, S, _ = x.shape
        D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        qkv = rms_norm(x, layer["ln1"], c.rms_norm_eps) @ layer["qkv"].T
        q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), -1)
        cos, sin = rope

        def rotate(t: torch.Tensor, heads: int) -> torch.Tensor:
            t1, t2 = t.view(B, S, heads, D).chunk(2, -1)
            return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), -1).transpose(1, 2)

        return rotate(q, Hq), rotate(k, Hkv), v.view(B, S, Hkv, D).transpose(1, 2)

    def _finish(self, layer: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, Hq, S, D] -> the layer's output stream [B, S, H]."""
        x = x + attn.transpose(1, 2).flatten(2) @ layer["o"].T
        gate, up = (rms_norm(x, layer["ln2"], self.cfg.rms_norm_eps) @ layer["gu"].T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ layer["down"].T

    def _group(self) -> int:
        return self.cfg.num_attention_heads // self.cfg.num_key_value_heads

    # -- teacher forcing ----------------------------------------------------------------------

    @torch.no_grad()  # not inference mode: the head's training saves these for backward
    def features(self, ids: torch.Tensor, aux_layers: tuple[int, ...]) -> Features:
        """ids [B, T] right-padded (padding only after a row's tokens: causal rows never read
        it). The stream entering layer i for each i in aux_layers (the engine's capture), and the
        greedy choice after each position."""
        B, T = ids.shape
        rope = self._rope(torch.arange(T, device=ids.device).expand(B, T))
        x = self.embed(ids)  # [B, T, H]
        feats = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                feats[i] = x
            q, k, v = self._qkv(layer, x, rope)
            g = self._group()
            a = F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
            )
            x = self._finish(layer, x, a)
        greedy = torch.cat([self.logits(x[b: b + 8]).argmax(-1) for b in range(0, B, 8)])
        return Features(torch.cat([feats[i] for i in aux_layers], -1), greedy)

    # -- greedy generation -----------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, eos_ids: tuple[int, ...]
                 ) -> list[list[int]]:
        """Greedy answers (each up to and including its first EOS, at most max_new tokens).

        Prompts are left-padded to the longest, so step t writes one cache column for all rows;
        a padded row's own padding attends to itself only (a row with every key masked would
        make NaN values the real rows then multiply by zero weight: still NaN)."""
        c, dev = self.cfg, self.device
        B, P = len(prompts), max(len(p) for p in prompts)
        Tmax = P + max_new
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        ids = torch.zeros(B, P, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p)
        start = P - lens  # [B] first real column
        col = torch.arange(Tmax, device=dev)
        valid = col[None, :] >= start[:, None]  # [B, Tmax] keys a row may read
        pos = (torch.arange(P, device=dev)[None, :] - start[:, None]).clamp(min=0)  # [B, P]
        shape = (B, c.num_key_value_heads, Tmax, c.head_dim)
        kc = [torch.empty(shape, device=dev, dtype=self.dtype) for _ in self.layers]
        vc = [torch.empty(shape, device=dev, dtype=self.dtype) for _ in self.layers]
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)
        x = self.embed(ids)
        g = self._group()
        rope = self._rope(pos)
        for layer, K, V in zip(self.layers, kc, vc):
            q, k, v = self._qkv(layer, x, rope)
            K[:, :, :P], V[:, :, :P] = k, v
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                               v.repeat_interleave(g, 1), attn_mask=mask[:, None])
            x = self._finish(layer, x, a)
        tok = self.logits(x[:, -1]).argmax(-1)  # [B]
        eos = torch.tensor(eos_ids or (-1,), device=dev)
        out = torch.empty(B, max_new, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        n = 0
        for t in range(max_new):
            out[:, t] = tok
            done |= torch.isin(tok, eos)
            n = t + 1
            if t + 1 == max_new or ((t + 1) % 8 == 0 and bool(done.all())):
                break
            tok = self._decode_step(tok, lens + t, P + t, kc, vc, valid)
        rows = out[:, :n].tolist()
        return [r[: next((i + 1 for i, x in enumerate(r) if x in eos_ids), n)] for r in rows]

    def _decode_step(self, tok: torch.Tensor, pos: torch.Tensor, slot: int, kc: list,
                     vc: list, valid: torch.Tensor) -> torch.Tensor:
        """One token per row at cache column `slot`: tok [B], pos [B] -> the next tokens [B].
        The query heads sharing a KV head ride as rows of one attention over it (no copies of
        the cache per query head)."""
        c = self.cfg
        B, g = tok.shape[0], self._group()
        x = self.embed(tok)[:, None]  # [B, 1, H]
        mask = valid[:, None, None, : slot + 1]  # [B, 1, 1, slot+1]
        rope = self._rope(pos[:, None])
        for layer, K, V in zip(self.layers, kc, vc):
            q, k, v = self._qkv(layer, x, rope)  # q [B, Hq, 1, D]
            K[:, :, slot], V[:, :, slot] = k[:, :, 0], v[:, :, 0]
            qg = q.view(B, c.num_key_value_heads, g, c.head_dim)
            a = F.scaled_dot_product_attention(qg, K[:, :, : slot + 1], V[:, :, : slot + 1],
                                               attn_mask=mask)  # [B, Hkv, g, D]
            x = self._finish(layer, x, a.reshape(B, c.num_attention_heads, 1, c.head_dim))
        return self.logits(x[:, 0]).argmax(-1)
