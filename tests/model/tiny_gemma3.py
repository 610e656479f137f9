"""A tiny random Gemma-3 written as a GGUF the way llama.cpp's converter writes one, with a tiny
SentencePiece (BPE, byte fallback) vocabulary trained here: no downloads.

`build_tiny_gemma3(out_dir, tensor_type=None)` returns (gguf path, the transformers model it
came from). 7 layers (layer 5 global, the rest local with a 4-token window, so windows matter
within a dozen tokens), hidden 64, 4 heads of 16, 2 KV heads, random norm weights.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch

CONTROL = ["<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = [
    "\n",
    "\n\n",
]  # (sentencepiece, unlike llama.cpp, matches these after normalizing spaces)
WINDOW = 4
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Speculative decoding drafts tokens and the target model verifies them in one pass.",
    "Hello, world! Bonjour le monde. Hallo Welt. 12345 67890 the the the of of and",
    "Gemma three has local layers and global layers with sliding windows.",
]
_GGUF_LAYER = {
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
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def train_spm(vocab_size: int = 480, dummy_prefix: bool = False):
    """A SentencePiece BPE model with byte fallback and Gemma's special ids (pad 0, eos 1, bos 2,
    unk 3); returns the loaded processor."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 4), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        control_symbols=CONTROL, user_defined_symbols=USER_DEFINED, add_dummy_prefix=dummy_prefix,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def vocab_of(sp) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, llama.cpp token types) of a sentencepiece model."""
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [float(sp.get_score(i)) for i in range(len(tokens))]
    types = []
    for i, t in enumerate(tokens):
        kind = 1
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_byte(i):
            kind = 6
        elif t in USER_DEFINED:
            kind = 4
        types.append(kind)
    return tokens, scores, types


def hf_gemma3(vocab_size: int, seed: int = 0, rope_factor: float | None = None):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    extra = {}
    if rope_factor is not None:  # linear scaling on the global layers only, as Gemma-3 4B+ has
        extra["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "factor": rope_factor, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        max_position_embeddings=512, query_pre_attn_scalar=16, rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager", **extra,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # Gemma initialises norms to 0 (i.e. 1 + 0): make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
    return model


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, *rest = hf_name.split(".")
        return f"blk.{layer}.{_GGUF_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }[hf_name]


def build_tiny_gemma3(out_dir: str, tensor_type=None, name: str = "tiny-gemma3.gguf",
                      rope_factor: float | None = None):
    import gguf

    sp = train_spm()
    tokens, scores, types = vocab_of(sp)
    model = hf_gemma3(len(tokens), rope_factor=rope_factor)
    cfg = model.config
    path = os.path.join(out_dir, name)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(WINDOW)
    if rope_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_factor)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied
            continue
        array = p.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        if (
            tensor_type is not None
            and array.ndim == 2
            and array.shape[1] % gguf.GGML_QUANT_SIZES[tensor_type][0] == 0
        ):
            w.add_tensor(
                _gguf_name(hf_name), gguf.quants.quantize(array, tensor_type), raw_dtype=tensor_type
            )
        else:
            w.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model, sp
