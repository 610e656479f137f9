"""Training text for a draft head, from what this machine has offline, kept apart from the bench
prompts.

Two sources, token sequences of the target's tokenizer:
- Python standard library sources, excluding every module the bench workloads draw prompts from
  (bench/workloads.py _CODE_MODULES and _DOC_MODULES), so acceptance measured on those prompts
  is on text the head never saw;
- the target's own greedy answers to chat prompts made here (templated questions about other
  stdlib modules and code-edit instructions on their functions; never the bench's
  CHAT_QUESTIONS), so the head learns the target's own style on the answers it drafts for.
Built once per output folder (corpus.pt) so a resumed run trains on the same sequences.
"""

from __future__ import annotations

import ast
import os
import random
import textwrap
from dataclasses import dataclass

from dynaspec.bench import workloads
from dynaspec.train import chat_topics

_TOPICS = (
    "Explain what the Python module `{m}` is for and show a short example.",
    "What are common mistakes when using `{m}` in Python?",
    "Summarise in a few sentences how `{m}` works.",
    "Write a short tutorial on `{m}` for a beginner.",
)
_GENERAL = (
    "Write a Python function that {t}, with a docstring.",
    "Explain step by step how to {t} in Python.",
)
_TASKS = (
    "reverses the words of a sentence", "counts vowels in a string", "merges two sorted lists",
    "checks whether a number is prime", "flattens a nested list", "parses a date string",
    "reads a CSV file into dictionaries", "computes a moving average", "removes duplicates keeping "
    "order",
    "finds the longest common prefix", "converts Celsius to Fahrenheit", "validates an email "
    "address",
    "groups words by their first letter", "computes the factorial iteratively", "sorts a list of "
    "tuples",
    "retries a function call with backoff", "chunks a list into pieces of size n",
)  # fmt: skip


@dataclass(frozen=True)
class Corpus:
    sequences: list[list[int]]  # token ids, each at most seq_len
    num_generated: int  # of them, prompt + the target's own answer


def held_out_modules() -> set[str]:
    return set(workloads._CODE_MODULES) | set(workloads._DOC_MODULES)


def stdlib_files(seed: int) -> list[str]:
    """Relative paths of stdlib .py files not used by the bench prompts, in a seeded order."""
    root, skip = workloads.stdlib_dir(), held_out_modules()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(
            x for x in dirs if x not in ("test", "tests", "idlelib", "site-packages", "__pycache__")
        )
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), root)
            if f.endswith(".py") and rel not in skip and "test" not in rel:
                out.append(rel)
    random.Random(seed).shuffle(out)
    return out


def text_windows(tokenizer, files: list[str], seq_len: int, max_tokens: int) -> list[list[int]]:
    """Files cut into windows of seq_len tokens until max_tokens are collected."""
    seqs, total = [], 0
    for rel in files:
        try:
            with open(os.path.join(workloads.stdlib_dir(), rel), encoding="utf-8") as fh:
                ids = list(tokenizer.encode(fh.read()))
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(0, max(1, len(ids) - 32), seq_len):
            seqs.append(ids[i: i + seq_len])
            total += len(seqs[-1])
            if total >= max_tokens:
                return seqs
    return seqs


def chat_prompts(files: list[str], n: int, seed: int) -> list[str]:
    """n prompts in a fixed mix of every 20: 8 everyday questions (chat_topics), 7 code-edit
    instructions on functions of non-held-out modules (the bench's edit kinds, on other code),
    3 general coding asks and 2 questions about stdlib modules."""
    rng = random.Random(seed)
    prompts = []
    mods = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in files]
    for i in range(n):
        kind = i % 20
        if kind < 8:
            prompts.append(chat_topics.everyday_prompt(rng))
        elif kind < 15:
            prompts.append(
                _edit_prompt(rng, files) or rng.choice(_TOPICS).format(m=rng.choice(mods))
            )
        elif kind < 18:
            prompts.append(rng.choice(_GENERAL).format(t=rng.choice(_TASKS)))
        else:
            prompts.append(rng.choice(_TOPICS).format(m=rng.choice(mods)))
    return prompts


def _edit_prompt(rng: random.Random, files: list[str]) -> str | None:
    """A bench-style edit instruction (workloads' own wording and edit kinds) on a function of
    8-25 lines: short enough that prompt and answer fit one training sequence, so the copy the
    head learns to draft is of text it has seen."""
    rel = rng.choice(files)
    try:
        with open(os.path.join(workloads.stdlib_dir(), rel), encoding="utf-8") as fh:
            text = fh.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    fns = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and 8 <= (n.end_lineno or 0) - n.lineno <= 25
    ]
    if not fns:
        return None
    fn = rng.choice(fns)
    src = textwrap.dedent("".join(lines[fn.lineno - 1: fn.end_lineno]))
    func = workloads._Function(rel, fn.name, src, fn.lineno - 1, fn.end_lineno or 0,
                               workloads.renamable_params(fn))
    _, instruction = workloads._edit_instruction(func, rng)
    return f"{instruction}\n\n```python\n{src}```"


def generate_answers(llm, prompts: list[str], max_tokens: int, seq_len: int) -> list[list[int]]:
    """Prompt + the target's greedy answer, as token ids (one engine call: batched)."""
    from dynaspec.sampling_params import SamplingParams

    tok = llm.tokenizer
    ids = [
        list(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])))[-seq_len // 2 :]
        for p in prompts
    ]
    outs = llm.generate(ids, [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(ids))
    return [(i + list(o.token_ids))[:seq_len] for i, o in zip(ids, outs)]
