"""Per-step sampling settings, one entry per request, as tensors the samplers can index."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingMetadata:
    """Sampling settings of the requests in one step, in step order.

    `generators[i]` is the only source of randomness for request i's rows, so a seeded request
    samples the same tokens whatever else shares its batch. `None` entries fall back to torch's
    global RNG (only sensible for unseeded requests).
    """

    temperature: torch.Tensor  # [num_reqs] float32, 0 = greedy
    top_k: torch.Tensor  # [num_reqs] int64, 0 = off
    top_p: torch.Tensor  # [num_reqs] float32, 1 = off
    min_p: torch.Tensor  # [num_reqs] float32, 0 = off
    generators: list[torch.Generator]
    all_greedy: bool
    num_logprobs: list[int | None]

    @property
    def num_reqs(self) -> int:
        return len(self.generators)

    def subset(self, idx: list[int]) -> SamplingMetadata:
        """The settings of the requests at `idx` (in that order)."""
        t = torch.tensor(idx, dtype=torch.long)
        temps = self.temperature[t.to(self.temperature.device)]
        return SamplingMetadata(temps, self.top_k[t.to(self.top_k.device)],
                                self.top_p[t.to(self.top_p.device)],
                                self.min_p[t.to(self.min_p.device)],
                                [self.generators[i] for i in idx], bool((temps == 0).all()),
                                [self.num_logprobs[i] for i in idx])

    @staticmethod
    def from_params(
        params: list[SamplingParams],
        generators: list[torch.Generator],
        device: torch.device | str,
    ) -> SamplingMetadata:
        if len(params) != len(generators):
            raise ValueError(
                f"need one generator per request: {len(params)} params, "
                f"{len(generators)} generators"
            )
        # SamplingParams uses -1 and 0 for "top-k off"; the samplers only test k > 0.
        top_k = [max(p.top_k, 0) for p in params]
        return SamplingMetadata(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=list(generators),
            all_greedy=all(p.temperature == 0.0 for p in params),
            num_logprobs=[p.logprobs for p in params],
        )
