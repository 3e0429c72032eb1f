"""A test hook that makes steps fail on purpose, to exercise the loop's fault isolation.

Never active unless the environment variable RSGL_FAULT_INJECTION is set (it is read when a
scheduling loop is built, so it reaches the server's scheduler process too). Its value is a
comma-separated list of:

- `rid=<text>`: the first step that includes a request whose id contains `<text>` raises
  (once per such request, as a transient fault would);
- `probability=<p>`: any step raises with probability `p`;
- `seed=<n>`: the seed of those draws (default 0).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

ENV_VAR = "RSGL_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """The failure a FaultInjector plants in a step."""


@dataclass(slots=True)
class FaultInjector:
    """Decides, on the loop thread, which launched steps must fail."""

    rid_marker: str | None = None
    probability: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _hit: set[str] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector RSGL_FAULT_INJECTION describes, or None when it is unset."""
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        injector = cls()
        for item in spec.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key == "rid":
                injector.rid_marker = value
            elif key == "probability":
                injector.probability = float(value)
            elif key == "seed":
                injector.rng = random.Random(int(value))
            else:
                raise ValueError(f"{ENV_VAR}: unknown item {item!r}")
        return injector

    def fault_for(self, rids: Iterable[str]) -> str | None:
        """Why a step over requests `rids` must fail, or None to let it run."""
        if self.rid_marker is not None:
            for rid in rids:
                if self.rid_marker in rid and rid not in self._hit:
                    self._hit.add(rid)
                    return f"injected fault for request {rid}"
        if self.probability and self.rng.random() < self.probability:
            return "injected fault (random)"
        return None
