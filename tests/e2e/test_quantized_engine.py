"""The engine on quantized weights: flags resolve, kernels are used, decode runs and is reported."""

from __future__ import annotations

import json

import gguf
import pytest

from dynaspec.cli.main import main
from dynaspec.llm import LLM
from dynaspec.models.int8_dot import Int8DotLinear
from dynaspec.models.quant_linear import QuantLinear
from dynaspec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def q41_gguf(tiny_llama_dir, make_tiny_gguf, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("q41") / "tiny-q4_1.gguf"
    return make_tiny_gguf(tiny_llama_dir, str(out), tensor_type=gguf.GGMLQuantizationType.Q4_1)


@pytest.mark.parametrize("kernel, cls", [("auto", Int8DotLinear), ("torch", QuantLinear)])
def test_engine_keeps_gguf_weights_quantized_and_decodes(q41_gguf, kernel, cls):
    llm = LLM(
        model=q41_gguf,
        num_kv_blocks=64,
        speculator="ngram",
        num_spec_tokens=3,
        linear_kernel=kernel,
    )
    model = llm.engine.parts.model
    assert model.weights.mode == "auto" and isinstance(model.layers[0].gate_up, cls)
    out = llm.generate(
        [[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 12


def test_quantization_none_and_fp32_run_the_reference_path(q41_gguf):
    llm = LLM(model=q41_gguf, num_kv_blocks=64, dtype="float32")  # auto -> none: kernels need bf16
    assert llm.engine.parts.model.weights.mode == "none"
    with pytest.raises(ValueError, match="int4 cannot run here"):
        LLM(model=q41_gguf, num_kv_blocks=64, dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(model=q41_gguf, num_kv_blocks=64, quantization="int3")


def test_bench_decode_reports_quantized_bytes_and_cpu(q41_gguf, capsys):
    args = [
        "bench",
        "decode",
        "--model",
        q41_gguf,
        "--batch-sizes",
        "1,2",
        "--context-lens",
        "8,16",
        "--gen-tokens",
        "4",
        "--num-kv-blocks",
        "64",
    ]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["quantization"] == "auto" and data["cpu"]
    assert [(r["batch"], r["context"]) for r in data["results"]] == [
        (1, 8),
        (2, 8),
        (1, 16),
        (2, 16),
    ]
    assert main(args + ["--quantization", "none", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["weight_bytes_per_step"] < 0.6 * dense["weight_bytes_per_step"]
