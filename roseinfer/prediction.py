"""Output-length predictors: the plugin kind length-aware policies consult.

A :class:`LengthPredictor` answers "how many output tokens will this request
produce?" before it runs. Length-aware policies (``sjf``, ``srpt``, ``hrrn``)
declare ``uses_length_predictor`` and get one from the registry, chosen by
``--length-predictor`` (built-ins: ``oracle``, ``noisy-oracle``, ``bucket``,
``none``; third-party ones through the ``register_length_predictors`` hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from roseinfer.interface import PolicyOption, PolicyOptions
from roseinfer.request import Request

DEFAULT_LENGTH_PREDICTOR = "bucket"
"""The predictor of a length-aware policy given none: a realistic, learned one
(``oracle`` is an upper bound a server never has). A run that falls back on it
says so (:meth:`roseinfer.interface.AdmissionPolicy.input_warnings`)."""

LENGTH_PREDICTOR_OPTION = PolicyOption(
    "length_predictor",
    str,
    DEFAULT_LENGTH_PREDICTOR,
    "length-aware policies (sjf, srpt, hrrn): output-length predictor, one of oracle (true "
    "lengths: an upper bound), noisy-oracle, bucket, none; see --list-policies "
    f"(default {DEFAULT_LENGTH_PREDICTOR}, announced at start)",
)


class LengthPredictor:
    """Base class of output-length predictors.

    Subclasses set ``name`` and ``description`` and override :meth:`predict`
    (and :meth:`fit` if they learn from a training slice). Instances are made
    per run with the run's :class:`PolicyOptions` (their ``option_specs`` are
    real CLI flags, as for policies).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    option_specs: ClassVar[tuple[PolicyOption, ...]] = ()

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options if options is not None else PolicyOptions()

    def opt(self, name: str) -> Any:
        """The value of the declared option ``name`` (its default when not given).

        Raises:
            KeyError: if this class declares no such option.
        """
        for spec in type(self).option_specs:
            if spec.name == name:
                value = self.options.get(name)
                return spec.default if value is None else spec.convert(value)
        raise KeyError(f"{type(self).__name__} declares no option {name!r}")

    def fit(self, requests: Sequence[Request]) -> None:
        """Learn from the workload (sorted by arrival) before a replay. Default: nothing."""

    def predict(self, request: Request) -> float:
        """Predicted output tokens of ``request`` (> 0)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
