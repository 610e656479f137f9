"""Qwen2 (q/k/v bias) and Qwen3 (q/k norm) from GGUF files written in the test: F32 files give
transformers' logits; quantized files (Q8_0/Q5_0/Q5_1/Q4_1 from gguf-py's quantizer, and a
Q4_K_M-like mix of random K-quant blocks) kept quantized give exactly the logits of the same
file dequantized by gguf-py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from dynaspec.attention.paged import build_metadata
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.models.quant import QuantizedTensor
from tests.conftest import _build, write_tiny_gguf
from tests.model.test_kquants import random_blocks

CPU = torch.device("cpu")


def _logits(state_dict: dict, arch, ids: torch.Tensor) -> torch.Tensor:
    model = LlamaModel(arch, state_dict, torch.float32, CPU, 128)
    n = len(ids)
    md = build_metadata([n], [n], [list(range(8))], 16, CPU)
    return model.forward(ids, torch.arange(n), model.allocate_kv(8 * 16), md, torch.arange(n))


def _ids(vocab: int, n: int = 40) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_qwen_f32_gguf_matches_transformers(fixture, request, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = request.getfixturevalue(fixture)
    loaded = load_model_files(write_tiny_gguf(hf_dir, str(tmp_path / "f32.gguf")))
    assert loaded.arch.architecture == fixture.split("_")[1]
    ids = _ids(loaded.arch.vocab_size)
    with torch.no_grad():
        ref = (
            AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            .eval()(ids[None])
            .logits[0]
        )
    torch.testing.assert_close(
        _logits(loaded.state_dict, loaded.arch, ids), ref, atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_1])
def test_qwen_quantized_gguf_equals_its_dequantized_reference(fixture, qtype, request, tmp_path):
    path = write_tiny_gguf(
        request.getfixturevalue(fixture), str(tmp_path / "q.gguf"), tensor_type=qtype
    )
    kept, dense = load_model_files(path, keep_quantized=True), load_model_files(path)
    assert isinstance(kept.state_dict["model.layers.0.mlp.down_proj.weight"], QuantizedTensor)
    ids = _ids(kept.arch.vocab_size)
    torch.testing.assert_close(_logits(kept.state_dict, kept.arch, ids),
                               _logits(dense.state_dict, dense.arch, ids), atol=1e-5, rtol=1e-5)


# A Q4_K_M-like recipe: most matrices Q4_K, v and down Q6_K, o Q5_K (so q|k|v mixes kinds).
_K_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def _with_k_quants(f32_path: str, out: str) -> str:
    """Copy a GGUF, replacing each layer matrix by random blocks of its _K_MIX type."""
    reader = gguf.GGUFReader(f32_path)
    writer = gguf.GGUFWriter(out, "qwen3")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0] if field.types else None
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for i, t in enumerate(reader.tensors):
        kind = _K_MIX.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if kind is None:
            writer.add_tensor(t.name, np.array(t.data).reshape(list(reversed(t.shape.tolist()))))
        else:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            writer.add_tensor(
                t.name, random_blocks(kind, rows, cols, seed=i), raw_dtype=getattr(T, kind)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_k_quant_mix_keeps_4_bit_and_equals_dequantized_reference(tmp_path_factory, tmp_path):
    # K-quants need rows of 256: a wider Qwen3 than the shared fixtures.
    hf_dir = _build(tmp_path_factory, "qwen3_wide", "qwen3", hidden_size=256, intermediate_size=512,
                    head_dim=64, eos=[2, 0])
    path = _with_k_quants(
        write_tiny_gguf(hf_dir, str(tmp_path / "f32.gguf")), str(tmp_path / "k.gguf")
    )
    kept, dense = load_model_files(path, keep_quantized=True), load_model_files(path)
    sd = kept.state_dict
    assert sd["model.layers.0.mlp.gate_proj.weight"].kind == "q4"  # Q4_K stays 4-bit
    assert (
        sd["model.layers.0.mlp.down_proj.weight"].kind,
        sd["model.layers.0.mlp.down_proj.weight"].group_size,
    ) == ("q8", 16)
    ids = _ids(kept.arch.vocab_size)
    ref = _logits(dense.state_dict, dense.arch, ids)
    torch.testing.assert_close(_logits(sd, kept.arch, ids), ref, atol=1e-4, rtol=1e-4)
    assert ref.std() > 1e-3  # random blocks still make a model whose logits vary
