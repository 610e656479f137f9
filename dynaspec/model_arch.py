"""A model's architecture, read from its files (config.json or GGUF metadata), not set by a flag:
the one record the loaders fill and the model, drafters and heads are built from. The engine's
own configuration (its flags) is dynaspec/config.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    # Gemma-3: local layers attend to the last `sliding_window` positions; layer i is global iff
    # (i + 1) % sliding_window_pattern == 0 (0: every layer global). Local layers use RoPE base
    # rope_local_theta; rope_scaling applies to the global layers only.
    sliding_window: int | None = None
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer i (None: the whole context)."""
        if self.sliding_window is None or (self.sliding_window_pattern
                                           and (i + 1) % self.sliding_window_pattern == 0):
            return None
        return self.sliding_window
