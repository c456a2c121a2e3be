"""roseinfer.calibration: how long a step takes, measured, modelled and checked.

One component below both backends (the simulator prices steps with it, the
executor measures steps for it, and neither imports the other):

* cost models: a step's :class:`BatchShape` -> seconds (the analytical roofline
  over built-in model and device specs, and the fitted ones);
* the fitters: step models (:func:`fit_step_model`) and the calibrated roofline
  (:func:`calibrate_roofline`) from measured samples;
* the files: a ``rose-run profile`` (:class:`Profile`, ``PROFILE.json``) and a
  step log (``roseinfer.calibration.steplog``, JSONL) that any backend writes;
* the fidelity report (``roseinfer.calibration.report``): end-to-end error,
  step-model error, replay error and the noise floor.

No torch here.
"""

from roseinfer.calibration.cost_model import (
    BatchShape,
    CostModel,
    RooflineCostModel,
    loop_decode_run_times_s,
    make_cost_model,
)
from roseinfer.calibration.profile import PROFILE_SCHEMA, Profile, load_profile
from roseinfer.calibration.roofline_fit import (
    CalibratedRoofline,
    CalibratedRooflineCostModel,
    OverheadModel,
    OverheadSample,
    calibrate_roofline,
    family_of,
)
from roseinfer.calibration.step_model import (
    BASIS_TERMS,
    HeldOutError,
    ProfiledCostModel,
    ProfileError,
    ProfileSample,
    StepFit,
    fit_step_model,
    shape_aggregates,
)

__all__ = [
    "BASIS_TERMS",
    "PROFILE_SCHEMA",
    "BatchShape",
    "CalibratedRoofline",
    "CalibratedRooflineCostModel",
    "CostModel",
    "HeldOutError",
    "OverheadModel",
    "OverheadSample",
    "Profile",
    "ProfileError",
    "ProfileSample",
    "ProfiledCostModel",
    "RooflineCostModel",
    "StepFit",
    "calibrate_roofline",
    "family_of",
    "fit_step_model",
    "load_profile",
    "loop_decode_run_times_s",
    "make_cost_model",
    "shape_aggregates",
]
