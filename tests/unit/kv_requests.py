"""Requests driven through a KVCacheManager by hand, for its tests: build one, run its whole
prompt, and snapshot the pool and tables to compare before and after."""

from __future__ import annotations

from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams


def req(rid: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(), output_token_ids=list(output or []))


def run_prompt(kv: KVCacheManager, r: Request) -> None:
    """Admit r with whatever prefix hit exists, compute its whole prompt, cache its blocks."""
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, blocks, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r, r.num_computed_tokens)


def snapshot(kv: KVCacheManager) -> tuple:
    p = kv.pool
    tables = {rid: list(s.table) for rid, s in kv._reqs.items()}
    return (list(p.ref_cnt), list(p.block_hash), list(p._free), p.evictable_order(), tables)
