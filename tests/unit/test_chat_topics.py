"""The draft-head corpus's prompts: everyday subjects apart from the bench's chat questions, the
fixed mix of prompt kinds, and code-edit prompts in the bench's own wording on other modules."""

from __future__ import annotations

import random

from dynaspec.bench import workloads
from dynaspec.train import chat_topics, corpus


def test_no_subject_shares_a_content_word_with_a_bench_question():
    assert chat_topics.overlapping_subjects() == []
    assert len(set(chat_topics.SUBJECTS)) == len(chat_topics.SUBJECTS) >= 150


def test_the_overlap_check_catches_a_shared_word(monkeypatch):
    monkeypatch.setattr(chat_topics, "SUBJECTS", ("hash maps", "volcanoes", "dining tables"))
    assert chat_topics.overlapping_subjects() == ["hash maps", "dining tables"]


def test_prompt_mix_and_edit_prompts_stay_off_the_bench_modules():
    files = corpus.stdlib_files(0)
    assert not set(files) & corpus.held_out_modules()
    prompts = corpus.chat_prompts(files, 40, seed=3)
    assert prompts == corpus.chat_prompts(files, 40, seed=3)  # seeded
    edits = [p for p in prompts if p.startswith("Repeat the Python function")]
    everyday = [p for p in prompts if any(s in p for s in chat_topics.SUBJECTS)]
    assert len(everyday) >= 16 and 10 <= len(edits) <= 14  # 8 and 7 of every 20
    assert all("```python\n" in p and p.rstrip().endswith("```") for p in edits)
    assert not any(q in p for p in prompts for q in workloads.CHAT_QUESTIONS)
    assert chat_topics.everyday_prompt(random.Random(1)) != ""
