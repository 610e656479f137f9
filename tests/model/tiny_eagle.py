"""Tiny random EAGLE heads written in the published layouts (EAGLE-3 and EAGLE-1), for tests."""

from __future__ import annotations

import json
import os

import torch


def _save(out: str, sd: dict, config: dict, fmt: str) -> str:
    os.makedirs(out, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors")
        )
    else:
        torch.save(sd, os.path.join(out, "pytorch_model.bin"))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out


def write_eagle3(out: str, *, hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 96,
                 vocab: int = 288, draft_vocab: int = 64, target_hidden: int = 64, n_aux: int = 3,
                 fmt: str = "safetensors", seed: int = 0, prefix: str = "midlayer.",
                 aux: list[int] | None = None, scale: float = 0.1) -> str:
    """An EAGLE-3 head: fc over n_aux target layers, a 2H-wide attention, d2t/t2d maps."""
    g = torch.Generator().manual_seed(seed)
    D = hidden // heads

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    sd = {
        "fc.weight": r(hidden, n_aux * target_hidden),
        prefix + "input_layernorm.weight": 1 + r(hidden),
        prefix + "hidden_norm.weight": 1 + r(hidden),
        prefix + "post_attention_layernorm.weight": 1 + r(hidden),
        prefix + "self_attn.q_proj.weight": r(heads * D, 2 * hidden),
        prefix + "self_attn.k_proj.weight": r(kv_heads * D, 2 * hidden),
        prefix + "self_attn.v_proj.weight": r(kv_heads * D, 2 * hidden),
        prefix + "self_attn.o_proj.weight": r(hidden, heads * D),
        prefix + "mlp.gate_proj.weight": r(inter, hidden),
        prefix + "mlp.up_proj.weight": r(inter, hidden),
        prefix + "mlp.down_proj.weight": r(hidden, inter),
        "norm.weight": 1 + r(hidden),
        "lm_head.weight": r(draft_vocab, hidden) * 10,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_hidden_layers": 1,
    }
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    return _save(out, sd, config, fmt)


def write_eagle1(
    out: str,
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    inter: int = 96,
    vocab: int = 288,
    layers: int = 1,
    fmt: str = "bin",
    seed: int = 0,
    scale: float = 0.1,
    copy: bool = False,
) -> str:
    """An EAGLE-1 head: fc [H, 2H] with bias, Llama layers (layer 0 without input_layernorm).

    copy: fc passes the embedding through and every layer adds nothing (o_proj, down_proj 0), so
    the head's output is the embedding of its input token and the target's tied lm_head drafts
    that token again: what a tiny random tied target's greedy does (it repeats its input), so
    drafts are accepted and the accept path is exercised."""
    g = torch.Generator().manual_seed(seed)
    D = hidden // heads

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    sd = {"fc.weight": r(hidden, 2 * hidden), "fc.bias": r(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": r(heads * D, hidden),
                p + "self_attn.k_proj.weight": r(kv_heads * D, hidden),
                p + "self_attn.v_proj.weight": r(kv_heads * D, hidden),
                p + "self_attn.o_proj.weight": r(hidden, heads * D),
                p + "mlp.gate_proj.weight": r(inter, hidden),
                p + "mlp.up_proj.weight": r(inter, hidden),
                p + "mlp.down_proj.weight": r(hidden, inter),
                p + "post_attention_layernorm.weight": 1 + r(hidden),
            }
        )
        if i > 0:
            sd[p + "input_layernorm.weight"] = 1 + r(hidden)
        if copy:
            sd[p + "self_attn.o_proj.weight"].zero_()
            sd[p + "mlp.down_proj.weight"].zero_()
    if copy:
        sd["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        sd["fc.bias"].zero_()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    return _save(out, sd, config, fmt)
