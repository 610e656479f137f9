"""EAGLE heads on disk: the published EAGLE-1 and EAGLE-3 layouts, read and (EAGLE-3) written.

A head folder holds config.json and model.safetensors or pytorch_model.bin:
- EAGLE-3: fc.weight [H, 3*Ht]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
  .weight; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj; midlayer.mlp.{gate,up,down}_proj;
  norm.weight; lm_head.weight [draft_vocab, H]; d2t [draft_vocab] (target id = draft id + d2t);
  t2d [vocab] (bool, which target ids the draft vocabulary holds). config.json: hidden_size,
  draft_vocab_size, vocab_size, optionally target_hidden_size and
  eagle_config.eagle_aux_hidden_state_layer_ids. Some exports name the layer `layers.0.`.
- EAGLE-1: fc.weight [H, 2H] + fc.bias; layers.{i}.* as a Llama layer (layer 0 has no
  input_layernorm); the target's embedding and lm_head are used.
A head that does not fit the target is refused here, naming the field and both values.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from dynaspec.model_arch import ModelArchConfig
from dynaspec.spec_decode.drafters.eagle_head import EagleHead, HeadConfig, default_aux_layers

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class HeadMismatchError(ValueError):
    """The head's shapes or config do not fit the target model."""


def read_weights(path: str) -> dict[str, torch.Tensor]:
    shards = sorted(glob.glob(os.path.join(path, "model-*-of-*.safetensors")))
    if shards and not os.path.isfile(os.path.join(path, WEIGHT_FILES[0])):
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for s in shards:
            sd.update(load_file(s))
        return sd
    for name in WEIGHT_FILES:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(f)
            return torch.load(f, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"draft head {path!r} has none of {', '.join(WEIGHT_FILES)}")


def _layer_prefix(sd: dict) -> str:
    return "midlayer." if any(k.startswith("midlayer.") for k in sd) else "layers.0."


def head_config(path: str, sd: dict, target: ModelArchConfig,
                max_positions: int = 0) -> HeadConfig:
    """The head's config from its config.json and tensor shapes, checked against the target."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    if "fc.weight" not in sd:
        raise HeadMismatchError(f"draft head {path!r} has no fc.weight: not an EAGLE head")
    p = _layer_prefix(sd)
    H = c.get("hidden_size", sd["fc.weight"].shape[0])
    q_in = sd[p + "self_attn.q_proj.weight"].shape[1]
    kind = "eagle3" if q_in == 2 * H else "eagle1"
    heads = c.get("num_attention_heads", target.num_attention_heads)
    eagle = c.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")
    if kind == "eagle1":
        aux = (target.num_hidden_layers,)
    aux = tuple(int(i) for i in (aux or default_aux_layers(target.num_hidden_layers)))
    n_layers = (
        1
        if kind == "eagle3"
        else 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    )
    scaling = c.get("rope_scaling")
    hc = HeadConfig(
        kind=kind,
        hidden_size=H,
        target_hidden_size=int(c.get("target_hidden_size") or target.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or H // heads,
        intermediate_size=sd[p + "mlp.gate_proj.weight"].shape[0],
        vocab_size=c.get("vocab_size", target.vocab_size),
        draft_vocab_size=sd["lm_head.weight"].shape[0] if kind == "eagle3" else target.vocab_size,
        aux_layers=aux,
        rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=c.get("rope_theta", 10000.0),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        num_layers=n_layers,
        # RoPE is defined at any position: cover every one the engine may run (past the
        # target's table under --allow-long-max-model-len), not the target's trained length.
        max_positions=max(target.max_position_embeddings, max_positions),
    )
    check_fits(hc, sd, target, path)
    return hc


def check_fits(c: HeadConfig, sd: dict, target: ModelArchConfig, path: str) -> None:
    """Refuse a head whose shapes do not fit the target, naming what differs."""
    def need(what: str, got: object, want: object) -> None:
        if got != want:
            raise HeadMismatchError(
                f"draft head {path!r} does not fit the target model: {what} is {got}, "
                f"the target needs {want}"
            )

    need("config vocab_size", c.vocab_size, target.vocab_size)
    need("target_hidden_size", c.target_hidden_size, target.hidden_size)
    if "embed_tokens.weight" not in sd:  # the target's embedding feeds the head
        need(
            "hidden_size (the head uses the target's embedding)", c.hidden_size, target.hidden_size
        )
    else:
        need(
            "embed_tokens.weight shape",
            tuple(sd["embed_tokens.weight"].shape),
            (target.vocab_size, c.hidden_size),
        )
    bad = [i for i in c.aux_layers if not 0 <= i <= target.num_hidden_layers]
    if bad:
        raise HeadMismatchError(
            f"draft head {path!r} does not fit the target model: aux hidden-state layer ids "
            f"{bad} are outside the target's 0..{target.num_hidden_layers}"
        )
    fc_in = c.feature_size if c.kind == "eagle3" else c.hidden_size + c.target_hidden_size
    need("fc.weight shape", tuple(sd["fc.weight"].shape), (c.hidden_size, fc_in))
    if c.kind == "eagle3":
        need("lm_head.weight columns", sd["lm_head.weight"].shape[1], c.hidden_size)
        if "d2t" in sd:
            need("d2t length (draft vocabulary)", sd["d2t"].shape[0], c.draft_vocab_size)
            ids = torch.arange(c.draft_vocab_size) + sd["d2t"].long()
            if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
                raise HeadMismatchError(
                    f"draft head {path!r} does not fit the target model: d2t maps draft ids "
                    f"to target ids outside 0..{target.vocab_size - 1}"
                )
        elif c.draft_vocab_size != target.vocab_size:
            raise HeadMismatchError(
                f"draft head {path!r} has a {c.draft_vocab_size}-token draft vocabulary "
                f"but no d2t map to the target's {target.vocab_size} ids"
            )
        if "t2d" in sd:
            need("t2d length (target vocabulary)", sd["t2d"].shape[0], target.vocab_size)


def _renames(c: HeadConfig, p: str) -> dict[str, str]:
    """Checkpoint name -> our module's name."""
    names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias"}
    for i in range(c.num_layers):
        src = p if c.kind == "eagle3" else f"layers.{i}."
        for proj in ("q", "k", "v", "o"):
            names[f"{src}self_attn.{proj}_proj.weight"] = f"layers.{i}.{proj}_proj.weight"
        for proj in ("gate", "up", "down"):
            names[f"{src}mlp.{proj}_proj.weight"] = f"layers.{i}.{proj}_proj.weight"
        for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            names[f"{src}{norm}.weight"] = f"layers.{i}.{norm}"
    if c.kind == "eagle3":
        names.update({"norm.weight": "norm", "lm_head.weight": "lm_head.weight"})
    return names


def load_head(path: str, target: ModelArchConfig, max_positions: int = 0
              ) -> tuple[EagleHead, torch.Tensor | None]:
    """(the head in fp32, its own embedding table or None to use the target's). max_positions:
    the positions the engine may run, drafts included (0: the target's trained length)."""
    sd = read_weights(path)
    c = head_config(path, sd, target, max_positions)
    head = EagleHead(c)
    own = head.state_dict()
    loaded = {}
    for src, dst in _renames(c, _layer_prefix(sd)).items():
        if src in sd:
            need = own[dst].shape
            if tuple(sd[src].shape) != tuple(need):
                raise HeadMismatchError(
                    f"draft head {path!r}: {src} has shape {tuple(sd[src].shape)}, "
                    f"expected {tuple(need)} from its config"
                )
            loaded[dst] = sd[src].float()
    missing = [k for k in own if k not in loaded and k != "draft_to_target"]
    if missing:
        raise HeadMismatchError(
            f"draft head {path!r} lacks {', '.join(missing)} (as our module names them)"
        )
    if c.kind == "eagle3" and "d2t" in sd:
        loaded["draft_to_target"] = torch.arange(c.draft_vocab_size) + sd["d2t"].long()
    else:
        loaded["draft_to_target"] = torch.arange(c.draft_vocab_size)
    head.load_state_dict(loaded)
    head.requires_grad_(False).eval()
    emb = sd["embed_tokens.weight"].float() if "embed_tokens.weight" in sd else None
    return head, emb


def save_eagle3(
    head: EagleHead, path: str, dtype: torch.dtype = torch.float16, extra: dict | None = None
) -> None:
    """Write an eagle3 head in the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    c = head.cfg
    os.makedirs(path, exist_ok=True)
    inv = {dst: src for src, dst in _renames(c, "midlayer.").items()}
    sd = {
        inv[k]: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items() if k in inv
    }
    d2t = head.draft_to_target.long()
    sd["d2t"] = (d2t - torch.arange(c.draft_vocab_size)).contiguous()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    sd["t2d"] = t2d
    save_file(sd, os.path.join(path, "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": c.max_positions,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)},
    }
    cfg.update(extra or {})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def shard_safetensors(path: str, max_bytes: int) -> list[str]:
    """Split a safetensors file into model-0000i-of-0000n.safetensors beside it, each at most
    about max_bytes of tensor data (whole tensors; read_weights joins them), removing the
    original; a file already small enough is left as it is. Returns the files."""
    from safetensors.torch import load_file, save_file

    if os.path.getsize(path) <= max_bytes:
        return [path]
    sd = load_file(path)
    groups: list[dict] = [{}]
    size = 0
    for k in sorted(sd, key=lambda k: -sd[k].numel() * sd[k].element_size()):
        nbytes = sd[k].numel() * sd[k].element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][k] = sd[k]
        size += nbytes
    folder, n = os.path.dirname(path), len(groups)
    out = [os.path.join(folder, f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
    for g, f in zip(groups, out):
        save_file(g, f)
    os.remove(path)
    return out
