"""Optional dependencies: import one, or fail with the pip command for the extra that has it.

The base install (`pip install dynaspec`) runs the engine, `generate`, `schedule`, `tune` and the
bench statistics. Everything else lives in an extra of pyproject.toml; an edge module that needs
one calls `require(...)` at import, so a missing package is a `MissingExtraError` naming the
extra, which the CLI prints and exits 2 on, instead of a bare ModuleNotFoundError traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the import names it provides (pyproject.toml [project.optional-dependencies]).
EXTRAS = {
    "server": ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"),
    "bench": ("matplotlib", "httpx", "schemathesis"),
    "peers": ("transformers", "accelerate"),
    "train": ("matplotlib",),
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message says which extra installs it."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs the package '{module}', which is not installed: "
                         f"pip install 'dynaspec[{extra}]'", name=module)
        self.module, self.extra = module, extra


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import `module` or raise MissingExtraError (e.g. "the server needs ...")."""
    if module.split(".")[0] not in EXTRAS[extra]:
        raise ValueError(f"{module!r} is not part of the {extra!r} extra")
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(module, extra, purpose) from None


def require_extra(extra: str, purpose: str) -> None:
    """Check that every package of `extra` imports (call before a module that needs them all)."""
    for module in EXTRAS[extra]:
        require(module, extra, purpose)
