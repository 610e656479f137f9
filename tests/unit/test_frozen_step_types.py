"""Every type that crosses the step's seams is frozen: no plan, draft row, result or landed step
is changed after it is built (docs/design.md §1b)."""

from __future__ import annotations

import dataclasses

import pytest

from dynaspec.draft_tree import DraftTree
from dynaspec.engine.phases import Landed, Launched
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.scheduler.scheduler import Hold, StepUpdate
from dynaspec.step_plan import BatchDescriptor, ScheduledRequest, StepPlan
from dynaspec.structured.step import GrammarCommit
from dynaspec.worker.draft_rows import DraftRow, DraftRows, StepDrafts
from dynaspec.worker.model_runner import PreparedStep, StepInputs
from dynaspec.worker.tree_step import TreeRows

STEP_TYPES = [StepPlan, ScheduledRequest, BatchDescriptor, StepDrafts, DraftRow, DraftRows,
              DraftTree, TreeRows, SamplingMetadata, StepInputs, PreparedStep, GrammarCommit,
              RequestResult, RunnerOutput, Launched, Hold, StepUpdate, Landed]


def _instance(cls: type) -> object:
    """An instance with a placeholder in every field without a default (no validation runs:
    only assignment is under test). DraftTree validates, so it gets a real tree."""
    if cls is DraftTree:
        return DraftTree((1,), (-1,))
    required = {f.name: object() for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**required)


@pytest.mark.parametrize("cls", STEP_TYPES, ids=lambda c: c.__name__)
def test_step_types_are_frozen(cls: type) -> None:
    assert dataclasses.is_dataclass(cls) and dataclasses.fields(cls)
    obj = _instance(cls)
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, f.name, None)
