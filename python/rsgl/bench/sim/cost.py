"""Step cost models: how long one step of a given shape takes on the simulated device.

A step is described by its `StepShape` (what the scheduling core planned: rows, tokens
computed, KV read, prefix hits), never by its token ids, so the simulator runs no model
math. Three models price a shape:

- `TableCost`: what `rsgl bench simulate --calibrate` (`calibrate.py`) fits to steps of the
  real model timed on this machine, saved as JSON (`--cost-model file.json`). Decode steps
  are read off the grid of timed (batch, context) points, interpolated between them: on a
  CPU their cost is not linear in the batch (a batch-1 step reads low-bit weights, a batch
  of 8 a dense copy through another GEMM; SmolLM2 on 2 Sapphire Rapids cores: 9, 10, 15, 33,
  36, 45 and 56 ms at batches 1 to 64), so no one line fits them. Prefill and extend steps
  are priced by a `LinearCost` fitted to those steps alone, corrected by the median error
  of the fit's steps of about the same tokens. A step after idle costs `AfterIdle`'s
  seconds on top (fitted to requests timed alone after set idle gaps), and the first decode
  steps after an extend `AfterExtend`'s (the grid holds the steady steps that follow).
- `LinearCost`: seconds = c · features(shape), fitted for the least mean relative error
  (earlier calibrations fitted every step with it; their files still load).
- `RooflineCost`: a device's published memory bandwidth, peak FLOP/s for the dtype and
  interconnect bandwidth (`HardwareSpec`, shipped for H100 and H200 in `specs/`) applied to a
  model config: a step takes the longer of reading its bytes (weights once, the KV it
  attends to) and computing its FLOPs, plus the tensor-parallel all-reduces and a fixed
  per-step overhead. Efficiency factors derate the peaks (they are assumptions, stated in the
  spec files, not published figures).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rsgl.scheduler.step_shape import StepShape

if TYPE_CHECKING:
    from rsgl.models.config import ModelConfig

# LinearCost's features, in coefficient order. Files fitted before "context_tokens" (the KV
# a step reads: a CPU extend gathers its whole sequence's K and V, a pass over the prefix
# that its query-key pairs do not count) still load, with that coefficient 0.
FEATURES = (
    "step",
    "batch_size",
    "new_tokens",
    "attention_pairs",
    "num_extends",
    "context_tokens",
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


class CostModel(Protocol):
    """Seconds one step of `shape` takes; `decode_seconds` prices many decode steps at once
    (`batch[i]` rows reading `context[i]` tokens of KV: `StepShape.of` a decode plan), as
    `step_seconds` would one by one."""

    def step_seconds(self, shape: StepShape) -> float: ...

    def decode_seconds(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray: ...

    def after_idle_seconds(self, idle_s: float, seconds: float) -> float:
        """What a step priced `seconds` costs on top when the device sat idle `idle_s`
        before it (0 for a step planned while another ran)."""
        ...

    def after_extend_seconds(self, decodes: np.ndarray) -> np.ndarray:
        """What decode steps cost on top for following an extend step: `decodes[i]` is the
        step's number among the decode steps since the device's last extend (1: right
        after it)."""
        ...


# The cheapest steps there are: one row, one new token, no context and no attention pairs
# (a decode step), and a prefill of one token (a calibration prices prefills apart).
SMALLEST_STEP = StepShape(1, 1, 0, 0, 0, 0.0)
SMALLEST_PREFILL = StepShape(1, 1, 1, 1, 0, 1.0)


def min_step_seconds(cost: CostModel) -> float:
    """What every step costs at least: the smallest step's price, shaved by a millionth so
    that sums of real step costs never round below a multiple of it. The cost models here
    never price a larger shape lower (a roofline's bytes and FLOPs grow with every field, a
    calibration's table is non-decreasing and its coefficients are non-negative)."""
    smallest = min(
        cost.step_seconds(SMALLEST_STEP),
        cost.step_seconds(SMALLEST_PREFILL),
        float(cost.decode_seconds(np.array([1]), np.array([0]))[0]),
    )
    return smallest * (1 - 1e-6)


@dataclass(frozen=True, slots=True)
class FixedCost:
    """Every step takes `seconds` (tests: a deterministic clock)."""

    seconds: float

    def step_seconds(self, shape: StepShape) -> float:
        return self.seconds

    def decode_seconds(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        return np.full(len(batch), self.seconds)

    def after_idle_seconds(self, idle_s: float, seconds: float) -> float:
        return 0.0

    def after_extend_seconds(self, decodes: np.ndarray) -> np.ndarray:
        return np.zeros(len(decodes))


@dataclass(frozen=True, slots=True)
class LinearCost:
    """seconds = Σ coefficients[i] · features[i] (FEATURES), at least `floor_s`."""

    coefficients: tuple[float, ...]
    floor_s: float = 1e-5
    # Where the fit came from (machine, model, dtype, grid), and how well it fits.
    meta: dict[str, Any] | None = None

    def step_seconds(self, shape: StepShape) -> float:
        c = self.coefficients
        t = (
            c[0]
            + c[1] * shape.batch_size
            + c[2] * shape.new_tokens
            + c[3] * shape.attention_pairs
            + c[4] * shape.num_extends
            + c[5] * shape.context_tokens
        )
        return t if t > self.floor_s else self.floor_s

    def decode_seconds(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        c = self.coefficients
        t = c[0] + (c[1] + c[2]) * batch + (c[3] + c[5]) * context
        out: np.ndarray = np.maximum(t, self.floor_s)
        return out

    def after_idle_seconds(self, idle_s: float, seconds: float) -> float:
        return 0.0

    def after_extend_seconds(self, decodes: np.ndarray) -> np.ndarray:
        return np.zeros(len(decodes))

    def scaled(self, factor: float) -> LinearCost:
        """Every step `factor` times as long (a machine running at another speed)."""
        return replace(self, coefficients=tuple(c * factor for c in self.coefficients))

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a LinearCost has {len(FEATURES)} coefficients {FEATURES}")

    @classmethod
    def fit(
        cls, shapes: list[StepShape], seconds: list[float], meta: dict[str, Any] | None = None
    ) -> LinearCost:
        """The fit of `seconds` over the shapes' features that minimizes the mean relative
        error, with no negative coefficient.

        Relative, so that short steps are fitted as closely as long prefills; absolute
        rather than squared (iteratively reweighted least squares), because a VM's timings
        have outliers (a step taking twice its peers' time while another process had the
        cores) and a squared fit follows them. Non-negative, because more of anything never
        makes a step shorter (a noisy or too small grid otherwise fits a negative cost that
        extrapolates to negative times): features whose coefficient comes out negative are
        dropped and the rest refitted, until none is. Records the fit's mean and worst
        relative error."""
        x = np.asarray([s.features() for s in shapes], dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        coef = _nonnegative_lstsq(x, y, 1.0 / y)
        for _ in range(IRLS_ROUNDS):
            # Weight each step by 1 / sqrt(its relative error): least squares then
            # minimizes the sum of relative errors (their floor keeps exact fits finite).
            rel = np.abs(x @ coef - y) / y
            coef = _nonnegative_lstsq(x, y, 1.0 / (y * np.sqrt(np.maximum(rel, IRLS_FLOOR))))
        model = cls(tuple(float(c) for c in coef), meta=dict(meta or {}))
        predicted = np.asarray([model.step_seconds(s) for s in shapes])
        rel = np.abs(predicted - y) / y
        assert model.meta is not None
        model.meta["fit_mean_rel_error"] = round(float(rel.mean()), 4)
        model.meta["fit_max_rel_error"] = round(float(rel.max()), 4)
        model.meta["samples"] = len(shapes)
        return model

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "linear",
            "features": list(FEATURES),
            "coefficients": list(self.coefficients),
            "floor_s": self.floor_s,
            "meta": self.meta or {},
        }


# LinearCost.fit's reweighting rounds, and the relative error below which a step's weight
# stops growing.
IRLS_ROUNDS = 30
IRLS_FLOOR = 1e-4


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin ||w · (x c − y)|| over c ≥ 0, by dropping the features whose coefficient
    comes out negative and refitting the rest until none is."""
    coef = np.zeros(x.shape[1])
    active = np.ones(x.shape[1], dtype=bool)
    while active.any():
        sub, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        coef[:] = 0.0
        coef[active] = sub
        if (sub >= 0).all():
            break
        active[np.flatnonzero(active)[sub < 0]] = False
    return coef


def _interpolate(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear `ys` (its last axis over the increasing points `xs`) at each `x`:
    flat below the first point, extended along the last segment above the last one."""
    if len(xs) == 1:
        return np.broadcast_to(ys[..., :1], (*ys.shape[:-1], len(x))).copy()
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    t = np.maximum((x - xs[i]) / (xs[i + 1] - xs[i]), 0.0)
    out: np.ndarray = ys[..., i] + t * (ys[..., i + 1] - ys[..., i])
    return out


@dataclass(frozen=True, slots=True)
class AfterIdle:
    """What a step costs on top after the device sat idle: `extra_s[i]` seconds after
    `gaps_s[i]` seconds of idle, piecewise-linear between the points (from 0 at no idle),
    flat past the last.

    On a CPU the first step after idle runs slower, by about the same seconds whatever its
    size, and by more the longer the idle (cold caches or clocks, perhaps: not measured
    apart). SmolLM2 in bfloat16 on a 2-core AMX Xeon took 9, 6 and 19 ms longer to prefill
    32, 256 and 1,024 tokens after 1 s of idle than right after a request, 15, 27 and 23 ms
    after 3 s. Servers at a fraction of their capacity run most prefills after idle."""

    gaps_s: tuple[float, ...]
    extra_s: tuple[float, ...]

    def seconds(self, idle_s: float) -> float:
        xs = np.asarray((0.0, *self.gaps_s))
        ys = np.asarray((0.0, *self.extra_s))
        return float(np.interp(idle_s, xs, ys))

    @classmethod
    def fit(
        cls, idles: Sequence[float], sizes: Sequence[int], seconds: Sequence[float]
    ) -> AfterIdle | None:
        """The points of steps timed alone (`calibrate.idle_sweep`): `seconds[i]` a step
        of `sizes[i]` tokens took after `idles[i]` seconds of idle. A step's extra is its
        seconds less the median of its size's steps sent right after another request
        (idle under AFTER_IDLE_MIN_S). Steps are grouped by their idle to the nearest power
        of √10 (30 ms, 100 ms, 300 ms, 1 s, ...); each group with at least
        `AFTER_IDLE_MIN_STEPS` steps gives a point: its median idle and median extra
        (medians: a VM's odd slow step must not move a point), made non-negative and
        non-decreasing (a longer idle never costs less). None when no group has enough."""
        idle = np.asarray(idles, dtype=np.float64)
        size = np.asarray(sizes, dtype=np.int64)
        took = np.asarray(seconds, dtype=np.float64)
        busy = idle < AFTER_IDLE_MIN_S
        baseline = {int(n): float(np.median(took[busy & (size == n)])) for n in set(size[busy])}
        keep = ~busy & np.isin(size, list(baseline))
        idle = idle[keep]
        extra = took[keep] - np.array([baseline[int(n)] for n in size[keep]])
        group = np.round(2 * np.log10(idle))
        points = sorted(
            (float(np.median(idle[group == g])), float(np.median(extra[group == g])))
            for g in np.unique(group)
            if (group == g).sum() >= AFTER_IDLE_MIN_STEPS
        )
        if not points:
            return None
        gaps, extras = zip(*points, strict=True)
        rising = np.maximum.accumulate(np.maximum(np.asarray(extras), 0.0))
        return cls(tuple(gaps), tuple(float(x) for x in rising))

    def to_json(self) -> dict[str, Any]:
        return {"gaps_s": list(self.gaps_s), "extra_s": list(self.extra_s)}

    def scaled(self, factor: float) -> AfterIdle:
        return AfterIdle(self.gaps_s, tuple(x * factor for x in self.extra_s))


# A step after less idle than this is priced busy (a server's steps follow one another
# within a millisecond or two; a request sent right after another finished arrives a few ms
# after it).
AFTER_IDLE_MIN_S = 0.02
# The fewest steps after about the same idle that make a point of an AfterIdle fit.
AFTER_IDLE_MIN_STEPS = 3


@dataclass(frozen=True, slots=True)
class AfterExtend:
    """What the first decode steps after an extend step cost on top: `extra_s[n - 1]` seconds
    for the n-th decode step since the device's last extend, nothing from the
    `len(extra_s) + 1`-th on.

    Measured, not explained: in a calibration of SmolLM2 in bfloat16 on a 2-core AMX Xeon,
    the first decode step after a prefill took 32% more than the table's steady steps at
    batch 1 (about 3 ms), 20% at batches 2-4 and 8% at 32-64, the second 0-8% more, the
    third 0-5%. A workload of long prompts and short outputs spends a quarter of its decode
    steps there."""

    extra_s: tuple[float, ...]

    def seconds(self, decodes: np.ndarray) -> np.ndarray:
        n = np.asarray(decodes, dtype=np.int64)
        k = len(self.extra_s)
        if k == 0:
            return np.zeros(len(n))
        extra = np.asarray(self.extra_s)[np.clip(n - 1, 0, k - 1)]
        out: np.ndarray = np.where((n >= 1) & (n <= k), extra, 0.0)
        return out

    @classmethod
    def fit(
        cls, decodes: Sequence[int] | np.ndarray, excess: Sequence[float] | np.ndarray
    ) -> AfterExtend | None:
        """From decode steps' numbers since their last extend (`decodes`, from 1) and the
        seconds each took over the steady steps' price (`excess`): the median excess of
        each number up to AFTER_EXTEND_STEPS, while each has at least
        AFTER_EXTEND_MIN_STEPS steps, made non-negative and non-increasing (a later step
        never pays more for the extend than an earlier one). None when the first has too
        few."""
        n = np.asarray(decodes, dtype=np.int64)
        over = np.asarray(excess, dtype=np.float64)
        extras: list[float] = []
        for k in range(1, AFTER_EXTEND_STEPS + 1):
            mine = over[n == k]
            if len(mine) < AFTER_EXTEND_MIN_STEPS:
                break
            extras.append(float(np.median(mine)))
        if not extras:
            return None
        falling = np.minimum.accumulate(np.maximum(np.asarray(extras), 0.0))
        return cls(tuple(float(x) for x in falling))

    def to_json(self) -> dict[str, Any]:
        return {"extra_s": list(self.extra_s)}

    def scaled(self, factor: float) -> AfterExtend:
        return AfterExtend(tuple(x * factor for x in self.extra_s))


# How many decode steps after an extend an AfterExtend prices (the steps after them are the
# steady ones a table's grid points take their medians of), and the fewest steps of one
# number that give it a price.
AFTER_EXTEND_STEPS = 5
AFTER_EXTEND_MIN_STEPS = 5


def decodes_since_extend(shapes: Sequence[StepShape]) -> np.ndarray:
    """For steps in the order one device ran them: each decode step's number since the last
    extend step before it (1: right after it), 0 for extend steps, and NO_EXTEND_YET for
    decode steps before any extend."""
    out = np.zeros(len(shapes), dtype=np.int64)
    since = NO_EXTEND_YET
    for i, s in enumerate(shapes):
        since = 0 if s.num_extends else min(since + 1, NO_EXTEND_YET)
        out[i] = since
    return out


# A decode step's number since an extend when no extend came before it (priced steady).
NO_EXTEND_YET = 1 << 30


@dataclass(frozen=True, slots=True)
class TableCost:
    """Decode steps from a grid of timed points, everything else from `extend` (see the
    module doc).

    `decode_s[i][j]` is the median seconds of the decode steps timed at `batches[i]` rows of
    `contexts[j]` tokens of KV each (the mean over the step's rows), made non-decreasing
    along both axes when the table is built (a noisy grid must not price more work lower).
    A decode step of B rows reading C tokens in all is interpolated at (B, C / B):
    piecewise-linearly in the context per row, then in the batch."""

    batches: tuple[int, ...]
    contexts: tuple[float, ...]
    decode_s: tuple[tuple[float, ...], ...]
    extend: LinearCost
    floor_s: float = 1e-5
    meta: dict[str, Any] | None = None
    # What a step costs on top after idle (None: calibrated without idle gaps).
    after_idle: AfterIdle | None = None
    # How far `extend` is off by an extend step's new tokens: the median of seconds over
    # its price among the calibration's extends of about `extend_tokens[i]` tokens is
    # `extend_factors[i]`, interpolated in log2 of the tokens, flat past the ends (empty:
    # none). No line over the step's features fits a CPU's prefills at every size (SmolLM2
    # on a 2-core AMX Xeon, bfloat16: 41.5, 101, 183, 312 and 708 ms for 64, 256, 512,
    # 1,024 and 2,048 tokens; the line fitted 256 and 512 15-17% low).
    extend_tokens: tuple[float, ...] = ()
    extend_factors: tuple[float, ...] = ()
    # What the first decode steps after an extend cost on top of the table's steady steps
    # (None: not fitted, as in files calibrated before it).
    after_extend: AfterExtend | None = None

    def step_seconds(self, shape: StepShape) -> float:
        if shape.num_extends:
            t = self.extend.step_seconds(shape)
            if self.extend_tokens:
                at = np.log2(max(shape.new_tokens, 1))
                t *= float(np.interp(at, np.log2(self.extend_tokens), self.extend_factors))
            return t
        one = self.decode_seconds(np.array([shape.batch_size]), np.array([shape.context_tokens]))
        return float(one[0])

    def decode_seconds(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        b = np.asarray(batch, dtype=np.float64)
        per_row = np.asarray(context, dtype=np.float64) / np.maximum(b, 1.0)
        grid = np.asarray(self.decode_s, dtype=np.float64)
        # [len(batches), n]: each grid batch's cost at every step's context per row.
        by_context = _interpolate(per_row, np.asarray(self.contexts, dtype=np.float64), grid)
        xs = np.asarray(self.batches, dtype=np.float64)
        if len(xs) == 1:
            t = by_context[0]
        else:
            i = np.clip(np.searchsorted(xs, b, side="right") - 1, 0, len(xs) - 2)
            cols = np.arange(len(b))
            lo, hi = by_context[i, cols], by_context[i + 1, cols]
            t = lo + np.maximum((b - xs[i]) / (xs[i + 1] - xs[i]), 0.0) * (hi - lo)
        out: np.ndarray = np.maximum(t, self.floor_s)
        return out

    def after_idle_seconds(self, idle_s: float, seconds: float) -> float:
        return 0.0 if self.after_idle is None else self.after_idle.seconds(idle_s)

    def after_extend_seconds(self, decodes: np.ndarray) -> np.ndarray:
        if self.after_extend is None:
            return np.zeros(len(decodes))
        return self.after_extend.seconds(decodes)

    def scaled(self, factor: float, extend_factor: float | None = None) -> TableCost:
        """Every decode step `factor` times as long (and what it pays after an extend) and
        every extend `extend_factor` times (default: `factor`), with what a step pays after
        idle (fitted to prefills): a machine running at another speed, which a VM's
        neighbours can move apart for the two kinds of step."""
        e = factor if extend_factor is None else extend_factor
        return replace(
            self,
            decode_s=tuple(tuple(x * factor for x in row) for row in self.decode_s),
            extend=self.extend.scaled(e),
            after_idle=None if self.after_idle is None else self.after_idle.scaled(e),
            after_extend=None if self.after_extend is None else self.after_extend.scaled(factor),
        )

    @classmethod
    def fit(
        cls,
        shapes: list[StepShape],
        seconds: list[float],
        batches: Sequence[int],
        contexts: Sequence[int],
        meta: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> TableCost:
        """The table of the decode steps' medians per (grid batch, grid context: the one of
        `contexts` nearest the step's context per row, which grows by a token a step) and
        the linear fit of the other steps. Decode steps of other batch sizes (a server
        decodes the requests that finished prefilling while the rest still prefill) are
        left out. Every grid point needs a step (ValueError naming the holes) but those of
        more than `max_tokens` (batch x context) past a batch's second context, which the
        calibration skips (`grid_points`): they are extended from the batch's two longest
        contexts timed, as `decode_seconds` extends the table. A grid point's median
        leaves out the first AFTER_EXTEND_STEPS decode steps after an extend where it has
        later ones (`shapes` are in the order one replica ran them), and `after_extend`
        prices what those steps take over the table, fitted at the points that had later
        ones (elsewhere the table's own median holds them). Records each part's mean and
        worst relative error over its own samples."""
        grid_batches = set(batches)
        since = decodes_since_extend(shapes)
        decode = [
            (s, t, int(n))
            for s, t, n in zip(shapes, seconds, since, strict=True)
            if not s.num_extends and s.batch_size in grid_batches
        ]
        others = [(s, t) for s, t in zip(shapes, seconds, strict=True) if s.num_extends]
        if not decode or not others:
            raise ValueError("a table cost model needs decode steps and prefill steps")
        grid_contexts = sorted(set(contexts))
        points: dict[tuple[int, int], list[tuple[float, float]]] = {}
        early: dict[tuple[int, int], list[tuple[float, float]]] = {}
        point_of = []
        for s, t, n in decode:
            per_row = s.context_tokens / s.batch_size
            nearest = min(grid_contexts, key=lambda c: abs(c - per_row))
            into = early if n <= AFTER_EXTEND_STEPS else points
            into.setdefault((s.batch_size, nearest), []).append((per_row, t))
            point_of.append((s.batch_size, nearest))
        steady_points = set(points)
        for point, steps in early.items():  # only early steps there: the point takes them
            points.setdefault(point, steps)
        batches = sorted(grid_batches)

        def skipped(b: int, c: int) -> bool:
            return max_tokens is not None and b * c > max_tokens and c in grid_contexts[2:]

        missing = [
            (b, c)
            for b in batches
            for c in grid_contexts
            if (b, c) not in points and not skipped(b, c)
        ]
        if missing:
            raise ValueError(f"the decode grid has no steps at (batch, context) {missing}")
        # Each column at the median context per row its steps read.
        table_contexts = np.array(
            [
                float(
                    np.median([pr for b in batches if (b, c) in points for pr, _ in points[(b, c)]])
                )
                for c in grid_contexts
            ]
        )
        grid = np.full((len(batches), len(grid_contexts)), np.nan)
        for i, b in enumerate(batches):
            timed = [j for j, c in enumerate(grid_contexts) if (b, c) in points]
            grid[i, timed] = [
                np.median([t for _, t in points[(b, grid_contexts[j])]]) for j in timed
            ]
            if len(timed) < len(grid_contexts):  # it has its two shortest contexts timed
                grid[i] = _interpolate(table_contexts, table_contexts[timed], grid[i, timed])
        grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=0), axis=1)
        extend = LinearCost.fit([s for s, _ in others], [t for _, t in others])
        tokens, factors = _extend_factors(extend, others)
        model = cls(
            tuple(batches),
            tuple(float(c) for c in table_contexts),
            tuple(tuple(float(x) for x in row) for row in grid),
            extend,
            meta=dict(meta or {}),
            extend_tokens=tokens,
            extend_factors=factors,
        )
        assert model.meta is not None and extend.meta is not None
        steady = model.decode_seconds(
            np.array([s.batch_size for s, _, _ in decode]),
            np.array([s.context_tokens for s, _, _ in decode]),
        )
        measured = np.array([t for _, t, _ in decode])
        numbers = np.array([n for _, _, n in decode], dtype=np.int64)
        # Only where the table holds steady steps is an early step's excess over it what
        # the extend costs (elsewhere the early steps are in the median it is measured by).
        fitted = np.array([p in steady_points for p in point_of])
        after = AfterExtend.fit(numbers[fitted], (measured - steady)[fitted])
        model = replace(model, after_extend=after)
        assert model.meta is not None
        model.meta["grid_points_without_steady_decodes"] = len(set(points) - steady_points)
        predicted = steady + model.after_extend_seconds(numbers)
        rel = np.abs(predicted - measured) / measured
        model.meta["decode_fit_mean_rel_error"] = round(float(rel.mean()), 4)
        model.meta["decode_fit_max_rel_error"] = round(float(rel.max()), 4)
        took = np.array([t for _, t in others])
        rel = np.abs(np.array([model.step_seconds(s) for s, _ in others]) - took) / took
        model.meta["extend_fit_mean_rel_error"] = round(float(rel.mean()), 4)
        model.meta["extend_fit_max_rel_error"] = round(float(rel.max()), 4)
        model.meta["samples"] = len(shapes)
        return model

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "table",
            "batches": list(self.batches),
            "contexts": list(self.contexts),
            "decode_s": [list(row) for row in self.decode_s],
            "extend": self.extend.to_json(),
            "floor_s": self.floor_s,
            "meta": self.meta or {},
            "after_idle": None if self.after_idle is None else self.after_idle.to_json(),
            "extend_tokens": list(self.extend_tokens),
            "extend_factors": list(self.extend_factors),
            "after_extend": None if self.after_extend is None else self.after_extend.to_json(),
        }


def _extend_factors(
    extend: LinearCost, steps: list[tuple[StepShape, float]]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`TableCost.extend_tokens` and `extend_factors` of the extend steps `steps` (shape,
    seconds) against their fit: the steps grouped by their new tokens to the nearest power
    of two, and each group of at least EXTEND_GROUP_MIN_STEPS a point, its median tokens
    and its median of seconds over price (medians: a calibration's odd slow step, a burst's
    first prefill while the client still sends the rest, must not move a point), within
    EXTEND_FACTOR_RANGE."""
    tokens = np.array([s.new_tokens for s, _ in steps], dtype=np.float64)
    ratio = np.array([t / extend.step_seconds(s) for s, t in steps])
    group = np.round(np.log2(np.maximum(tokens, 1)))
    points = [
        (float(np.median(tokens[group == g])), float(np.median(ratio[group == g])))
        for g in np.unique(group)
        if (group == g).sum() >= EXTEND_GROUP_MIN_STEPS
    ]
    lo, hi = EXTEND_FACTOR_RANGE
    return tuple(t for t, _ in points), tuple(min(max(r, lo), hi) for _, r in points)


# The fewest extend steps of about the same tokens that make a point of a table's
# correction of its extend fit, and the range of its factors.
EXTEND_GROUP_MIN_STEPS = 5
EXTEND_FACTOR_RANGE = (0.5, 2.0)


# What `--calibrate` writes and `--cost-model` reads.
CalibratedCost = TableCost | LinearCost


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One device's figures: an accelerator's published ones (see `specs/*.json` for their
    sources), or a CPU's measured here (`cpu_spec`)."""

    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    peak_flops: dict[str, float]  # dtype -> FLOP/s (dense)
    interconnect_bandwidth: float  # bytes/s per direction per GPU
    efficiency: dict[str, float]  # memory, compute, interconnect: share of peak reached
    allreduce_latency_s: float
    step_overhead_s: float
    source: str = ""
    # "cuda" (an accelerator: the pool is what its memory holds beside the weights) or
    # "cpu" (the pool is a share of the machine's memory, as the server sizes it there).
    device: str = "cuda"

    @classmethod
    def load(cls, name_or_path: str) -> HardwareSpec:
        """A shipped spec by name (`h100`, `h200`, or a file stem in `specs/`), or a JSON
        file of the same fields."""
        path = Path(name_or_path)
        if path.suffix == ".json" and path.exists():
            return cls(**json.loads(path.read_text()))
        specs = resources.files("rsgl.bench.sim") / "specs"
        names = sorted(p.name.removesuffix(".json") for p in specs.iterdir())
        for stem in names:
            if stem == name_or_path or stem.split("-")[0] == name_or_path:
                return cls(**json.loads((specs / f"{stem}.json").read_text()))
        raise ValueError(f"unknown hardware spec {name_or_path!r}: one of {names} or a file")


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What a model costs per step on one tensor-parallel rank (bytes, FLOPs per token)."""

    weight_bytes: float  # read once per step (the rank's shard, LM head included)
    flops_per_token: float  # matmul FLOPs per computed token, LM head excluded
    lm_head_flops: float  # per sampled row
    kv_bytes_per_token: float  # this rank's K and V of one token, all layers
    attention_flops_per_pair: float  # QK^T and PV over this rank's heads, all layers
    allreduce_bytes_per_token: float  # one all-reduce's message per token (hidden x dtype)
    allreduces_per_step: int  # two per layer (attention out, MLP down)

    @classmethod
    def of(
        cls, config: ModelConfig, dtype: str, tp_size: int, kv_heads_per_rank: int
    ) -> ModelFootprint:
        b = DTYPE_BYTES[dtype]
        h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        per_layer = h * config.q_size + 2 * h * config.kv_size + config.q_size * h + 3 * h * inter
        lm_head = h * config.vocab_size
        q_heads = config.num_attention_heads / tp_size
        return cls(
            weight_bytes=(layers * per_layer + lm_head) * b / tp_size,
            flops_per_token=2.0 * layers * per_layer / tp_size,
            lm_head_flops=2.0 * lm_head / tp_size,
            kv_bytes_per_token=2.0 * layers * kv_heads_per_rank * config.head_dim * b,
            attention_flops_per_pair=4.0 * layers * q_heads * config.head_dim,
            allreduce_bytes_per_token=float(h * b),
            allreduces_per_step=2 * layers if tp_size > 1 else 0,
        )


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """A step on `spec` for a model whose per-rank costs are `model` (see the module doc)."""

    spec: HardwareSpec
    model: ModelFootprint
    dtype: str
    tp_size: int = 1

    def step_seconds(self, shape: StepShape) -> float:
        return float(
            self._seconds(
                shape.batch_size,
                shape.new_tokens,
                shape.context_tokens,
                shape.attention_pairs,
            )
        )

    def decode_seconds(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.asarray(self._seconds(batch, batch, context, context))
        return out

    def after_idle_seconds(self, idle_s: float, seconds: float) -> float:
        return 0.0  # a GPU's kernels run as fast after idle (no spec prices a wake-up)

    def after_extend_seconds(self, decodes: np.ndarray) -> np.ndarray:
        return np.zeros(len(decodes))  # nor does a spec price a decode after a prefill

    def _seconds(self, batch: Any, new_tokens: Any, context: Any, pairs: Any) -> Any:
        """Scalars or arrays alike (element-wise)."""
        spec, m = self.spec, self.model
        eff = spec.efficiency
        read = m.weight_bytes + m.kv_bytes_per_token * (context + new_tokens)
        flops = (
            m.flops_per_token * new_tokens
            + m.lm_head_flops * batch
            + m.attention_flops_per_pair * pairs
        )
        memory_s = read / (spec.memory_bandwidth * eff["memory"])
        compute_s = flops / (spec.peak_flops[self.dtype] * eff["compute"])
        comm_s: Any = 0.0
        if m.allreduces_per_step:
            # A ring all-reduce moves 2 (n - 1) / n of the message through each GPU's link.
            n = self.tp_size
            message = m.allreduce_bytes_per_token * new_tokens
            per_call = (
                2 * (n - 1) / n * message / (spec.interconnect_bandwidth * eff["interconnect"])
            )
            comm_s = m.allreduces_per_step * (spec.allreduce_latency_s + per_call)
        return np.maximum(memory_s, compute_s) + comm_s + spec.step_overhead_s


def load_cost_model(path: str | Path) -> CalibratedCost:
    """A cost model saved by `--calibrate` (`TableCost.to_json`, or an earlier
    `LinearCost.to_json`)."""
    data = json.loads(Path(path).read_text())
    if data.get("kind") == "table":
        return TableCost(
            tuple(int(b) for b in data["batches"]),
            tuple(float(c) for c in data["contexts"]),
            tuple(tuple(float(x) for x in row) for row in data["decode_s"]),
            _linear_of(path, data["extend"]),
            float(data["floor_s"]),
            data.get("meta"),
            _after_idle_of(data.get("after_idle")),
            tuple(float(t) for t in data.get("extend_tokens", ())),
            tuple(float(f) for f in data.get("extend_factors", ())),
            _after_extend_of(data.get("after_extend")),
        )
    return _linear_of(path, data)


def _after_idle_of(data: dict[str, Any] | None) -> AfterIdle | None:
    """A saved AfterIdle (None in files calibrated without idle gaps, or before them)."""
    if not data:
        return None
    return AfterIdle(
        tuple(float(g) for g in data["gaps_s"]), tuple(float(x) for x in data["extra_s"])
    )


def _after_extend_of(data: dict[str, Any] | None) -> AfterExtend | None:
    """A saved AfterExtend (None in files calibrated before it)."""
    return AfterExtend(tuple(float(x) for x in data["extra_s"])) if data else None


def _linear_of(path: str | Path, data: dict[str, Any]) -> LinearCost:
    features = list(data.get("features", []))
    # An earlier file's features are a prefix of today's (see FEATURES).
    if data.get("kind") != "linear" or not features or features != list(FEATURES[: len(features)]):
        raise ValueError(
            f"{path}: not a calibrated cost model (a table, or linear over {FEATURES})"
        )
    coefficients = [*data["coefficients"], *[0.0] * (len(FEATURES) - len(features))]
    return LinearCost(tuple(coefficients), float(data["floor_s"]), data.get("meta"))


def spec_as_dict(spec: HardwareSpec) -> dict[str, Any]:
    return asdict(spec)
