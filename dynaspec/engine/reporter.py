"""EngineReporter: the engine's read-only facts for fronts and reports (engine/client.py), apart
from the step: the KV pools, the model card, queue occupancy, the snapshot behind `/metrics`.

It reads the parts the builder made and the step recorder's totals; it changes nothing. The
engine answers the client protocol's reporting calls through it.
"""

from __future__ import annotations

from dynaspec.config import EngineConfig
from dynaspec.engine.builder import EngineParts
from dynaspec.engine.client import EngineState, ModelCard, PoolReport
from dynaspec.engine.step_recorder import StepRecorder
from dynaspec.metrics.records import EngineSnapshot
from dynaspec.metrics.stats import RequestSpecSummary


class EngineReporter:
    def __init__(self, config: EngineConfig, parts: EngineParts, recorder: StepRecorder) -> None:
        self.config, self.parts, self.recorder = config, parts, recorder

    @property
    def lossless(self) -> bool:
        """False under --rejection-mode synthetic: output is not the target's (even greedy)."""
        return self.config.spec.lossless or not self.parts.plan.speculating

    def request_spec(self, request_id: str) -> RequestSpecSummary | None:
        if self.parts.plan.kind == "off":
            return None
        return self.recorder.request_spec(request_id, self.lossless)

    def pool_report(self) -> PoolReport:
        p, proposer = self.parts, self.parts.runner.proposer
        return PoolReport(
            num_blocks=p.kv.num_blocks,
            block_size=p.kv.block_size,
            num_tokens=p.kv.num_blocks * p.kv.block_size,
            drafter_num_tokens=p.drafter_kv_tokens,
            drafter_cache=proposer.cache_stats() if proposer is not None else None,
        )

    def model_card(self) -> ModelCard:
        info, cc = self.parts.policy_info, self.config.cache
        return ModelCard(
            max_model_len=self.parts.max_model_len,
            vocab_size=self.parts.vocab_size,
            spec_plan=self.parts.plan.to_json(),
            k_policy=info.to_json() if info is not None else None,
            lossless=self.lossless,
            execution_plan=self.parts.exec_plan.to_json(),
            block_size=cc.block_size,
            prefix_caching=cc.enable_prefix_caching,
        )

    def state(self) -> EngineState:
        sch, kv = self.parts.scheduler, self.parts.kv
        return EngineState(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            kv_num_blocks=kv.num_blocks,
            kv_free_blocks=kv.num_free_blocks(),
            kv_usage=kv.usage(),
        )

    def snapshot(self) -> EngineSnapshot:
        sch, kv = self.parts.scheduler, self.parts.kv
        pool, policy, info = self.pool_report(), sch.policy, self.parts.policy_info
        modelled, observed = policy.goodput_report() if policy is not None else (None, None)
        return EngineSnapshot(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            kv_usage=kv.usage(),
            kv_pool_tokens_target=pool.num_tokens,
            kv_pool_tokens_drafter=pool.drafter_num_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=sch.num_preemptions,
            modelled_goodput=modelled,
            observed_goodput=observed,
            k_policy=info.name if info else None,
            k_policy_reprobes=policy.num_reprobes if policy is not None else 0,
        )
