"""KVCacheManager against a stateful model (hypothesis): random admits, steps (chunked prefill,
decode with drafts, rollback) and frees, with a shadow of what each KV slot holds, so a wrong
prefix hit, a write into a shared block or a hashed draft is caught."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynaspec.kv.block_pool import ROOT_HASH, hash_block_tokens
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.request import Request
from tests.unit.kv_requests import req, snapshot


class KVMachine(RuleBasedStateMachine):
    """Random admit / step (chunked prefill, decode with drafts, rollback) / free sequences.

    The shadow `slots` records, per KV slot, the full token prefix whose KV was written there;
    every slot a request depends on (positions < num_computed_tokens) must hold its own prefix.
    That catches a wrong hit, a write into a shared block, and a hashed draft.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager
        self.running: dict[str, Request] = {}
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.n = 0

    @initialize(
        num_blocks=st.integers(1, 16),
        bs=st.integers(1, 4),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(self, num_blocks, bs, caching):
        self.kv = KVCacheManager(num_blocks, bs, caching)

    def _write(self, r: Request, start: int, tokens: list[int]) -> None:
        table, bs = self.kv.block_table(r.request_id), self.kv.block_size
        for p in range(start, start + len(tokens)):
            # A hashed block may be served to others at any moment: nobody may write into it.
            assert self.kv.pool.block_hash[table[p // bs]] is None, (
                f"write into hashed block {table[p // bs]}"
            )
            self.slots[(table[p // bs], p % bs)] = tuple(
                r.all_token_ids[:start] + tokens[: p - start + 1]
            )

    @rule(base=st.sampled_from([(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9)]),
          tail=st.lists(st.integers(0, 2), max_size=6), chunk=st.integers(1, 8))
    def admit(self, base, tail, chunk):
        prompt = list(base) + tail or [0]
        r = req(f"r{self.n}", prompt)
        self.n += 1
        blocks, hit = self.kv.get_computed_blocks(r)
        event(f"hit={hit > 0}")
        for p in range(hit):  # a hit must serve exactly this prompt's KV
            assert self.slots[(blocks[p // self.kv.block_size], p % self.kv.block_size)] == tuple(
                prompt[: p + 1]
            )
        n = min(chunk, r.num_tokens - hit)
        if self.kv.allocate_slots(r, n, blocks, hit):
            r.num_computed_tokens = hit
            self._write(r, hit, prompt[hit : hit + n])
            r.num_computed_tokens = hit + n
            self.running[r.request_id] = r
        else:
            self.kv.free(r)  # drops the lookup state of a request that stays waiting

    @rule(data=st.data(), chunk=st.integers(1, 8), k=st.integers(0, 3))
    def step(self, data, chunk, k):
        if not self.running:  # a no-op rather than a precondition: fewer rejected examples
            return
        r = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        todo = r.num_tokens - r.num_computed_tokens
        drafts = [data.draw(st.integers(0, 2)) for _ in range(k)] if todo == 1 else []
        n = min(chunk, todo)
        before = snapshot(self.kv)
        if not self.kv.allocate_slots(r, n + len(drafts)):
            assert snapshot(self.kv) == before
            return
        start = r.num_computed_tokens
        self._write(r, start, r.all_token_ids[start : start + n] + drafts)
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:  # sample: accepted drafts + one bonus token
            accepted = drafts[: data.draw(st.integers(0, len(drafts)))]
            r.output_token_ids += accepted + [data.draw(st.integers(0, 2))]
            r.num_computed_tokens += len(accepted)
        # Passing num_tokens over-reports by the bonus token; the manager must cap it.
        self.kv.cache_full_blocks(
            r, data.draw(st.sampled_from([r.num_computed_tokens, r.num_tokens]))
        )

    @rule(data=st.data(), twice=st.booleans())
    def finish(self, data, twice):
        if not self.running:
            return
        r = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(r)
        if twice:
            self.kv.free(r)

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        used = sum(1 for c in self.kv.pool.ref_cnt if c > 0)
        assert self.kv.num_free_blocks() + used == self.kv.num_blocks
        for r in self.running.values():
            table, bs = self.kv.block_table(r.request_id), self.kv.block_size
            for p in range(r.num_computed_tokens):
                assert self.slots[(table[p // bs], p % bs)] == tuple(r.all_token_ids[: p + 1])
        for block, h in enumerate(self.kv.pool.block_hash):
            if h is not None:
                self._check_hashed_block(block, h)

    def _check_hashed_block(self, block: int, h: bytes) -> None:
        """A hashed block holds, in every slot, the KV of exactly the token prefix its hash
        names."""
        bs = self.kv.block_size
        last = self.slots.get((block, bs - 1))
        assert last is not None and len(last) % bs == 0, (
            f"hashed block {block} has an unwritten slot"
        )
        for j in range(bs):
            assert self.slots.get((block, j)) == last[: len(last) - bs + j + 1], (
                f"hashed block {block} slot {j}"
            )
        parent = ROOT_HASH
        for i in range(0, len(last), bs):
            parent = hash_block_tokens(parent, last[i : i + bs])
        assert parent == h, f"hashed block {block} holds KV of another prefix than its hash names"

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in self.running.values():
            self.kv.free(r)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks() == self.kv.num_blocks and self.kv.usage() == 0.0


KVMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase
