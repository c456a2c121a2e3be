"""roseinfer.simulator: the discrete-event backend (``rose-sim``).

The shared scheduler with a cost-model clock: ``simulate(requests, config,
cost_model)`` returns per-request records in the same schema the executor
produces. Cost models: the analytical roofline (``make_cost_model``) with
built-in model and device specs, and the profiled ones fitted from ``rose-run
profile`` (``load_profile(path).cost_model()``). No torch here.
"""

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
from roseinfer.simulator.engine import SimResult, Simulator, simulate

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
