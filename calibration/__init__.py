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

from __future__ import annotations

from typing import TYPE_CHECKING

from roseinfer.metrics.lazy import lazy_exports

if TYPE_CHECKING:
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

_HOMES = {
    "BASIS_TERMS": ".step_model",
    "BatchShape": ".cost_model",
    "CalibratedRoofline": ".roofline_fit",
    "CalibratedRooflineCostModel": ".roofline_fit",
    "CostModel": ".cost_model",
    "HeldOutError": ".step_model",
    "OverheadModel": ".roofline_fit",
    "OverheadSample": ".roofline_fit",
    "PROFILE_SCHEMA": ".profile",
    "Profile": ".profile",
    "ProfileError": ".step_model",
    "ProfileSample": ".step_model",
    "ProfiledCostModel": ".step_model",
    "RooflineCostModel": ".cost_model",
    "StepFit": ".step_model",
    "calibrate_roofline": ".roofline_fit",
    "family_of": ".roofline_fit",
    "fit_step_model": ".step_model",
    "load_profile": ".profile",
    "loop_decode_run_times_s": ".cost_model",
    "make_cost_model": ".cost_model",
    "shape_aggregates": ".step_model",
}
"""Exported name -> the submodule defining it, imported on first use (PEP 562):
a simulation that needs only the roofline never loads the fitters and file readers."""


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


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
