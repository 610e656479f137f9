"""The `agentic` workload: traffic that repeats across requests, as agent loops produce.

Built offline from stdlib sources and docstrings (deterministic for (n, seed)), in groups of
GROUP consecutive requests, each group one of:
  * ``edit_chain``: one function through successive edits (rename a parameter, comment the
    returns, add a docstring). Step j shows the code with edits 0..j-1 already applied (done
    here, as the agent would have) and asks for edit j, so each answer repeats most of the
    previous answer;
  * ``retry``: the same coding task re-sent after a failed attempt with a different error each
    time, the previous attempt not shown (as many agent loops re-ask). The answers repeat each
    other but not the prompt, so only a drafter that remembers earlier outputs can draft them;
  * ``multiturn``: a chat whose earlier assistant turns (shipped documentation text) the user
    asks to quote back with a small change, one more turn each request.
Requests of a group are adjacent, so at concurrency 1 each one follows its predecessors.
"""

from __future__ import annotations

import random
import re

GROUP = 3
_KINDS = ("edit_chain", "retry", "multiturn")
_ERRORS = (
    "AssertionError: expected 3 items, got 2",
    "TypeError: unsupported operand type(s) for +: 'int' and 'NoneType'",
    "IndexError: list index out of range",
    "the tests timed out after 10 seconds",
)


def _rename(code: str, name: str) -> str:
    return re.sub(rf"\b{re.escape(name)}\b", f"{name}_value", code)


def _comment_returns(code: str) -> str:
    out = []
    for line in code.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped.startswith("return"):
            out.append(line[: len(line) - len(stripped)] + "# the result\n")
        out.append(line)
    return "".join(out)


def _edit_chain(fn, chat_ids) -> list[tuple[list[int], int, str]]:
    steps = []
    code = fn.source
    names = list(fn.names)
    first = ("rename", f"rename the parameter `{names[0]}` to `{names[0]}_value` everywhere") \
        if names else ("type_hints", "add type hints to its parameters and return value")
    edits = [first,
        ("comment_returns", "add the comment `# the result` above each return statement"),
        ("docstring", "add a one-line docstring (replace the existing one if it has one)"),
    ]
    for j, (edit, what) in enumerate(edits[:GROUP]):
        content = (f"We are editing `{fn.name}` step by step. Here is the current version:\n\n"
                   f"```python\n{code}```\n\nRepeat the whole function and {what}. Change nothing "
                   "else. Output only the code.")
        steps.append((chat_ids(content), f"agentic:edit_chain:{fn.module}.{fn.name}:{j}-{edit}"))
        code = _rename(code, names[0]) if edit == "rename" else \
            _comment_returns(code) if edit == "comment_returns" else code
    return [(ids, 0, label) for ids, label in steps]


def _retry(fn, chat_ids, rng: random.Random) -> list[tuple[list[int], int, str]]:
    header = fn.source.splitlines()[0].strip()
    doc = (fn.source.split('"""')[1].strip().splitlines() or [""])[0] if '"""' in fn.source else ""
    task = f"Write the Python function `{header}`" + (f" ({doc})" if doc else "") + "."
    out = []
    for j in range(GROUP):
        err = _ERRORS[rng.randrange(len(_ERRORS))]
        note = (
            ""
            if j == 0
            else f"\n\nAttempt {j + 1}: your previous attempt failed with `{err}`. Try again."
        )
        out.append((chat_ids(f"{task} Output only the code.{note}"), 0,
                    f"agentic:retry:{fn.module}.{fn.name}:{j}"))
    return out


def _multiturn(rel: str, parts: list[str], template) -> list[tuple[list[int], int, str]]:
    paragraphs = [p for p in parts[0].split("\n\n") if len(p) > 80][:GROUP] or [parts[0][:600]]
    messages = [{"role": "user", "content": f"What does the Python module `{rel}` do?"},
                {"role": "assistant", "content": "\n\n".join(paragraphs)}]
    out = []
    for j in range(GROUP):
        para = paragraphs[j % len(paragraphs)]
        ask = (f"Quote this part of your answer again word for word, then add one sentence "
               f"explaining it: \"{para[:60]}...\"")
        turn = messages + [{"role": "user", "content": ask}]
        out.append((template(turn), 0, f"agentic:multiturn:{rel}:{j}"))
        # The next turn quotes this one: the assistant's reply is the paragraph it was asked for.
        messages = turn + [{"role": "assistant", "content": para}]
    return out


def build_agentic(tokenizer, n: int, seed: int, functions, docs, pick, work_item):
    """n WorkItems in groups of GROUP (module docstring), from the given stdlib candidates."""
    rng = random.Random(seed)

    def template(messages: list[dict]) -> list[int]:
        return list(tokenizer.encode(tokenizer.apply_chat_template(messages)))

    def chat_ids(content: str) -> list[int]:
        return template([{"role": "user", "content": content}])

    groups = -(-n // GROUP)
    fns, mods = pick(list(functions), groups, rng), pick(list(docs), groups, rng)
    # Retried tasks are named functions (a task "write __init__" says nothing).
    tasks = pick([f for f in functions if not f.name.startswith("_")], groups, rng)
    items = []
    for g in range(groups):
        kind = _KINDS[(seed + g) % len(_KINDS)]
        fn = fns[g]
        if kind == "edit_chain":
            reqs = _edit_chain(fn, chat_ids)
        elif kind == "retry":
            fn = tasks[g]
            reqs = _retry(fn, chat_ids, rng)
        else:
            rel, parts = mods[g]
            reqs = _multiturn(rel, parts, template)
        # An edit repeats the function; a retry writes one from scratch; a quote is a paragraph.
        budget = min(1024, len(tokenizer.encode(fn.source)) + 96) if kind == "edit_chain" else 256
        for ids, _, label in reqs:
            items.append(work_item(ids, budget, label))
    return items[:n]
