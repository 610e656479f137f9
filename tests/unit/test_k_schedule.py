"""Schedule parsing: every accepted form, and every rule with an error naming the entry."""

from __future__ import annotations

import json

import pytest

from dynaspec.spec_decode.plan.k_schedule import MAX_SCHEDULE_K, ScheduleError, parse_schedule


def test_constant_form():
    s = parse_schedule("4")
    assert s.form == "constant"
    assert s.batch_ranges == ((1, None),) and s.ctx_ranges == ((1, None),)
    assert s.ks == ((4,),)


def test_batch_rows_sorted_and_last_open_ended():
    # Rows in any order; the last stated hi (16) becomes open-ended and a note says so.
    s = parse_schedule("[[9, 16, 2], [1, 8, 4]]")
    assert s.form == "batch"
    assert s.batch_ranges == ((1, 8), (9, None))
    assert s.ks == ((4,), (2,))
    assert s.sources == ((1,), (0,))
    assert any("above 16" in n for n in s.notes)


def test_null_hi_on_the_last_range_is_accepted():
    s = parse_schedule("[[1, 8, 4], [9, null, 2]]")
    assert s.batch_ranges == ((1, 8), (9, None))
    assert not s.notes


def test_grid_rows():
    rows = [[1, 8, 1, 512, 4], [1, 8, 513, None, 2], [9, 16, 1, 512, 3], [9, 16, 513, 2048, 1]]
    s = parse_schedule(json.dumps(rows))
    assert s.form == "grid"
    assert s.batch_ranges == ((1, 8), (9, None))
    assert s.ctx_ranges == ((1, 512), (513, None))
    assert s.ks == ((4, 2), (3, 1))


def test_grid_with_one_batch_range_and_open_ended_ctx():
    s = parse_schedule("[[1, 4, 1, 100, 3], [1, 4, 101, 200, 5]]")
    assert s.ctx_ranges == ((1, 100), (101, None))
    assert any("ctx above 200" in n for n in s.notes)


def test_tuned_table_object():
    table = {
        "grid": [
            [1, 4, 1, 1024, 4],
            [1, 4, 1025, None, 6],
            [5, None, 1, 1024, 2],
            [5, None, 1025, None, 3],
        ],
        "measurements": {"step_time_s": [[0.01, 0.02]]},
        "machine": "test",
    }
    s = parse_schedule(json.dumps(table))
    assert s.form == "tuned"
    assert s.ks == ((4, 6), (2, 3))
    assert any("measurements" in n for n in s.notes)


def test_tuned_table_from_a_file(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"grid": [[1, 8, 3], [9, None, 1]]}))
    s = parse_schedule(str(path))
    assert s.form == "tuned" and s.ks == ((3,), (1,))


def test_rows_from_a_file(tmp_path):
    path = tmp_path / "sched.json"
    path.write_text("[[1, 2, 5], [3, 4, 0]]")
    assert parse_schedule(str(path)).ks == ((5,), (0,))


def test_already_decoded_values():
    assert parse_schedule(3).ks == ((3,),)
    assert parse_schedule([[1, 2, 1]]).ks == ((1,),)


# (schedule, the entry the message must name, a fragment of the rule)
MALFORMED = [
    ("[[1, 8, 4], [10, 16, 2]]", "entry 1 [10, 16, 2]", "gap"),
    ("[[1, 8, 4], [8, 16, 2]]", "entry 1 [8, 16, 2]", "overlaps"),
    ("[[1, 8, 4], [1, 8, 2]]", "entry 1 [1, 8, 2]", "duplicate"),
    ("[[2, 8, 4]]", "entry 0 [2, 8, 4]", "start at 1"),
    ("[[0, 8, 4]]", "entry 0 [0, 8, 4]", "batch_lo must be >= 1"),
    ("[[1, 8, -1]]", "entry 0 [1, 8, -1]", "K must be >= 0"),
    ("[[1, 8, true]]", "entry 0 [1, 8, true]", "K must be an integer"),
    ("[[1, 8, 2.5]]", "entry 0 [1, 8, 2.5]", "K must be an integer"),
    ("[[1, 8.0, 2]]", "entry 0 [1, 8.0, 2]", "batch_hi must be an integer"),
    ("[[true, 8, 2]]", "entry 0 [true, 8, 2]", "batch_lo must be an integer"),
    ("[[null, 8, 2]]", "entry 0 [null, 8, 2]", "batch_lo must be an integer"),
    ("[[1, 8, null]]", "entry 0 [1, 8, null]", "K must be an integer"),
    ('[[1, 8, "4"]]', 'entry 0 [1, 8, "4"]', "K must be an integer"),
    ("[[5, 3, 1]]", "entry 0 [5, 3, 1]", "below batch_lo"),
    ("[[1, 8, 1, 512, 9999]]", "entry 0 [1, 8, 1, 512, 9999]", f"K must be <= {MAX_SCHEDULE_K}"),
    ("[[1, 8, 4], [9, 16]]", "entry 1 [9, 16]", "has 2 fields"),
    ("[[1, 8, 4], 7]", "entry 1 7", "must be a list"),
    ("[[1, 8, 4], [9, 16, 1, 5, 2]]", "entry 1 [9, 16, 1, 5, 2]", "mixes row forms"),
    ("[[1, 8, 1, 5, 2], [9, 16, 4]]", "entry 1 [9, 16, 4]", "mixes row forms"),
    ("[[1, null, 4], [9, 16, 2]]", "entry 1 [9, 16, 2]", "overlaps"),
    ("[[1, 8, 1, 10, 2], [1, 8, 12, null, 3]]", "entry 1 [1, 8, 12, null, 3]", "gap: ctx 11"),
    ("[[1, 8, 2, 10, 2]]", "entry 0 [1, 8, 2, 10, 2]", "ctx ranges must start at 1"),
    ("[[1, 8, 1, 10, 2], [1, 8, 5, null, 3]]", "entry 1 [1, 8, 5, null, 3]", "overlaps"),
    ("[[1, 8, 0, 10, 2]]", "entry 0 [1, 8, 0, 10, 2]", "ctx_lo must be >= 1"),
    (
        "[[1, 8, 1, 512, 4], [1, 8, 513, null, 2], [9, 16, 1, 256, 3], [9, 16, 257, null, 1]]",
        "entry 3 [9, 16, 257, null, 1]",
        "not rectangular",
    ),
    (
        "[[1, 8, 1, 512, 4], [1, 8, 513, null, 2], [9, 16, 1, 512, 3]]",
        "entry 2 [9, 16, 1, 512, 3]",
        "lacks ctx range 513-inf",
    ),
    (
        "[[1, 8, 1, 512, 4], [1, 8, 513, null, 2], [9, 16, 1, 512, 3], [9, 16, 513, null, 3], [12, "
        "20, 1, 512, 1]]",
        "entry 4 [12, 20, 1, 512, 1]",
        "overlaps",
    ),
    ('{"grid": [[1, 8, 4], [10, 16, 2]]}', "grid entry 1 [10, 16, 2]", "gap"),
]


@pytest.mark.parametrize("spec,entry,rule", MALFORMED, ids=[m[2] + ":" + m[1] for m in MALFORMED])
def test_malformed_entry_names_entry_and_rule(spec, entry, rule):
    with pytest.raises(ScheduleError) as info:
        parse_schedule(spec)
    msg = str(info.value)
    assert entry in msg, msg
    assert rule in msg, msg


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("[]", "empty list"),
        ("{\"grid\": []}", "empty list"),
        ("{\"rows\": [[1, 2, 3]]}", "needs a \"grid\""),
        ("{\"grid\": 4}", "must be a list"),
        ("4.0", "expected an integer K"),
        ("true", "expected an integer K"),
        ("\"4\"", "expected an integer K"),
        ("-1", "K must be >= 0"),
        ("[[1, 8, 4]", "neither valid JSON"),
        ("/no/such/schedule.json", "nor an existing file"),
    ],
)
def test_malformed_top_level(spec, fragment):
    with pytest.raises(ScheduleError) as info:
        parse_schedule(spec)
    assert fragment in str(info.value)


def test_bad_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[[1, 2,")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        parse_schedule(str(path))


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)
