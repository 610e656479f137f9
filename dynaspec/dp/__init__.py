"""Data parallelism that keeps the speculation schedule (docs/design.md §7).

- ``front_end``: ``DPEngine``, the LLMEngine-shaped front end (routing, outputs, failure).
- ``failure``: naming a dead or stuck rank, reaping processes.
- ``rank``: one rank process (an LLMEngine) and its lockstep loop.
- ``agreement``: the per-step exchange and ``LockstepPolicy`` (one K on every rank).
- ``rendezvous``: addresses, ports, ranks, the shared secret, threads per rank.
- ``process``: starting and watching rank processes.
- ``metrics``: /metrics per rank and summed.
- ``messages``: the dataclasses on the control channel.
"""
