"""Attention over a paged KV cache in plain PyTorch, for flat mixed batches.

A step's tokens are flat: request i owns `query_lens[i]` consecutive tokens. Requests with few
query tokens (decodes and speculative verifies, 1+k each) form one padded batch and run a single
SDPA call per layer; long prefill chunks run one SDPA call each. The KV of every request is
gathered from its slots by an index built once per step and shared by all layers.

`EagerPagedBackend` is this module behind the attention seam (`dynaspec.attention.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dynaspec.attention.backend import AttentionBatch

# Requests with at most this many query tokens join the padded short batch.
SHORT_QUERY_MAX = 16


@dataclass
class ShortGroup:
    """Padded batch of short-query requests (decode / verify)."""

    token_index: (
        torch.Tensor | None
    )  # [B, W] flat token index (None: tokens are already [B*W] in order)
    token_valid: torch.Tensor | None  # [B, W] bool; None when every row is full
    kv_slots: torch.Tensor  # [B, C] slot of each context position (pad: slot 0)
    mask: torch.Tensor | None  # [B, 1, W, C] bool, True = attend; None = no masking needed
    num_reqs: int
    width: int
    token_start: int  # flat index of the group's first token when token_index is None
    ctx_lens: tuple[int, ...] = ()  # per request: context after this step (for window masks)
    query_lens: tuple[int, ...] = ()
    packed_mask: torch.Tensor | None = None  # [B, 1, W*G, C], built by the first layer, reused
    # sliding window -> its packed mask, built by the first layer with that window, reused
    window_masks: dict = field(default_factory=dict)
    # With a tree in the group: (query, key) positions, [B, W] and [B, C] long, as the model
    # sees them (a tree's rows at their depth, docs/design.md §4c): the window counts these.
    tree_pos: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class LongSeq:
    """One request with a long query (prefill chunk)."""

    token_start: int
    query_len: int
    context_len: int  # tokens in KV after this step's write (computed + query)
    kv_slots: torch.Tensor | None  # [context_len]; None when the query is the whole context
    window_masks: dict = field(default_factory=dict)  # sliding window -> [query_len, context_len]
    tree_mask: torch.Tensor | None = None  # [query_len, query_len] bool: a tree's rows (§4c)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new K/V is written to
    short: ShortGroup | None
    long: list[LongSeq]
    num_tokens: int
    has_tree: bool = False  # some request's rows are a draft tree (masks built in)


def row_positions(tree: torch.Tensor, context_len: int) -> torch.Tensor:
    """[q] long: the position of each of a request's q rows given its [q, q] visibility; a row
    sits one past the last row it sees (a tree node at its depth, a causal row at its index)."""
    q = tree.shape[0]
    return context_len - q + tree.sum(dim=1).to(torch.long) - 1


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device,
                   tree_masks: list[torch.Tensor | None] | None = None) -> AttentionMetadata:
    """context_lens[i] = tokens in request i's KV after this step (computed + query);
    tree_masks[i]: [q, q] bool visibility among request i's query rows (None: causal)."""
    trees = tree_masks if tree_masks is not None and any(m is not None for m in tree_masks) \
        else None
    starts, slots_new, short_ids, long = [], [], [], []
    pos = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        starts.append(pos)
        table = block_tables[i]
        for p in range(c - q, c):
            slots_new.append(table[p // block_size] * block_size + p % block_size)
        if q <= SHORT_QUERY_MAX:
            short_ids.append(i)
        else:
            given = None if trees is None else trees[i]
            tree = None if given is None else given.to(device)
            kv = None if q == c and tree is None else _slots(table, c, block_size, device)
            long.append(LongSeq(pos, q, c, kv, tree_mask=tree))
        pos += q
    slot_mapping = torch.tensor(slots_new, dtype=torch.long, device=device)
    short = None
    if short_ids:
        short = _build_short(short_ids, starts, query_lens, context_lens, block_tables,
                             block_size, device, trees)
    return AttentionMetadata(slot_mapping, short, long, pos, trees is not None)


def _slots(table: list[int], n: int, block_size: int, device: torch.device) -> torch.Tensor:
    blocks = torch.tensor(table[: (n + block_size - 1) // block_size], dtype=torch.long)
    offs = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offs[None, :]).reshape(-1)[:n].to(device)


def _build_short(
    ids: list[int],
    starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    trees: list[torch.Tensor | None] | None = None,
) -> ShortGroup:
    qs = [query_lens[i] for i in ids]
    cs = [context_lens[i] for i in ids]
    B, W, C = len(ids), max(qs), max(cs)
    contiguous = all(starts[i] == starts[ids[0]] + j * W for j, i in enumerate(ids))
    uniform = contiguous and all(q == W for q in qs)
    kv_slots = torch.zeros(B, C, dtype=torch.long)
    for j, i in enumerate(ids):
        kv_slots[j, : cs[j]] = _slots(block_tables[i], cs[j], block_size, torch.device("cpu"))
    token_index = token_valid = None
    if not uniform:
        w = torch.arange(W)
        token_valid = w[None, :] < torch.tensor(qs)[:, None]  # [B, W]
        token_index = torch.tensor([starts[i] for i in ids])[:, None] + w[None, :]
        token_index = torch.where(token_valid, token_index, 0).to(device)
        token_valid = token_valid.to(device)
    mask = None
    if not (W == 1 and min(cs) == C):
        ctx = torch.tensor(cs)[:, None, None]  # [B, 1, 1]
        q_len = torch.tensor(qs)[:, None, None]
        q_pos = ctx - q_len + torch.arange(W)[None, :, None]  # absolute position of each query
        k_pos = torch.arange(C)[None, None, :]
        mask = ((k_pos <= q_pos) & (k_pos < ctx)).unsqueeze(1)  # [B, 1, W, C]
        tree_pos = None
        for j, i in enumerate(ids if trees is not None else ()):
            tree = trees[i] if trees is not None else None
            if tree is not None:  # a tree's rows see the context and their ancestors only
                q, c = qs[j], cs[j]
                mask[j, 0, :q, c - q:c] = tree
                if tree_pos is None:  # physical positions, clamped (pad rows: the last key)
                    tree_pos = (torch.minimum(q_pos[:, :, 0], ctx[:, :, 0] - 1),
                                torch.arange(C).repeat(B, 1))
                rows = row_positions(tree.cpu(), c)
                tree_pos[0][j, :q] = rows
                tree_pos[0][j, q:] = rows.max()  # pad rows see the deepest node, never nothing
                tree_pos[1][j, c - q:c] = rows
        mask = mask.to(device)
    return ShortGroup(token_index, token_valid, kv_slots.to(device), mask, B, W,
                      starts[ids[0]] if uniform else 0, tuple(cs), tuple(qs),
                      tree_pos=None if mask is None or tree_pos is None
                      else (tree_pos[0].to(device), tree_pos[1].to(device)))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_slots, Hkv, D]. Returns [T, H, D].
    window: a query at position p sees keys max(0, p - window + 1)..p (None: all up to p). The
    cache keeps every position either way, so prefix caching and rollback are unaffected."""
    kv_cache[0].index_copy_(0, md.slot_mapping, k)
    kv_cache[1].index_copy_(0, md.slot_mapping, v)
    out = torch.empty_like(q)
    if md.short is not None:
        _short_attention(q, kv_cache, md.short, scale, out, window)
    long_attention(q, k, v, kv_cache, md.long, scale, out, window)
    return out


def window_mask(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """[..., num_keys] bool: key position k is visible from query position q (causal, in window)."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    q = q_pos[..., None]
    return (k_pos <= q) & (k_pos > q - window)


def long_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   seqs: list[LongSeq], scale: float, out: torch.Tensor,
                   window: int | None = None) -> None:
    """One SDPA call per prefill chunk, into its rows of out (the step's K/V already written)."""
    for seq in seqs:
        s, e = seq.token_start, seq.token_start + seq.query_len
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if seq.kv_slots is None:
            ki, vi = k[s:e], v[s:e]
        else:
            ki, vi = kv_cache[0][seq.kv_slots], kv_cache[1][seq.kv_slots]  # [ctx, Hkv, D]
        windowed = window is not None and seq.context_len > window  # else the window hides nothing
        mask: torch.Tensor | None
        if seq.tree_mask is not None:
            mask, causal = seq.window_masks.get(window if windowed else None), False
            if mask is None:
                mask = seq.window_masks[window if windowed else None] = _long_tree_mask(
                    seq, window if windowed else None)
        elif windowed and window is not None:  # (windowed implies a window: for the checker)
            mask = seq.window_masks.get(window)
            if mask is None:
                q_pos = torch.arange(
                    seq.context_len - seq.query_len, seq.context_len, device=q.device
                )
                mask = seq.window_masks[window] = window_mask(q_pos, seq.context_len, window)
            causal = False
        elif seq.kv_slots is None:
            mask, causal = None, True
        else:
            q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
            mask = torch.arange(seq.context_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1).unsqueeze(0),
                                           vi.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)


def _long_tree_mask(seq: LongSeq, window: int | None) -> torch.Tensor:
    """[q, ctx] bool: a tree's rows see the context and their ancestors; in a window, only keys
    within `window` positions of the row's own (positions by depth, not by row)."""
    assert seq.tree_mask is not None  # a tree's sequence
    c, q, dev = seq.context_len, seq.query_len, seq.tree_mask.device
    k_pos = torch.arange(c, device=dev)
    mask = (k_pos < c - q).expand(q, c).clone()  # [q, ctx]: the context before the step
    mask[:, c - q:] = seq.tree_mask
    if window is not None:
        rows = row_positions(seq.tree_mask, c)  # [q]
        k_pos[c - q:] = rows
        mask &= k_pos[None, :] > rows[:, None] - window
    return mask


def _short_window_mask(g: ShortGroup, window: int, G: int, device: torch.device) -> torch.Tensor:
    """[B, 1, W*G, C] bool: the group's mask with a sliding window (pad rows, past a request's
    query, see keys up to its last position only)."""
    B, W = g.num_reqs, g.width
    if g.tree_pos is not None and g.mask is not None:  # positions by depth (docs/design.md §4c)
        q_pos, k_pos = g.tree_pos
        m = g.mask & (k_pos[:, None, None, :] > q_pos[:, None, :, None] - window)
    else:
        ctx = torch.tensor(g.ctx_lens, device=device)[:, None]
        q_pos = ctx - torch.tensor(g.query_lens, device=device)[:, None] + torch.arange(
            W, device=device)
        m = window_mask(torch.minimum(q_pos, ctx - 1), g.kv_slots.shape[1], window).unsqueeze(1)
    C = m.shape[-1]
    return m.unsqueeze(3).expand(B, 1, W, G, C).reshape(B, 1, W * G, C)


def _short_attention(q: torch.Tensor, kv_cache: torch.Tensor, g: ShortGroup, scale: float,
                     out: torch.Tensor, window: int | None = None) -> None:
    H, D = q.shape[1], q.shape[2]
    if g.token_index is None:
        qb = q[g.token_start: g.token_start + g.num_reqs * g.width].view(g.num_reqs, g.width, H, D)
    else:
        qb = q[g.token_index]  # [B, W, H, D]
    kb = kv_cache[0][g.kv_slots].transpose(1, 2)  # [B, Hkv, C, D]
    vb = kv_cache[1][g.kv_slots].transpose(1, 2)
    B, W, Hkv = g.num_reqs, g.width, kb.shape[1]
    G = H // Hkv
    # Pack the G query heads that share a KV head into the query axis: [B, Hkv, W*G, D].
    # Same math as GQA, but SDPA sees W*G queries instead of one; measured here its bf16
    # one-query path is ~5x slower at batch 64 x 1k context.
    qp = qb.view(B, W, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, W * G, D)
    C = kb.shape[2]
    if g.mask is not None and g.packed_mask is None:  # [B, 1, W, C] -> [B, 1, W*G, C]
        g.packed_mask = g.mask.unsqueeze(3).expand(B, 1, W, G, C).reshape(B, 1, W * G, C)
    mask = g.packed_mask
    if window is not None and C > window:  # with C <= window the window hides nothing
        mask = g.window_masks.get(window)
        if mask is None:
            mask = g.window_masks[window] = _short_window_mask(g, window, G, q.device)
    o = F.scaled_dot_product_attention(qp, kb, vb, attn_mask=mask, scale=scale)
    o = o.view(B, Hkv, W, G, D).permute(0, 2, 1, 3, 4).reshape(B, W, H, D)
    if g.token_index is None:
        out[g.token_start: g.token_start + g.num_reqs * g.width] = o.reshape(-1, H, D)
    else:
        out[g.token_index[g.token_valid]] = o[g.token_valid]


class EagerPagedBackend:
    """Any flat mixed batch; padded rows of a fixed-shape batch are not needed (it is ragged)."""

    name = "eager"
    verifies_trees = True  # token-tree rows see only their ancestors (the tree mask)
    tree_windows = True  # tree rows windowed by their depth (dynaspec/engine/tree_setting.py)

    def supports(self, batch: AttentionBatch) -> bool:
        return True

    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        return build_metadata(list(batch.query_lens), list(batch.context_lens),
                              [list(t) for t in batch.block_tables], batch.block_size, batch.device,
                              None if batch.tree_masks is None else list(batch.tree_masks))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, md, scale, window)
