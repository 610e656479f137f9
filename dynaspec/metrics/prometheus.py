"""Prometheus export: the ONLY dynaspec module that imports prometheus_client.

Names follow vLLM's where the meaning is the same (docs/design.md §5), under the prefix `dynaspec:`
(colons are legal in metric names; vLLM uses `vllm:`). prometheus_client appends `_total` to
counters in the exposition text, so `dynaspec:spec_decode_num_drafts` is scraped as
`dynaspec:spec_decode_num_drafts_total`.

Speculative decoding (counters, fed by `observe_step` through the same pure fold as the JSON
counters, so the two always agree):
  spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_emitted_tokens,
  _num_accepted_tokens_per_pos{position}, _num_drafted_tokens_per_pos{position},
  _steps{k} (k="0" included; steps with speculation off are not counted here),
  _draft_skips{reason}, _invalid_draft_tokens{reason},
  _num_draft_tokens_by_source{source}, _num_accepted_tokens_by_source{source} (source="grammar":
  drafts a request's grammar forced, docs/design.md §4d; "drafter": its drafter's; under
  --speculator hybrid "eagle" / "ngram" / "suffix": the head's branch or the lookup's chain),
  _draft_seconds, _verify_seconds, _scheduler_seconds.
Token trees (docs/design.md §4c; request-steps whose drafts were a tree verified as one):
  counters spec_decode_tree_steps (engine steps with >= 1 tree), _num_tree_drafts,
  _num_tree_nodes (nodes verified), _num_tree_accepted_tokens, and the histogram
  spec_decode_tree_acceptance_length (1 + drafts accepted, one observation per tree verified);
  spec_decode_tree_nodes{batch}: the size of each tree verified, by the step's batch bucket
  (what the goodput policy chose where: trees shrink to chains or nothing under load).
K policy: gauge k_policy_goodput_tokens_per_second{kind="modelled"|"observed"} (goodput policy),
  k_policy_info{policy} (1 for the policy that runs), k_policy_reprobes (the divergence guard's
  forced K>0 steps, total).
Structured output (from each step's `grammar` record): histograms
  structured_output_compile_seconds (one observation per grammar compiled),
  structured_output_mask_seconds (one per step that masked rows: draft checks, bitmasks,
  masking, grammar state), and the counter structured_output_masked_rows; grammar-rejected
  drafts are spec_decode_invalid_draft_tokens{reason="grammar"}.
Engine: gauges num_requests_running, num_requests_waiting, kv_cache_usage_perc (a fraction 0..1,
as vLLM's), kv_pool_size_tokens{pool="target"|"drafter"}; counters prompt_tokens,
generation_tokens, num_preemptions (from the steps), prefix_cache_queries, prefix_cache_hits (from
the snapshots' running totals); histograms time_to_first_token_seconds,
inter_token_latency_seconds, e2e_request_latency_seconds, request_prompt_tokens,
request_generation_tokens.

PromQL (over a window, e.g. [5m]; add `sum by (...)` when several engines are scraped):
  acceptance rate        rate(dynaspec:spec_decode_num_accepted_tokens_total[5m])
                         / rate(dynaspec:spec_decode_num_draft_tokens_total[5m])
  mean acceptance length 1 + rate(dynaspec:spec_decode_num_accepted_tokens_total[5m])
                         / rate(dynaspec:spec_decode_num_drafts_total[5m])
  per-position rate      rate(dynaspec:spec_decode_num_accepted_tokens_per_pos_total[5m])
    (conditional)        / rate(dynaspec:spec_decode_num_drafted_tokens_per_pos_total[5m])
  skips by reason        sum by (reason) (rate(dynaspec:spec_decode_draft_skips_total[5m]))
  steps by K             sum by (k) (rate(dynaspec:spec_decode_steps_total[5m]))
  prefix-cache hit rate  rate(dynaspec:prefix_cache_hits_total[5m])
                         / rate(dynaspec:prefix_cache_queries_total[5m])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from dynaspec.extras import require

require("prometheus_client", "server", "Prometheus metrics")
from prometheus_client import (  # noqa: E402
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric  # noqa: E402
from prometheus_client.exposition import CONTENT_TYPE_LATEST  # noqa: E402

from dynaspec.metrics.records import (  # noqa: E402 - after the extra check
    EngineSnapshot,
    FinishedRequestTimes,
    StepStats,
)
from dynaspec.metrics.stats import SpecCounters, fold_step  # noqa: E402

PREFIX = "dynaspec:"  # the default; `--metrics-prefix vllm` gives vLLM's names for its dashboards
# No `*_created` series: one per counter and histogram doubled /metrics for a timestamp that
# Prometheus does not need (it tracks resets itself). Global, but this is the only importer.
disable_created_metrics()
CONTENT_TYPE = CONTENT_TYPE_LATEST  # for the server's /metrics response (no import there)

# Buckets as vLLM's (seconds / tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                           30.0)  # fmt: skip
GRAMMAR_MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 1.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)  # fmt: skip

# counter suffix -> SpecCounters field (unlabelled spec counters).
_SPEC_SCALARS = {
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "spec_decode_num_emitted_tokens": "num_emitted_tokens",
    "spec_decode_draft_seconds": "draft_seconds",
    "spec_decode_verify_seconds": "verify_seconds",
    "spec_decode_scheduler_seconds": "scheduler_seconds",
    "prompt_tokens": "num_prompt_tokens",
    "generation_tokens": "num_generation_tokens",
    "num_preemptions": "num_preemptions",
    "spec_decode_tree_steps": "num_tree_steps",
    "spec_decode_num_tree_drafts": "num_tree_drafts",
    "spec_decode_num_tree_nodes": "num_tree_nodes",
    "spec_decode_num_tree_accepted_tokens": "num_tree_accepted_tokens",
}
# counter suffix -> (label, SpecCounters field) for labelled spec counters.
_SPEC_LABELLED = {
    "spec_decode_num_accepted_tokens_per_pos": ("position", "accepted_per_pos"),
    "spec_decode_num_drafted_tokens_per_pos": ("position", "drafted_per_pos"),
    "spec_decode_steps": ("k", "steps_by_k"),
    "spec_decode_draft_skips": ("reason", "draft_skips"),
    "spec_decode_invalid_draft_tokens": ("reason", "invalid_draft_tokens"),
    "spec_decode_num_draft_tokens_by_source": ("source", "draft_tokens_by_source"),
    "spec_decode_num_accepted_tokens_by_source": ("source", "accepted_tokens_by_source"),
}
_DOCS = {
    "spec_decode_num_drafts": "Request-steps that verified >= 1 valid draft token.",
    "spec_decode_num_draft_tokens": "Valid draft tokens verified (invalid/padded excluded).",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the verifier.",
    "spec_decode_num_emitted_tokens": "Tokens returned after stop/EOS/max_tokens truncation.",
    "spec_decode_draft_seconds": "Seconds spent drafting.",
    "spec_decode_verify_seconds": "Seconds spent in the verifying forward and sampler.",
    "spec_decode_scheduler_seconds": "Seconds spent scheduling.",
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Generated tokens.",
    "num_preemptions": "Requests preempted.",
    "spec_decode_num_accepted_tokens_per_pos": "Drafts accepted at each position.",
    "spec_decode_num_drafted_tokens_per_pos": "Drafts verified at each position.",
    "spec_decode_steps": "Engine steps by the K chosen (k=0 included).",
    "spec_decode_draft_skips": "Request-steps without a valid draft, by reason.",
    "spec_decode_invalid_draft_tokens": "Draft tokens excluded as invalid, by reason.",
    "spec_decode_num_draft_tokens_by_source": "Valid draft tokens verified, by source (grammar: "
                                              "forced by the request's grammar; drafter; "
                                              "--speculator hybrid: eagle, ngram or suffix).",
    "spec_decode_num_accepted_tokens_by_source": "Draft tokens accepted, by source.",
    "spec_decode_tree_steps": "Engine steps that verified >= 1 draft token tree.",
    "spec_decode_num_tree_drafts": "Request-steps whose drafts were a tree verified as one.",
    "spec_decode_num_tree_nodes": "Draft tree nodes verified.",
    "spec_decode_num_tree_accepted_tokens": "Draft tree nodes accepted (the accepted path).",
}
TREE_LENGTH_BUCKETS = tuple(range(1, 18))  # 1 + accepted: a tree of <= 16 nodes, one per depth
TREE_NODE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BATCH_BUCKETS = ((1, "1"), (4, "2-4"), (16, "5-16"), (64, "17-64"))  # larger: "65+"


def batch_bucket(n: int) -> str:
    """The label of a step's batch size (requests in the step)."""
    return next((name for hi, name in BATCH_BUCKETS if n <= hi), "65+")


class PrometheusMetrics:
    """The engine's Prometheus metrics over `registry` (default: a new one, never the global).

    `labels` are constant labels on every series (e.g. {"model_name": ..., "engine": "0"}, as
    vLLM's dashboards filter on). Not reentrant across threads for `observe_snapshot`.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        labels: Mapping[str, str] | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.prefix = prefix if prefix.endswith(":") else prefix + ":"
        self.registry = registry if registry is not None else CollectorRegistry()
        self._base = dict(labels or {})
        names = list(self._base)
        reg = self.registry
        self._scalars = {
            suffix: Counter(self.prefix + suffix, _DOCS[suffix], names, registry=reg)
            for suffix in _SPEC_SCALARS
        }
        self._labelled = {
            suffix: Counter(self.prefix + suffix, _DOCS[suffix], names + [label], registry=reg)
            for suffix, (label, _) in _SPEC_LABELLED.items()
        }
        self._build_engine_metrics(names)
        self._exec_steps = Counter(
            self.prefix + "execution_steps", "Engine steps by execution path (eager, compiled, "
            "cuda_graph) and verify width ('mixed' for prefill+decode steps).",
            names + ["path", "width"], registry=reg,
        )  # fmt: skip
        self._last_prefix: tuple[int, int] | None = None

    def _build_engine_metrics(self, names: list[str]) -> None:
        reg, p = self.registry, self.prefix
        self._running = Gauge(p + "num_requests_running", "Requests running.", names, registry=reg)
        self._waiting = Gauge(p + "num_requests_waiting", "Requests waiting.", names, registry=reg)
        self._kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Fraction of target KV blocks in use (0..1).", names,
            registry=reg,
        )  # fmt: skip
        self._kv_pool = Gauge(
            p + "kv_pool_size_tokens", "KV pool size in tokens, per pool (target, drafter).",
            names + ["pool"], registry=reg,
        )  # fmt: skip
        self._goodput = Gauge(
            p + "k_policy_goodput_tokens_per_second", "Decode-step goodput of the K policy, "
            "as modelled by its cost model and as observed (EMAs over the same steps).",
            names + ["kind"], registry=reg,
        )  # fmt: skip
        self._policy = Gauge(p + "k_policy_info", "The K policy that runs (value 1).",
                             names + ["policy"], registry=reg)
        self._reprobes = Gauge(p + "k_policy_reprobes", "K>0 steps the goodput policy's "
                               "divergence guard forced (total).", names, registry=reg)
        self._pc_queries = Counter(
            p + "prefix_cache_queries", "Prefix-cache tokens queried.", names, registry=reg
        )
        self._pc_hits = Counter(p + "prefix_cache_hits", "Prefix-cache tokens hit.", names,
                                registry=reg)  # fmt: skip
        hist = [
            ("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
            ("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS),
            ("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS),
            ("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS),
            ("request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS),
        ]
        hist += [
            ("structured_output_compile_seconds", "Seconds to compile one grammar.",
             GRAMMAR_COMPILE_BUCKETS),
            ("structured_output_mask_seconds", "Grammar work per step that masked rows.",
             GRAMMAR_MASK_BUCKETS),
            ("spec_decode_tree_acceptance_length", "Tokens a verified draft tree gave (1 + its "
             "accepted path), per tree.", TREE_LENGTH_BUCKETS),
        ]
        self._hist = {
            name: Histogram(p + name, doc, names, buckets=buckets, registry=reg)
            for name, doc, buckets in hist
        }
        self._tree_nodes = Histogram(
            p + "spec_decode_tree_nodes", "Nodes of each draft tree verified, by the step's "
            "batch size (requests in the step): the tree sizes the K policy chose.",
            names + ["batch"], buckets=TREE_NODE_BUCKETS, registry=reg)
        self._masked_rows = Counter(p + "structured_output_masked_rows",
                                    "Logits rows masked by a grammar.", names, registry=reg)

    def _child(self, metric, **extra: str):
        labels = {**self._base, **extra}
        return metric.labels(**labels) if labels else metric

    def observe_step(self, step: StepStats) -> None:
        """Add one engine step. Validates (through the fold) before touching any series."""
        self._add(fold_step(SpecCounters(), step))
        batch = batch_bucket(len(step.requests))
        for r in step.requests:
            if r.num_tree_nodes:
                self._child(self._hist["spec_decode_tree_acceptance_length"]).observe(
                    1 + r.num_accepted_tokens)
                self._child(self._tree_nodes, batch=batch).observe(r.num_tree_nodes)
        g = step.grammar
        if g is not None:
            for dt in g.compile_seconds:
                self._child(self._hist["structured_output_compile_seconds"]).observe(dt)
            if g.num_masked_rows:
                self._child(self._hist["structured_output_mask_seconds"]).observe(g.mask_seconds)
                self._child(self._masked_rows).inc(g.num_masked_rows)
        if step.path is not None:
            self._child(self._exec_steps, path=step.path, width=step.width or "mixed").inc()

    def _add(self, delta: SpecCounters) -> None:
        for suffix, field_name in _SPEC_SCALARS.items():
            self._child(self._scalars[suffix]).inc(getattr(delta, field_name))
        for suffix, (label, field_name) in _SPEC_LABELLED.items():
            value = getattr(delta, field_name)
            items = enumerate(value) if isinstance(value, tuple) else value.items()
            for key, n in items:
                self._child(self._labelled[suffix], **{label: str(key)}).inc(n)

    def observe_snapshot(self, snap: EngineSnapshot) -> None:
        """Set the gauges; advance the prefix-cache counters by the growth of their totals.

        A total lower than the last one seen (an engine restart) is taken as a fresh start.
        `num_preemptions_total` is not used here: preemptions come from the steps.
        """
        self._child(self._running).set(snap.num_running)
        self._child(self._waiting).set(snap.num_waiting)
        self._child(self._kv_usage).set(snap.kv_usage)
        self._child(self._kv_pool, pool="target").set(snap.kv_pool_tokens_target)
        self._child(self._kv_pool, pool="drafter").set(snap.kv_pool_tokens_drafter)
        for kind in ("modelled", "observed"):
            value = getattr(snap, f"{kind}_goodput")
            if value is not None:
                self._child(self._goodput, kind=kind).set(value)
        if snap.k_policy is not None:
            self._child(self._policy, policy=snap.k_policy).set(1)
            self._child(self._reprobes).set(snap.k_policy_reprobes)
        last_q, last_h = self._last_prefix or (0, 0)
        q, h = snap.prefix_cache_queries, snap.prefix_cache_hits
        self._child(self._pc_queries).inc(q - last_q if q >= last_q else q)
        self._child(self._pc_hits).inc(h - last_h if h >= last_h else h)
        self._last_prefix = (q, h)

    def observe_finished(self, times: FinishedRequestTimes) -> None:
        """Add one finished request's latencies and sizes to the histograms."""
        if times.ttft_s is not None:
            self._child(self._hist["time_to_first_token_seconds"]).observe(times.ttft_s)
        itl = self._child(self._hist["inter_token_latency_seconds"])
        for dt in times.inter_token_s:
            itl.observe(dt)
        self._child(self._hist["e2e_request_latency_seconds"]).observe(times.e2e_s)
        self._child(self._hist["request_prompt_tokens"]).observe(times.num_prompt_tokens)
        self._child(self._hist["request_generation_tokens"]).observe(times.num_generation_tokens)

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4), served with `CONTENT_TYPE`."""
        return generate_latest(self.registry)


def render_merged(instances: list[PrometheusMetrics]) -> bytes:
    """One exposition of several instances' series (data parallelism: one per rank and the sum),
    each metric family once, its samples from every instance (their constant labels differ)."""
    families: dict[str, Metric] = {}
    for m in instances:
        for fam in m.registry.collect():
            merged = families.get(fam.name)
            if merged is None:
                families[fam.name] = fam
            else:
                merged.samples.extend(fam.samples)

    class _Fixed:
        def collect(self) -> Iterator[Metric]:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed())
    return generate_latest(registry)


class RosterMetrics:
    """`/metrics`' data-parallel loss series (dp/metrics.py's module docstring names them), on a
    registry of their own, so only this module imports prometheus_client."""

    def __init__(self, prefix: str, labels: dict[str, str], roster) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RosterCollector(prefix, labels, roster))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RosterCollector:
    """The data-parallel roster's loss counts as families, read at render time (dp/metrics.py)."""

    def __init__(self, prefix: str, labels: dict[str, str], roster) -> None:
        self.prefix, self.labels, self.roster = prefix, labels, roster

    def collect(self) -> Iterator[Metric]:
        c, names, values = self.roster.counts, list(self.labels), list(self.labels.values())
        for name, doc, value in (
            ("dp_rank_losses", "data-parallel ranks lost (died, failed or stuck)", c.rank_losses),
            ("dp_rank_replacements", "replacement ranks that joined", c.replacements),
            ("dp_requests_requeued", "a lost rank's requests sent to another rank", c.requeued),
            ("dp_requests_failed", "a lost rank's requests ended with an error", c.failed),
            ("dp_rank_start_given_up", "rank slots given up after failed starts", c.given_up),
        ):
            fam = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=names)
            fam.add_metric(values, value)
            yield fam
        for name, doc, value in (
            ("dp_ranks_serving", "data-parallel ranks serving now", len(self.roster.serving)),
            ("dp_ranks", "data-parallel ranks asked for", self.roster.world_size),
        ):
            gauge = GaugeMetricFamily(f"{self.prefix}:{name}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge


def render_counter(name: str, doc: str, labels: dict[str, str], label: str,
                   counts: dict[str, int]) -> bytes:
    """One counter family's exposition text (format 0.0.4), a sample per `counts` key under
    `label`, beside `labels`: for counts kept outside the engine's registry (the server's
    request outcomes), so prometheus_client stays imported here only."""

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            fam = CounterMetricFamily(name, doc, labels=[*labels, label])
            for value, n in counts.items():
                fam.add_metric([*labels.values(), value], n)
            yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)
