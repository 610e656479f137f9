"""The models are torch.nn.Modules: weights are frozen parameters/buffers, hooks fire, counts are
right."""

from __future__ import annotations

import torch

from dynaspec.attention.paged import build_metadata
from dynaspec.models.gemma3 import create_model
from dynaspec.models.loader import load_model_files


def _model(path: str):
    loaded = load_model_files(path)
    return create_model(
        loaded.arch, loaded.state_dict, torch.float32, torch.device("cpu"), 256
    ), loaded


def test_llama_weights_are_frozen_parameters_matching_the_checkpoint(tiny_llama_untied_dir):
    model, loaded = _model(tiny_llama_untied_dir)
    assert isinstance(model, torch.nn.Module) and isinstance(model.layers[0], torch.nn.Module)
    params = dict(model.named_parameters())
    assert params and not any(p.requires_grad for p in params.values())
    # Every float weight of the checkpoint is held once (q|k|v and gate|up fused, the rest as is).
    n_ckpt = sum(t.numel() for t in loaded.state_dict.values())
    assert sum(p.numel() for p in params.values()) == n_ckpt
    assert torch.equal(params["norm"], loaded.state_dict["model.norm.weight"])
    assert torch.equal(
        params["layers.1.ln2"], loaded.state_dict["model.layers.1.post_attention_layernorm.weight"]
    )


def test_layer_forward_hooks_see_every_layer_of_a_step(tiny_llama_dir):
    model, _ = _model(tiny_llama_dir)
    seen = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, args, out, i=i: seen.append((i, out[0].shape)))
    kv = model.allocate_kv(4 * 16)
    md = build_metadata([5], [5], [[0]], 16, torch.device("cpu"))
    ids, pos = torch.arange(3, 8), torch.arange(5)
    model._stack = (
        None  # hooks are a Python-loop feature (the C++ stack runs the layers in one call)
    )
    model.forward(ids, pos, kv, md, torch.tensor([4]))
    assert seen == [(0, torch.Size([5, 64])), (1, torch.Size([5, 64]))]
