"""StepCostModel: interpolation, online refresh, cache round trip and the start-up profile."""

from __future__ import annotations

import json

import pytest

from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel


def _linear_model(a=1e-3, b=1e-5, c=2e-4, d=3e-6) -> StepCostModel:
    """seconds = a + b*ctx + (c + d*ctx) * width, with batch entering as log2(batch) * a."""
    grid = CostGrid((1, 4, 16), (128, 1024), (1, 3, 5))
    sec = [[[a * (1 + bi) + b * ctx + (c + d * ctx) * w for w in grid.widths]
            for ctx in grid.contexts] for bi, _ in enumerate(grid.batches)]
    return StepCostModel(grid, sec)


def test_exact_at_grid_points_and_linear_between():
    m = _linear_model()
    assert m.cost(4, 1024, 3) == pytest.approx(m.seconds[1][1][1])
    # width 2 sits halfway between 1 and 3; ctx 576 halfway between 128 and 1024; batch 2 is
    # halfway in log2 between 1 and 4.
    assert m.cost(1, 128, 2) == pytest.approx((m.seconds[0][0][0] + m.seconds[0][0][1]) / 2)
    assert m.cost(1, 576, 1) == pytest.approx((m.seconds[0][0][0] + m.seconds[0][1][0]) / 2)
    assert m.cost(2, 128, 1) == pytest.approx((m.seconds[0][0][0] + m.seconds[1][0][0]) / 2)


def test_extrapolates_along_the_outer_segment_and_stays_positive():
    m = _linear_model()
    slope = m.seconds[0][0][2] - m.seconds[0][0][1]  # per 2 widths
    assert m.cost(1, 128, 9) == pytest.approx(m.seconds[0][0][2] + 2 * slope)
    assert m.cost(1, 1, 1) > 0 and m.cost(64, 8192, 9) > m.cost(16, 1024, 5)


def test_observe_moves_the_nearest_point_toward_the_observation():
    m = _linear_model()
    before = m.cost(4, 1024, 3)
    for _ in range(200):
        m.observe(4, 1024, 3, 2 * before)
    assert m.cost(4, 1024, 3) == pytest.approx(2 * before, rel=1e-3)
    assert m.seconds[0][0][0] == _linear_model().seconds[0][0][0]  # far points untouched
    assert m.num_observations == 200
    m.observe(4, 1024, 3, 0.0)  # a zero timing (clock granularity) is ignored
    assert m.num_observations == 200


def test_grid_and_table_validation():
    with pytest.raises(ValueError, match="widths"):
        CostGrid((1,), (128,), (3, 1))
    with pytest.raises(ValueError, match="shape"):
        StepCostModel(CostGrid((1,), (128,), (1, 2)), [[[1e-3]]])
    with pytest.raises(ValueError, match="> 0"):
        StepCostModel(CostGrid((1,), (128,), (1,)), [[[0.0]]])
    with pytest.raises(ValueError, match="malformed"):
        StepCostModel.from_json({"batches": [1]})


def test_default_grid_respects_limits():
    g = CostGrid.default(max_num_seqs=8, max_model_len=256, max_width=5)
    assert g.batches == (1, 4, 8) and max(g.contexts) <= 251 and g.widths == (1, 2, 3, 5)
    assert CostGrid.default(64, 4096, 1).widths == (1,)


def test_injected_table_is_fixed_and_parsed_from_text_or_dict(tmp_path):
    d = {"batches": [1], "contexts": [1], "widths": [1, 5], "seconds": [[[0.01, 0.01]]],
         "draft_seconds_per_token": 0.0}
    for value in (d, json.dumps(d)):
        m = StepCostModel.injected(value)
        assert m.source == "injected" and not m.learn and m.draft_seconds_per_token == 0.0
        m.observe(1, 1, 5, 100.0)  # a served step cannot move a fixed table
        assert m.cost(1, 1, 5) == pytest.approx(0.01)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    assert StepCostModel.injected(str(path)).cost(1, 50, 3) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="neither a JSON file nor JSON text"):
        StepCostModel.injected("{oops")


def test_monotone_check_names_the_poisoned_cells():
    m = _linear_model()
    assert m.monotone_problems() == []
    m.seconds[1][0][2] = m.seconds[1][0][1] * 0.5  # batch 4 ctx 128: width 5 half of width 3
    problems = m.monotone_problems()
    assert any("batch 4 ctx 128: width 5" in p for p in problems), problems


def test_profile_measures_every_shape(tiny_llama_dir):
    import torch

    from dynaspec.models.llama import LlamaModel
    from dynaspec.models.loader import load_model_files
    from dynaspec.spec_decode.policy.cost_profile import profile_step_costs

    loaded = load_model_files(tiny_llama_dir)
    model = LlamaModel(loaded.arch, loaded.state_dict, torch.float32, torch.device("cpu"), 256)
    kv = model.allocate_kv(8 * 16)  # only 8 blocks: the profile must clamp its contexts
    grid = CostGrid((1, 4), (16, 1024), (1, 3))
    m = profile_step_costs(model, kv, 16, 8, grid, reps=1)
    assert m.grid == grid and all(s > 0 for b in m.seconds for c in b for s in c)
    json.dumps(m.to_json())
