"""`--speculative-algorithm auto`: whether requests are decoded speculatively, and why.

Speculation is on by default only where `rsgl bench speculative --parts workloads` measured
it paying with the adaptive policy (`rsgl.speculative.policy`) on every workload: n-gram
drafts (NGRAM) on a CPU whose bfloat16 projections run on AMX tiles, one replica of one
rank. There, copying served 1.5-3.6x plain's tokens per second at concurrency 1-4 and free
writing stayed within 3% of plain at every concurrency, in two runs (README, issue 24's tables).
Elsewhere it is off: on AVX512-BF16 without AMX (a Zen 4) three whole runs of the same
bench each missed a bar (at worst free writing at temperature 0.7: 0.913x at concurrency 1,
then 0.969x at 64, then 0.946x at 1), and free writing at 0.7 and concurrency 1 measured
0.985x over four runs, so it waits for a whole run and a repeat that hold; a float32 step
costs a verify's extra rows differently and was not measured, a CUDA verify step gives up
the overlap of steps (speculation has no spec-v2 overlap yet), and tensor- or data-parallel
ranks split the cores the policy's measurements assume. A draft model (STANDALONE) is never
chosen: it needs a model to be named.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rsgl.args import EngineArgs

if TYPE_CHECKING:
    from rsgl.models.dtype_choice import DtypeChoice

logger = logging.getLogger(__name__)

# What auto turns on where it pays.
AUTO_ALGORITHM = "NGRAM"


@dataclass(frozen=True, slots=True)
class SpeculationChoice:
    """The speculative algorithm requests run with (None: off) and why
    (`get_server_info()["speculation_choice"]`)."""

    chosen: str | None
    reason: str
    requested: str | None = "auto"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choose_speculation(args: EngineArgs, device_type: str, dtype: DtypeChoice) -> SpeculationChoice:
    """Resolves `args.speculative_algorithm` for a model running on `device_type` in
    `dtype` (its choice names the CPU's bfloat16 units) and logs the choice."""
    choice = _choose(args, device_type, dtype)
    logger.info("speculative decoding: %s (%s)", choice.chosen or "off", choice.reason)
    return choice


def resolved(args: EngineArgs, choice: SpeculationChoice) -> EngineArgs:
    """`args` with the chosen algorithm in place of auto (None: off)."""
    return dataclasses.replace(args, speculative_algorithm=choice.chosen)


def _choose(args: EngineArgs, device_type: str, dtype: DtypeChoice) -> SpeculationChoice:
    requested = args.speculative_algorithm
    if requested != "auto":
        algorithm = None if requested in (None, "none") else requested
        return SpeculationChoice(algorithm, "forced by --speculative-algorithm", requested)
    if args.load_format == "null":
        return SpeculationChoice(None, "no model to verify drafts (load format null)")
    if device_type != "cpu":
        return SpeculationChoice(None, f"{device_type}: not measured to pay without overlap")
    if dtype.chosen != "bfloat16" or "amx_bf16" not in dtype.cpu_bf16_features:
        return SpeculationChoice(None, "measured to pay only with bfloat16 on AMX tiles")
    if args.tp_size > 1 or args.dp_size > 1:
        return SpeculationChoice(None, "measured to pay only with one rank of one replica")
    return SpeculationChoice(AUTO_ALGORITHM, "bfloat16 on AMX tiles: measured to pay")
