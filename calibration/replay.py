"""An oracle cost model: a real run's own measured step times.

``rose-sim`` priced by :class:`ReplayCostModel` replays a real run with its
true step durations: the k-th simulated step costs what the real run's k-th
step took, as long as the two schedules agree (the same step shape), and the
``fallback`` cost model's price where they do not. Both backends run the same
scheduler, so with exact step times the simulated run should equal the real
one; what remains (the *replay error*, ``roseinfer.calibration.report``)
names a divergence of the schedules: arrivals seen at other step boundaries,
warm-up, or time between steps that nothing prices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from roseinfer.calibration.cost_model import BatchShape, CostModel
from roseinfer.calibration.steplog import StepRecord


def shape_key(shape: BatchShape) -> tuple[tuple[int, int, bool], ...]:
    """A step shape as the sorted (new, context, is_decode) tuple :meth:`StepRecord.key` gives."""
    prefills = zip(shape.prefill_new_tokens.tolist(), shape.prefill_context_tokens.tolist())
    items = [(n, c, False) for n, c in prefills]
    items += [(1, c, True) for c in shape.decode_context_tokens.tolist()]
    return tuple(sorted(items))


class ReplayCostModel:
    """Prices step k by the measured duration of ``steps[k]`` while the shapes agree.

    Stateful (it counts the steps it priced): make one per simulated run, and
    simulate with ``jump=False`` so every step is priced on its own.

    Args:
        steps: the real run's step log, in step order.
        fallback: prices the steps whose shape differs from the real run's.

    Attributes:
        num_agreed: steps priced by the real run's time.
        num_priced: steps priced so far.
        first_divergence: index of the first step that differed, or None.
    """

    name = "replay"

    def __init__(self, steps: Sequence[StepRecord], fallback: CostModel) -> None:
        self.steps = list(steps)
        self.fallback = fallback
        self._keys = [s.key() for s in self.steps]
        self.num_agreed = 0
        self.num_priced = 0
        self.first_divergence: int | None = None

    def step_time_s(self, shape: BatchShape) -> float:
        """The real duration of the next step if its shape matches, else the fallback's."""
        if shape.is_empty:
            return 0.0
        k = self.num_priced
        self.num_priced += 1
        if k < len(self.steps) and shape_key(shape) == self._keys[k]:
            self.num_agreed += 1
            return self.steps[k].duration_s
        if self.first_divergence is None:
            self.first_divergence = k
        return self.fallback.step_time_s(shape)

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        """Each step of a decode run priced in turn (the run advances the step count)."""
        context = np.asarray(context_tokens, dtype=np.int64)
        return np.array(
            [self.step_time_s(BatchShape.decode(context + j)) for j in range(num_steps)],
            dtype=np.float64,
        )

    @property
    def source(self) -> str:
        """``replay of N measured steps, else SOURCE`` (the fallback's source)."""
        fallback = getattr(self.fallback, "source", None) or self.fallback.name
        return f"replay of {len(self.steps)} measured steps, else {fallback}"

    def describe(self) -> str:
        """One line: how many steps agreed with the real run."""
        where = (
            ""
            if self.first_divergence is None
            else f"; first divergence at step {self.first_divergence}"
        )
        return (
            f"replay of {len(self.steps)} measured steps: {self.num_agreed} of "
            f"{self.num_priced} priced agreed{where}; else {self.fallback.describe()}"
        )
