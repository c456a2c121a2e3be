"""roseinfer.simulator: the discrete-event backend (``rose-sim``).

The shared scheduler with a cost-model clock: ``simulate(requests, config,
cost_model)`` returns per-request records in the same schema the executor
produces. Cost models: the analytical roofline (``make_cost_model``) with
built-in model and device specs, and the profiled ones fitted from ``rose-run
profile`` (``load_profile(path).cost_model()``). No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roseinfer.metrics.lazy import lazy_exports
from roseinfer.simulator.engine import SimResult, Simulator, simulate

if TYPE_CHECKING:
    from roseinfer.calibration import (
        CalibratedRooflineCostModel,
        Profile,
        ProfiledCostModel,
        load_profile,
    )
    from roseinfer.calibration.cost_model import (
        BatchShape,
        CostModel,
        RooflineCostModel,
        make_cost_model,
    )

__all__ = [
    "BatchShape",
    "CalibratedRooflineCostModel",
    "CostModel",
    "RooflineCostModel",
    "Profile",
    "ProfiledCostModel",
    "SimResult",
    "Simulator",
    "load_profile",
    "make_cost_model",
    "simulate",
]


__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("CalibratedRooflineCostModel", "Profile", "ProfiledCostModel", "load_profile"),
            "roseinfer.calibration",
        ),
        **dict.fromkeys(
            ("BatchShape", "CostModel", "RooflineCostModel", "make_cost_model"),
            "roseinfer.calibration.cost_model",
        ),
    },
)
