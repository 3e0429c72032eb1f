"""FutureMap: hands a step's sampled tokens to the next step without a host round trip."""

from __future__ import annotations

import torch


class FutureMap:
    """A buffer of the last sampled token per request slot.

    In overlap mode the scheduler launches step N+1 before step N's tokens reach the host, so
    a decode token of N+1 is a placeholder (-1). Step N's sampler writes its tokens here by
    request slot and step N+1 resolves its placeholders from here before the embedding. Both
    happen in execution order on the forward stream/worker, so no extra synchronisation is
    needed.
    """

    PLACEHOLDER = -1

    def __init__(self, max_running_requests: int, device: torch.device | str) -> None:
        # One extra entry for the padding row CUDA graphs pad decode batches with.
        self.tokens = torch.zeros(max_running_requests + 1, dtype=torch.int64, device=device)

    def store(self, req_slots: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        """Record each request slot's newest sampled token."""
        self.tokens[req_slots] = next_token_ids

    def resolve(self, input_ids: torch.Tensor, token_req_slots: torch.Tensor) -> torch.Tensor:
        """Replace placeholders in `input_ids` with the stored token of the token's request."""
        placeholder = input_ids == self.PLACEHOLDER
        return torch.where(placeholder, self.tokens[token_req_slots], input_ids)
