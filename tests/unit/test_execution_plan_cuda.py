"""CUDA defaults of the execution plan and the start-up cost profile (run on any machine)."""

from __future__ import annotations

from dynaspec.spec_decode.plan.execution_plan import AdmissionEntry, AdmissionTable, ExecutionPlan
from dynaspec.spec_decode.plan.plan import SpecPlan
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.cost_profile import ProfileSettings, gpu_profile_settings


def test_auto_on_cuda_runs_graphs_unless_measured_otherwise():
    plan = SpecPlan.constant(3)
    auto = ExecutionPlan.build(plan, 8, "auto", "cuda")
    assert auto.descriptor(3, 4, 12).path == "cuda_graph"
    assert auto.path_for(4, 4) == ("cuda_graph", "unmeasured on CUDA -> graphs (default)")
    assert auto.descriptor(3, None, 40).path == "eager", "mixed prefill steps stay eager"
    slower = AdmissionTable((AdmissionEntry(4, 4, 1.2, 1.1, 1.3, 1.0, 1.2),))
    measured = ExecutionPlan.build(plan, 8, "auto", "cuda", slower)
    assert measured.descriptor(3, 4, 12).path == "eager", "a measured table overrides it"
    assert measured.descriptor(1, 4, 4).path == "cuda_graph"
    assert ExecutionPlan.build(plan, 8, "auto", "cpu").descriptor(3, 4, 12).path == "eager"


def test_gpu_profile_takes_a_width_tie_the_cpu_settings_refuse():
    grid = CostGrid((1, 64), (128,), (1, 2))
    # width 2 read 25% cheaper than width 1 at batch 64 (launch-bound noise on a GPU)
    secs = [[[2.0e-3, 2.1e-3]], [[4.0e-3, 3.0e-3]]]
    model = StepCostModel(grid, secs, source="test")
    cpu, gpu = ProfileSettings(), gpu_profile_settings()
    assert model.monotone_problems(cpu.monotone_tolerance, cpu.floor_s)
    assert not model.monotone_problems(gpu.monotone_tolerance, gpu.floor_s)
    assert gpu.reps > cpu.reps
