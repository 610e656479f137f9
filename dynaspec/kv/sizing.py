"""The KV pool's size in blocks, from a memory budget (target and draft model pools alike)."""

from __future__ import annotations


def num_kv_blocks(budget_gb: float, override: int | None, bytes_per_token: int,
                  block_size: int) -> int:
    """Deterministic: the same flags give the same pool on every launch."""
    if override is not None:
        return override
    n = int(budget_gb * (1 << 30)) // (bytes_per_token * block_size)
    if n < 1:
        raise ValueError(f"kv_cache_memory_gb {budget_gb} is too small for one block "
                         f"({bytes_per_token * block_size} bytes)")
    return n
