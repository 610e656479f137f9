"""Gemma-3 from GGUF: metadata -> config, logits equal to transformers' Gemma3ForCausalLM on the
same weights (prefill and step-by-step decode over a paged cache, past the sliding window),
and the file's SentencePiece vocabulary tokenizing like sentencepiece itself."""

from __future__ import annotations

import gguf
import pytest
import torch

from dynaspec.attention.paged import build_metadata
from dynaspec.models.gemma3 import Gemma3Model, create_model
from dynaspec.models.loader import load_model_files, load_tokenizer
from dynaspec.models.quant import QuantizedTensor
from tests.model.tiny_gemma3 import WINDOW, build_tiny_gemma3

CPU = torch.device("cpu")
BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")))


def _model(path: str) -> Gemma3Model:
    loaded = load_model_files(path)
    return create_model(loaded.arch, loaded.state_dict, torch.float32, CPU, 64)


def _forward(model, ids: list[int], start: int, kv, table: list[int]) -> torch.Tensor:
    """Logits of every token in ids, which sit at positions start.. of one request."""
    n = len(ids)
    md = build_metadata([n], [start + n], [table], BS, CPU)
    return model.forward(torch.tensor(ids), torch.arange(start, start + n), kv, md, torch.arange(n))


def test_gemma3_metadata_becomes_the_config(tiny):
    arch = load_model_files(tiny[0]).arch
    assert arch.architecture == "gemma3" and arch.qk_norm and arch.tie_word_embeddings
    assert (arch.sliding_window, arch.sliding_window_pattern, arch.rope_local_theta) == (
        WINDOW,
        6,
        10000.0,
    )
    assert [arch.layer_window(i) for i in range(7)] == [WINDOW] * 5 + [None, WINDOW]
    assert arch.rope_theta == 1e6 and arch.final_logit_softcapping is None


def test_gemma3_logits_match_transformers_prefill_and_decode(tiny):
    path, hf, _ = tiny
    ids = [2, 17, 45, 99, 120, 7, 64, 230, 31, 18, 77, 150, 201, 9]  # 14 tokens: 3.5 windows
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [14, vocab]
    model = _model(path)
    table = list(range(8))
    kv = model.allocate_kv(len(table) * BS)
    torch.testing.assert_close(_forward(model, ids, 0, kv, table), ref, rtol=1e-4, atol=1e-4)
    # Prefill 5, then one token at a time: the window must slide over the paged cache.
    kv = model.allocate_kv(len(table) * BS)
    steps = [_forward(model, ids[:5], 0, kv, table)]
    steps += [_forward(model, [t], p, kv, table) for p, t in enumerate(ids[5:], start=5)]
    torch.testing.assert_close(torch.cat(steps), ref, rtol=1e-4, atol=1e-4)


def test_gemma3_window_matters_in_this_model(tiny):
    # Guards the parity test: without windows the logits past the window differ.
    path, hf, _ = tiny
    ids = list(range(10, 24))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model = _model(path)
    for layer in model.layers:
        layer.window = None
    table = list(range(8))
    got = _forward(model, ids, 0, model.allocate_kv(len(table) * BS), table)
    torch.testing.assert_close(got[:WINDOW], ref[:WINDOW], rtol=1e-4, atol=1e-4)
    assert (got[WINDOW + 1:] - ref[WINDOW + 1:]).abs().max() > 1e-2


def test_gemma3_quantized_file_keeps_its_blocks(tmp_path):
    path, _, _ = build_tiny_gemma3(
        str(tmp_path), tensor_type=gguf.GGMLQuantizationType.Q5_0, name="q5.gguf"
    )
    kept = load_model_files(path, keep_quantized=True).state_dict
    dense = load_model_files(path).state_dict
    q = kept["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedTensor) and (q.kind, q.group_size) == ("q8", 32)
    for name, t in kept.items():
        got = t.dequantize() if isinstance(t, QuantizedTensor) else t
        torch.testing.assert_close(got, dense[name], rtol=1e-6, atol=1e-7, msg=name)


SPM_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "  two spaces,\n\nthree\n\n\nnewlines",
    "Ünïcödé café 日本語 😀 and bytes \x01",
    "12345 67890 the the of",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_gguf_tokenizer_matches_sentencepiece(tiny, text):
    path, _, sp = tiny
    tok = load_tokenizer(path)
    # sentencepiece knows nothing of control tokens in text: compare piece runs between them
    parts = text.replace("<start_of_turn>", "\0S\0").replace("<end_of_turn>", "\0E\0").split("\0")
    want = [2]
    for part in parts:
        if part in ("S", "E"):
            want.append(tok.token_to_id("<start_of_turn>" if part == "S" else "<end_of_turn>"))
        elif part:
            want += sp.encode(part)
    assert tok.encode(text) == want
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == tok.bos_token + text


def test_spm_bos_and_template(tiny):
    tok = load_tokenizer(tiny[0])
    assert tok.encode("hi")[0] == 2 and tok.encode("hi", add_special_tokens=False)[0] != 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == tok.bos_token + "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt)
    assert ids.count(2) == 1  # the template's BOS, not a second one


def test_backend_without_window_falls_back_to_eager(tiny):
    from dynaspec.attention.paged import EagerPagedBackend

    class NoWindow:  # a backend of the old seam: forward(q, k, v, kv_cache, md, scale)
        name = "old"

        def forward(self, q, k, v, kv_cache, md, scale):
            raise AssertionError("must not run a windowed layer")

    model = _model(tiny[0])
    model.attn = NoWindow()
    assert isinstance(model.attn, EagerPagedBackend)


@pytest.fixture(scope="module")
def gemma_270m() -> str:
    from dynaspec.models.default_model import gemma3_270m_path
    from dynaspec.models.loader import ModelLoadError

    try:
        return gemma3_270m_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def test_real_gemma3_270m_keeps_its_q4_k_tensors_4_bit(gemma_270m):
    loaded = load_model_files(gemma_270m, keep_quantized=True)
    arch, sd = loaded.arch, loaded.state_dict
    assert (arch.architecture, arch.vocab_size, arch.sliding_window, arch.num_hidden_layers) == (
        "gemma3",
        262144,
        512,
        18,
    )
    assert [i for i in range(18) if arch.layer_window(i) is None] == [5, 11, 17]
    o = sd["model.layers.0.self_attn.o_proj.weight"]  # Q4_K in this file
    down = sd["model.layers.0.mlp.down_proj.weight"]  # Q6_K
    assert (o.kind, o.group_size) == ("q4", 32) and (down.kind, down.group_size) == ("q8", 16)
    assert loaded.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>
    assert all(isinstance(t, QuantizedTensor) for n, t in sd.items() if n.endswith("proj.weight"))


def test_gemma3_linear_rope_scaling_on_global_layers_matches_transformers(tmp_path):
    path, hf, _ = build_tiny_gemma3(str(tmp_path), name="scaled.gguf", rope_factor=8.0)
    assert load_model_files(path).arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    ids = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model = _model(path)
    table = list(range(8))
    torch.testing.assert_close(
        _forward(model, ids, 0, model.allocate_kv(len(table) * BS), table),
        ref,
        rtol=1e-4,
        atol=1e-4,
    )


def test_gemma3_final_logit_softcapping(tiny):
    from dataclasses import replace

    loaded = load_model_files(tiny[0])
    ids, table = [2, 30, 31, 32], list(range(8))
    plain = create_model(loaded.arch, loaded.state_dict, torch.float32, CPU, 64)
    capped = create_model(
        replace(loaded.arch, final_logit_softcapping=0.2), loaded.state_dict, torch.float32, CPU, 64
    )
    a = _forward(plain, ids, 0, plain.allocate_kv(32), table)
    b = _forward(capped, ids, 0, capped.allocate_kv(32), table)
    torch.testing.assert_close(b, 0.2 * torch.tanh(a / 0.2))
    assert b.abs().max() < 0.2 < a.abs().max()  # the tiny model's logits are small


def test_spm_with_space_prefix_matches_sentencepiece_and_llama_cpp(tmp_path):
    # Llama 2 / Mistral-style vocabularies: a space is prefixed to the text (add_space_prefix).
    # llama.cpp also prefixes one after a special or user-defined token ("x\ny" -> x \n _y),
    # sentencepiece does not: sentencepiece is the reference only for text without them.
    from tests.model.tiny_gemma3 import train_spm, vocab_of

    sp = train_spm(dummy_prefix=True)
    tokens, scores, types = vocab_of(sp)
    path = str(tmp_path / "spm-prefix.gguf")
    w = gguf.GGUFWriter(path, "llama")
    (
        w.add_block_count(1),
        w.add_context_length(64),
        w.add_embedding_length(64),
    )  # for llama.cpp's loader
    (
        w.add_feed_forward_length(64),
        w.add_head_count(4),
        w.add_head_count_kv(4),
        w.add_layer_norm_rms_eps(1e-6),
    )
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(
        3
    )  # add_bos_token and add_space_prefix left to llama.cpp's SPM defaults (on)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    tok = load_tokenizer(path)
    plain = ["Hello world", "The quick brown fox.", " leading space", "a  b"]
    for text in plain:
        assert tok.encode(text) == [2] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    try:
        import llama_cpp
    except ImportError:
        return
    ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    try:
        for text in plain + ["x\ny", "x\n\ny z", "<start_of_turn>hi", "\n"]:
            assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True), text
    finally:
        ref.close()


def test_gemma3_hf_folder_matches_transformers_and_the_gguf(tiny, tmp_path):
    # The same weights as an HF folder (norms stored as w, used as 1 + w): logits equal to
    # transformers' and to the GGUF's.
    path, hf, _ = tiny
    folder = str(tmp_path / "hf")
    hf.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(path).backend.save(f"{folder}/tokenizer.json")
    loaded = load_model_files(folder)
    from dataclasses import replace

    same = dict(
        rms_norm_eps=1e-6, attn_scale=0.25
    )  # float32 eps in GGUF; 16 ** -0.5 == head_dim ** -0.5
    assert replace(loaded.arch, **same) == replace(load_model_files(path).arch, **same)
    ids = [2, 17, 45, 99, 120, 7, 64, 230, 31, 18, 77]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model = create_model(loaded.arch, loaded.state_dict, torch.float32, CPU, 64)
    table = list(range(8))
    torch.testing.assert_close(
        _forward(model, ids, 0, model.allocate_kv(len(table) * BS), table),
        ref,
        rtol=1e-4,
        atol=1e-4,
    )
