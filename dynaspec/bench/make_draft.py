"""Write a same-vocabulary draft model: the target's first N layers, its final norm and head.

The default model has no smaller sibling with its tokenizer on this machine, so the draft
benchmark uses this layer-truncated copy (a self-speculative "early exit" draft): it shares the
vocabulary by construction and costs about N/L of a target forward.

    python -m dynaspec.bench.make_draft --model default --layers 8 --out /tmp/smollm2-draft8
"""

from __future__ import annotations

import argparse
import json
import os

from safetensors.torch import save_file

from dynaspec.models.loader import load_model_files

_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def make_layer_draft(model: str, num_layers: int, out: str) -> str:
    loaded = load_model_files(model)
    a = loaded.arch
    if not 1 <= num_layers <= a.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {a.num_hidden_layers}], got {num_layers}")
    os.makedirs(out, exist_ok=True)
    keep = {}
    for name, t in loaded.state_dict.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        keep[name] = t.contiguous()
    save_file(keep, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [_ARCH_CLASS[a.architecture]], "model_type": a.architecture,
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": "lm_head.weight" not in keep, "hidden_act": "silu",
        "attention_bias": a.attention_bias,
    }
    tok = loaded.tokenizer
    _write(out, "config.json", config)
    _write(out, "generation_config.json", {"eos_token_id": list(loaded.eos_token_ids)})
    _write(out, "tokenizer_config.json", {"chat_template": tok.chat_template,
                                          "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                                          "add_bos_token": bool(tok.add_bos_token)})
    tok.backend.save(os.path.join(out, "tokenizer.json"))
    return out


def _write(folder: str, name: str, data: dict) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="default")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    print(make_layer_draft(args.model, args.layers, args.out))


if __name__ == "__main__":
    main()
