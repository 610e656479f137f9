"""The prompts the target answers for the draft head's data at scale (10^5 and more): everyday
chat, explanations, lists, code edits, coding asks and two-turn conversations, seeded, distinct,
and never the bench's.

Held out, and checked here (`leaks`, tested):
- no prompt contains a bench chat question, and no subject shares a content word with one
  (chat_topics' rule, applied to every subject list below; a subject that would is dropped);
- code comes only from stdlib files outside the bench's code and documentation modules
  (corpus.held_out_modules), so no code-edit, summarize or agentic prompt's function is seen.
The stdlib differs between Python versions, so the code-edit prompts do too: the answers file
carries the prompt tokens, and the report the Python version and a hash of the prompt list.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import random
import textwrap
from dataclasses import dataclass

from dynaspec.bench import workloads
from dynaspec.train import chat_topics, corpus
from dynaspec.train.prompt_words import (
    CHAT_TEMPLATES,
    EXPLAIN_PAIRS,
    FOLLOW_UPS,
    LIST_TEMPLATES,
    MORE_SUBJECTS,
    STYLES,
    WRITE_TASKS,
    WRITE_TEMPLATES,
)

# Of every 20 prompts: kind names, in order.
MIX = ("chat",) * 7 + ("explain",) * 3 + ("list",) * 2 + ("code_edit",) * 5 + ("code_write",) * 1 \
    + ("multi_turn",) * 2


@dataclass(frozen=True)
class Prompt:
    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content) turns, the last a user turn


def subjects() -> tuple[str, ...]:
    """chat_topics' subjects and the extra ones, minus any sharing a word with a bench question."""
    held = {w[:5] for q in workloads.CHAT_QUESTIONS for w in chat_topics._words(q)}
    out = dict.fromkeys(chat_topics.SUBJECTS + MORE_SUBJECTS)
    return tuple(s for s in out if not any(w[:5] in held for w in chat_topics._words(s)))


@dataclass(frozen=True)
class _Fn:
    name: str
    source: str
    params: tuple[str, ...]


def stdlib_functions(seed: int) -> list[_Fn]:
    """Functions of 6-30 lines from stdlib files off the bench's modules, in a seeded order."""
    out = list(_functions())
    random.Random(seed).shuffle(out)
    return out


@functools.lru_cache(maxsize=1)
def _functions() -> tuple[_Fn, ...]:
    """Each file parsed once; a function whose text is also one of a bench module's (the stdlib
    has a few copies) is left out."""
    held = {_body(f.source) for f in workloads.stdlib_functions(1, 10**6)}
    out = []
    for rel in sorted(corpus.stdlib_files(0)):
        try:
            with open(os.path.join(workloads.stdlib_dir(), rel), encoding="utf-8") as fh:
                text = fh.read()
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and 6 <= (n.end_lineno or 0) - n.lineno <= 30:
                src = textwrap.dedent("".join(lines[n.lineno - 1: n.end_lineno]))
                if src not in held:
                    out.append(_Fn(n.name, src, workloads.renamable_params(n)))
    return tuple(out)


def _body(source: str) -> str:
    """A function's text without its decorator lines (the bench's sources include them)."""
    lines = source.splitlines(keepends=True)
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    return "".join(lines)


def _edit(fn: _Fn, rng: random.Random) -> str:
    """An instruction whose answer is mostly the function again (the bench's kind of edit, plus
    a few more), followed by the code."""
    kinds = ["docstring", "type_hints", "comment_returns", "rename_fn", "comment_loops"]
    kinds += ["rename"] * bool(fn.params)
    kind = rng.choice(kinds)
    head = f"Repeat the Python function `{fn.name}`"
    if kind == "rename":
        old = rng.choice(fn.params)
        text = (f"{head} exactly, but rename the parameter `{old}` to `{old}_value` everywhere it "
                "is used. Output only the code.")
    else:
        text = {
            "docstring": f"{head} exactly, adding a short docstring (replace the existing one if "
                         "it has one). Output only the code.",
            "type_hints": f"{head}, adding type hints to its parameters and return value. Change "
                          "nothing else. Output only the code.",
            "comment_returns": f"{head} exactly, adding a one-line comment above each return "
                               "statement. Output only the code.",
            "rename_fn": f"{head} exactly, but rename the function to `{fn.name}_v2`. Output only "
                         "the code.",
            "comment_loops": f"{head} exactly, adding a one-line comment above each loop and each "
                             "if statement. Output only the code.",
        }[kind]
    return f"{text}\n\n```python\n{fn.source}```"


def _one(kind: str, rng: random.Random, subs: tuple[str, ...], fns: list[_Fn]) -> Prompt:
    s, n, style = rng.choice(subs), rng.choice((3, 4, 5, 6, 7)), rng.choice(STYLES)
    if kind == "chat":
        text = rng.choice(CHAT_TEMPLATES).format(s=s, n=n) + style
    elif kind == "explain":
        a, b = rng.choice(EXPLAIN_PAIRS)
        text = rng.choice((
            "Explain the difference between {a} and {b}.",
            "Compare {a} with {b} in a few sentences.",
            "When would I choose {a} over {b}?",
            "What do {a} and {b} have in common, and how do they differ?",
        )).format(a=a, b=b) + style
    elif kind == "list":
        text = rng.choice(LIST_TEMPLATES).format(s=s, n=n) + style
    elif kind == "code_edit":
        text = _edit(fns[rng.randrange(len(fns))], rng)
    elif kind == "code_write":
        text = rng.choice(WRITE_TEMPLATES).format(t=rng.choice(WRITE_TASKS)) + style
    else:
        return _two_turns(rng, s, n, fns)
    return Prompt(kind, (("user", text),))


def _two_turns(rng: random.Random, s: str, n: int, fns: list[_Fn]) -> Prompt:
    """A second user turn after a first exchange: a code edit after the function was shown
    back, or a follow-up after a short first answer."""
    if rng.random() < 0.4:
        fn = fns[rng.randrange(len(fns))]
        first = f"Show me the Python function `{fn.name}` and nothing else."
        reply = f"```python\n{fn.source}```"
        then = _edit(fn, rng).split("\n\n```python")[0].replace("Repeat", "Now repeat")
        return Prompt("multi_turn", (("user", first), ("assistant", reply), ("user", then)))
    first = rng.choice(CHAT_TEMPLATES).format(s=s, n=n)
    reply = (f"Sure. {s[0].upper() + s[1:]} is a broad topic, so here is the short version: it "
             "has a few key ideas, and each is easy to learn one step at a time.")
    return Prompt("multi_turn", (("user", first), ("assistant", reply),
                                 ("user", rng.choice(FOLLOW_UPS).format(s=s, n=n))))


def make_prompts(n: int, seed: int) -> list[Prompt]:
    """n distinct prompts in MIX's proportions (a kind that runs out of new prompts after many
    tries gives its place to the next kind), seeded."""
    rng = random.Random(seed)
    subs, fns = subjects(), stdlib_functions(seed)
    seen: set[tuple] = set()
    out: list[Prompt] = []
    i = misses = 0
    while len(out) < n:
        kind = MIX[(i + misses // 50) % len(MIX)]
        p = _one(kind, rng, subs, fns)
        if p.messages in seen:
            misses += 1
            if misses > 50 * n:
                raise RuntimeError(f"only {len(out)} distinct prompts could be made of {n}")
            continue
        seen.add(p.messages)
        out.append(p)
        i += 1
    return out


def leaks(prompts: list[Prompt]) -> list[str]:
    """Prompts that contain a bench chat question or a function from a held-out module: must be
    empty."""
    held_fns = {_body(f.source) for f in workloads.stdlib_functions()}  # what the bench uses
    bad = []
    for p in prompts:
        text = "\n".join(c for _, c in p.messages)
        if any(q in text for q in workloads.CHAT_QUESTIONS) or any(
                f in text for f in held_fns if "```" in text):
            bad.append(text[:80])
    return bad


def chat_ids(tokenizer, prompts: list[Prompt], max_tokens: int
             ) -> tuple[list[list[int]], list[int]]:
    """The prompts through the chat template as token ids, and the indices of those kept (at
    most max_tokens long: longer ones are dropped, not cut)."""
    texts = render(tokenizer, prompts)
    enc = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    ids, keep = [], []
    for i, e in enumerate(enc):
        if len(e.ids) <= max_tokens:
            ids.append(list(e.ids))
            keep.append(i)
    return ids, keep


def render(tokenizer, prompts: list[Prompt]) -> list[str]:
    """The chat template applied to each prompt. The template is rendered once per sequence of
    roles, with markers where the contents go, and the contents put in by replacement (Jinja
    took ~1 ms a prompt); a role sequence where that differs from a real rendering of its first
    prompt is rendered one by one."""
    def slow(p: Prompt) -> str:
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in p.messages])

    forms: dict[tuple, tuple[str, ...] | None] = {}
    out = []
    for p in prompts:
        roles = tuple(r for r, _ in p.messages)
        if roles not in forms:
            marks = [f"\x00{i}\x00" for i in range(len(roles))]
            text = slow(Prompt(p.kind, tuple(zip(roles, marks))))
            pieces = _split(text, marks)
            forms[roles] = pieces if pieces and _join(pieces, p) == slow(p) else None
        pieces = forms[roles]
        out.append(slow(p) if pieces is None else _join(pieces, p))
    return out


def _split(text: str, marks: list[str]) -> tuple[str, ...] | None:
    pieces = []
    for m in marks:
        if text.count(m) != 1:
            return None
        head, text = text.split(m)
        pieces.append(head)
    return (*pieces, text)


def _join(pieces: tuple[str, ...], p: Prompt) -> str:
    return "".join(a + c for a, (_, c) in zip(pieces, p.messages)) + pieces[-1]


def digest(prompts: list[Prompt]) -> str:
    """sha256 of the prompt list (what the report records to tell two recipes apart)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(repr(p.messages).encode())
    return h.hexdigest()
