"""The device recipe's answer files: split under the transfer limit, at most ANSWER_FILES of
them, read back as the sequences that were written (prompt, answer, kind)."""

from __future__ import annotations

import os

from dynaspec.train import eagle_recipe as R


def test_answers_round_trip_in_capped_files(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "FILE_BYTES", 200)  # 100 tokens a file
    r = R.Recipe({"OUT": str(tmp_path), "DRY_RUN": "1"})
    ids = [[1000 + i] * (5 + i % 7) for i in range(60)]
    kinds = ["chat" if i % 3 else "code_edit" for i in range(60)]
    r.answers = {i: [40000 + i] * (3 + i % 5) + [2] for i in range(60)}
    done = sorted(r.answers)
    written = R.Recipe.write_answers(r, ids, kinds, done, (2, 0))
    files = sorted(f for f in os.listdir(tmp_path) if f.startswith("answers-"))
    assert files == [f"answers-{i}.npz" for i in range(R.ANSWER_FILES)]
    assert all(os.path.getsize(tmp_path / f) < 2000 for f in files)
    seqs = R.read_answers(str(tmp_path))
    assert len(seqs) == written and 10 < written < 60  # the rest did not fit the cap
    for s, i in zip(seqs, done):
        assert s.ids == ids[i] + r.answers[i] and s.prompt_len == len(ids[i])
        assert s.kind == kinds[i]
