"""EAGLE heads: published layouts load (or are refused naming the mismatch), our EAGLE-3 writer
round-trips, and the training-time unrolled passes compute exactly what chained drafting does."""

from __future__ import annotations

import pytest
import torch

from dynaspec.model_arch import ModelArchConfig
from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.eagle import EagleProposer, HiddenStates
from dynaspec.spec_decode.drafters.eagle_io import HeadMismatchError, load_head, save_eagle3

from .tiny_eagle import write_eagle1, write_eagle3

TARGET = ModelArchConfig(
    architecture="llama",
    vocab_size=288,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def test_eagle3_layout_loads_with_d2t_and_default_aux_layers(tmp_path):
    head, emb = load_head(write_eagle3(str(tmp_path / "h")), TARGET)
    c = head.cfg
    assert (c.kind, c.draft_vocab_size, c.aux_layers, emb) == ("eagle3", 64, (2, 3, 3), None)
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert torch.equal(head.draft_to_target, torch.arange(64) + sd["d2t"])  # target = draft + d2t
    assert torch.equal(head.layers[0].hidden_norm, sd["midlayer.hidden_norm.weight"])
    assert not any(p.requires_grad for p in head.parameters())


def test_eagle1_layout_loads_from_pytorch_bin(tmp_path):
    head, _ = load_head(write_eagle1(str(tmp_path / "h"), layers=2), TARGET)
    c = head.cfg
    assert (c.kind, c.num_layers, c.aux_layers, c.draft_vocab_size) == ("eagle1", 2, (6,), 288)
    assert head.layers[0].input_layernorm is None and head.layers[1].input_layernorm is not None
    assert head.fc.bias is not None and head.lm_head is None


@pytest.mark.parametrize("kw, needle", [
    (dict(hidden=32, heads=2, kv_heads=1, target_hidden=32), "target_hidden_size is 32"),
    (dict(vocab=300), "vocab_size is 300"),
    (dict(n_aux=2), "fc.weight shape is (64, 128), the target needs (64, 192)"),
    (dict(aux=[1, 2, 9]), "aux hidden-state layer ids [9]"),
])
def test_a_head_that_does_not_fit_is_refused_naming_the_mismatch(tmp_path, kw, needle):
    if "target_hidden" in kw:  # a head for another target: config says so
        path = write_eagle3(str(tmp_path / "h"), **kw)
        import json
        cfg = json.load(open(tmp_path / "h" / "config.json"))
        json.dump({**cfg, "target_hidden_size": 32}, open(tmp_path / "h" / "config.json", "w"))
    else:
        path = write_eagle3(str(tmp_path / "h"), **kw)
    with pytest.raises(HeadMismatchError) as err:
        load_head(path, TARGET)
    assert needle in str(err.value)


def test_save_eagle3_round_trips(tmp_path):
    head, _ = load_head(write_eagle3(str(tmp_path / "a")), TARGET)
    save_eagle3(head, str(tmp_path / "b"), dtype=torch.float32)
    again, _ = load_head(str(tmp_path / "b"), TARGET)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


def test_unrolled_training_passes_equal_chained_drafting(tmp_path):
    """Row n-2 of pass 1, n-1 of pass 2 and n of pass 3 (teacher-forced on the drafts) give the
    three chained drafts: training-time test and inference agree on inputs, keys and positions."""
    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=288, scale=0.3), TARGET)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(288, 64, generator=g)
    prop = EagleProposer(head, 256, embed_table=table)
    n = 11
    toks = torch.randint(3, 288, (n,), generator=g).tolist()
    feats = torch.randn(n + 2, 192, generator=g)
    prop.observe_hidden(HiddenStates(["r"], [0], [0], [n - 1], feats[: n - 1]))
    req = Request("r", toks[:-1], SamplingParams(temperature=0.0))
    req.output_token_ids.append(toks[-1])
    drafts = prop.propose([req], [3]).token_ids[0]
    assert len(drafts) == 3
    seq = toks + drafts[:2]
    with torch.no_grad():
        outs = head.unrolled(feats[None, : len(seq)], table[torch.tensor(seq[1:] + [0])][None], 3)
    got = [int(head.draft_to_target[head.logits(outs[k][0, n - 2 + k]).argmax()]) for k in range(3)]
    assert got == drafts


def test_the_drafting_form_runs_every_linear_on_the_int8_kernel_close_to_fp32(tmp_path):
    """The drafter's copy of the head reads int8 weights (a quarter of fp32's bytes) and stays
    close to the fp32 head; the trained head itself is left as it was."""
    from dynaspec import cpu_kernels
    from dynaspec.spec_decode.drafters.eagle_head import drafting_form

    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=64, scale=0.3), TARGET)
    fast = drafting_form(head)
    linears = lambda m: sum(isinstance(x, torch.nn.Linear) for x in m.modules())  # noqa: E731
    assert linears(head) == 9  # fc, q, k, v, o, gate, up, down, lm_head: untouched
    # q/k/v and gate/up fused to one linear each (9 -> 6), each on the kernel when built
    assert linears(fast) == (0 if cpu_kernels.available()[0] else 6)
    g = torch.Generator().manual_seed(5)
    feats, emb = torch.randn(7, 192, generator=g), torch.randn(7, 64, generator=g)
    cos, sin = head.rope.lookup(torch.arange(7), torch.float32)
    with torch.no_grad():
        outs = []
        for h in (head, fast):
            x = h.fuse(feats)
            q, k, v = h.layers[0].qkv(x, emb, cos, sin)
            outs.append(h.logits(h.layers[0].finish(q, x)))  # [7, 64]
    ref, got = outs
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # Five int8 matmuls in a row on random weights (weights and activations in groups of 32)
    # measured 2.0% relative error; a wrong scale or layout gives tens of percent.
    assert (got - ref).norm() <= 0.04 * ref.norm()


def test_fused_projections_compute_what_the_separate_ones_do(tmp_path):
    import copy

    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=64, scale=0.3), TARGET)
    fused = copy.deepcopy(head)
    fused.layers[0].fuse_projections()
    assert fused.layers[0].qkv_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 2 * 64)  # [q|k|v, 2H]
    g = torch.Generator().manual_seed(6)
    feats, emb = torch.randn(5, 192, generator=g), torch.randn(5, 64, generator=g)
    cos, sin = head.rope.lookup(torch.arange(5), torch.float32)
    with torch.no_grad():
        a, b = (h.layers[0].qkv(h.fuse(feats), emb, cos, sin) for h in (head, fused))
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        x = head.fuse(feats)
        torch.testing.assert_close(head.layers[0].finish(a[0], x), fused.layers[0].finish(a[0], x),
                                   rtol=1e-5, atol=1e-6)


def test_head_kv_buffer_keeps_chain_rows_when_it_grows():
    """Rows past klen (a chain's drafts) survive a growth of the buffer in the middle of a chain."""
    from dynaspec.spec_decode.drafters.eagle import _HeadSeq

    st = _HeadSeq()
    rows = torch.arange(100 * 2 * 3, dtype=torch.float32).view(100, 2, 3)
    st.write(0, 0, rows[:40], -rows[:40])  # capacity 80
    st.klen = 40
    st.write(0, 40, rows[40:70], -rows[40:70])  # a chain's rows, past klen
    k, v = st.write(0, 70, rows[70:], -rows[70:])  # grows past 80
    assert st.keys[0].shape[0] >= 100
    assert torch.equal(k, rows) and torch.equal(v, -rows) and st.klen == 40


def test_one_row_attention_equals_sdpa_with_gqa():
    import torch.nn.functional as F

    from dynaspec.spec_decode.drafters.eagle import _one_row_attention

    g = torch.Generator().manual_seed(7)
    q, K, V = (torch.randn(*s, generator=g) for s in ((6, 16), (11, 2, 16), (11, 2, 16)))
    ref = F.scaled_dot_product_attention(q[:, None][None], K.transpose(0, 1)[None],
                                         V.transpose(0, 1)[None], enable_gqa=True)  # [1, 6, 1, 16]
    torch.testing.assert_close(_one_row_attention(q, K, V), ref[0].transpose(0, 1))


@pytest.mark.skipif(not __import__("dynaspec.cpu_kernels", fromlist=["x"]).available()[0],
                    reason="the C++ kernels are not built")
def test_compiled_head_step_drafts_what_the_torch_layer_does(tmp_path):
    """HeadStep (one C++ call for the layer, one for a whole chain) against the same drafting-form
    head run op by op in torch: two requests of different lengths and K, over three steps (the
    second and third catch up on accepted rows), the same drafts and the same head KV."""
    from dynaspec.spec_decode.drafters.eagle_head import compiled_step, drafting_form

    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=288, scale=0.3), TARGET)
    fast = drafting_form(head)
    step = compiled_step(fast)
    assert step is not None
    g = torch.Generator().manual_seed(9)
    table = torch.randn(288, 64, generator=g)
    props = [EagleProposer(fast, 256, embed_table=table, step=s) for s in (None, step)]
    toks = {rid: torch.randint(3, 288, (n,), generator=g).tolist()
            for rid, n in (("a", 40), ("b", 14))}
    feats = {rid: torch.randn(len(t), 192, generator=g) for rid, t in toks.items()}
    seen = {"a": 0, "b": 0}  # tokens whose features were delivered
    for ks, new in (([3, 1], {"a": 30, "b": 5}), ([2, 4], {"a": 3, "b": 3}),
                    ([4, 2], {"a": 1, "b": 2})):
        reqs = []
        for rid in toks:
            lo, hi = seen[rid], seen[rid] + new[rid]
            hs = HiddenStates([rid], [0], [lo], [hi - lo], feats[rid][lo:hi])
            for p in props:
                p.observe_hidden(hs)
            seen[rid] = hi
            req = Request(rid, toks[rid][:hi], SamplingParams(temperature=0.0))
            req.output_token_ids.append(toks[rid][hi])
            reqs.append(req)
        ref, got = (p.propose(reqs, ks).token_ids for p in props)
        assert [len(d) for d in got] == ks and got == ref
        for rid in toks:
            a, b = (p.seqs[rid] for p in props)
            assert a.klen == b.klen
            torch.testing.assert_close(b.keys[0][: b.klen], a.keys[0][: a.klen],
                                       rtol=1e-4, atol=1e-4)


def test_a_prompt_backlog_is_fed_apart_timed_as_setup_with_the_same_drafts(tmp_path, monkeypatch):
    """A request's first drafts feed its whole prompt to the head: those rows go in a pass of
    their own, reported as Drafts.setup_seconds (the policy's per-token cost leaves it out), and
    the drafts and head KV are what one pass over every row gives."""
    from dynaspec.spec_decode.drafters import eagle

    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=288, scale=0.3), TARGET)
    g = torch.Generator().manual_seed(4)
    table = torch.randn(288, 64, generator=g)
    toks = torch.randint(3, 288, (41,), generator=g).tolist()
    feats = torch.randn(40, 192, generator=g)
    got = []
    for fresh in (eagle.FRESH_TOKENS, 10**9):  # 10**9: nothing fed apart
        monkeypatch.setattr(eagle, "FRESH_TOKENS", fresh)
        prop = EagleProposer(head, 256, embed_table=table)
        prop.observe_hidden(HiddenStates(["r"], [0], [0], [40], feats))
        req = Request("r", toks[:40], SamplingParams(temperature=0.0))
        req.output_token_ids.append(toks[40])
        d = prop.propose([req], [3])
        got.append((d, prop.seqs["r"]))
    (split, st), (whole, st_whole) = got
    assert split.setup_seconds > 0 and whole.setup_seconds == 0
    assert split.token_ids == whole.token_ids and len(split.token_ids[0]) == 3
    assert st.klen == st_whole.klen == 40
    torch.testing.assert_close(st.keys[0][:40], st_whole.keys[0][:40], rtol=1e-5, atol=1e-5)
    # the next step's few new rows are all fresh: no setup
    prop.observe_hidden(HiddenStates(["r"], [0], [40], [1], torch.randn(1, 192, generator=g)))
    req.output_token_ids.append(5)
    assert prop.propose([req], [2]).setup_seconds == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_a_backlog_fed_in_short_passes_gives_the_same_drafts_and_kv(tmp_path, monkeypatch,
                                                                    compiled):
    """Backlogs are fed in passes of at most CATCH_UP_ROWS rows (one pass over 16 prompts faulted
    in ~300 MB of fresh pages a call): two requests split across passes that also share them give
    the drafts and head KV one pass gives."""
    from dynaspec.spec_decode.drafters import eagle
    from dynaspec.spec_decode.drafters.eagle_head import compiled_step, drafting_form

    head, _ = load_head(write_eagle3(str(tmp_path / "h"), draft_vocab=288, scale=0.3), TARGET)
    fast = drafting_form(head)
    step = compiled_step(fast) if compiled else None
    g = torch.Generator().manual_seed(5)
    table = torch.randn(288, 64, generator=g)
    toks = {"a": torch.randint(3, 288, (41,), generator=g).tolist(),
            "b": torch.randint(3, 288, (27,), generator=g).tolist()}
    feats = {rid: torch.randn(len(t) - 1, 192, generator=g) for rid, t in toks.items()}
    got = []
    for rows in (7, 10**9):
        monkeypatch.setattr(eagle, "CATCH_UP_ROWS", rows)
        prop = EagleProposer(fast, 256, embed_table=table, step=step)
        reqs = []
        for rid, t in toks.items():
            prop.observe_hidden(HiddenStates([rid], [0], [0], [len(t) - 1], feats[rid]))
            req = Request(rid, t[:-1], SamplingParams(temperature=0.0))
            req.output_token_ids.append(t[-1])
            reqs.append(req)
        got.append((prop.propose(reqs, [3, 2]), prop.seqs))
    (short, seqs), (whole, seqs_whole) = got
    assert short.token_ids == whole.token_ids and [len(d) for d in short.token_ids] == [3, 2]
    for rid, t in toks.items():
        a, b = seqs[rid], seqs_whole[rid]
        assert a.klen == b.klen == len(t) - 1
        torch.testing.assert_close(a.keys[0][: a.klen], b.keys[0][: b.klen], rtol=1e-4, atol=1e-4)


def test_backlog_passes_cover_every_row_once_in_order():
    from dynaspec.spec_decode.drafters.eagle import _pieces

    items = [("a", list(range(10)), 10), ("b", list(range(3)), 3), ("c", list(range(6)), 6)]
    pieces = list(_pieces(items, 4))
    assert all(sum(n for *_, n in p) <= 4 for p in pieces)
    assert all(len({st for st, *_ in p}) == len(p) for p in pieces)  # a request once a pass
    for st, tk, n in items:
        rows = [t for p in pieces for s, ts, m in p if s == st for t in ts]
        assert rows == tk and sum(m for p in pieces for s, _, m in p if s == st) == n
