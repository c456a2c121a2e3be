"""Built-in output-length predictors: ``oracle``, ``noisy-oracle``, ``bucket``, ``none``.

Length-aware policies (``sjf``, ``srpt``, ``hrrn``) take one with
``--length-predictor``. ``oracle`` is the upper bound a trace allows (its true
output length); ``noisy-oracle`` degrades it with multiplicative log-normal
error, the error model of the length-prediction studies behind vLLM RFC #29406
and "Efficient LLM Scheduling by Learning to Rank" (Fu et al., 2024);
``bucket`` is the simplest learned predictor (median output per prompt-length
bucket, fitted on a training slice); ``none`` knows nothing.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence

import numpy as np

from roseinfer import hookimpl
from roseinfer.interface import PolicyOption
from roseinfer.prediction import LengthPredictor
from roseinfer.request import Request


class Oracle(LengthPredictor):
    """The trace's true output length (``max_output_tokens``; exact with ignore_eos)."""

    name = "oracle"
    description = "the true output length from the trace (an upper bound on prediction)"

    def predict(self, request: Request) -> float:
        """``request.max_output_tokens``."""
        return float(request.max_output_tokens)


class NoisyOracle(LengthPredictor):
    """True length times ``exp(N(0, sigma))``, drawn per request from a seed.

    The draw depends only on (seed, request id), so every policy in a
    comparison sees the same predictions. sigma 0.5 puts about a third of the
    predictions off by more than 1.6x.
    """

    name = "noisy-oracle"
    description = "true length x lognormal(0, sigma) error, seeded per request"
    option_specs = (
        PolicyOption(
            "length_predictor_sigma",
            float,
            0.5,
            "noisy-oracle: sigma of the log error (default 0.5)",
            minimum=0.0,
        ),
        PolicyOption(
            "length_predictor_seed", int, 0, "noisy-oracle: seed of the errors (default 0)"
        ),
    )

    def predict(self, request: Request) -> float:
        """The noisy prediction (> 0)."""
        seed = zlib.crc32(f"{self.opt('length_predictor_seed')}:{request.request_id}".encode())
        error = random.Random(seed).gauss(0.0, self.opt("length_predictor_sigma"))
        return max(request.max_output_tokens * math.exp(error), 1.0)


class Bucket(LengthPredictor):
    """Median output length per prompt-length bucket (power-of-two edges).

    :meth:`fit` keeps the first ``length_predictor_train_fraction`` of the
    workload by arrival (the training slice; those requests are still replayed)
    and stores the median output of each bucket ``floor(log2(prompt tokens))``;
    an empty bucket uses the slice's overall median. Unfitted (a server), it
    predicts ``length_predictor_default`` tokens.
    """

    name = "bucket"
    description = "median output per prompt-length bucket, fitted on a training slice"
    option_specs = (
        PolicyOption(
            "length_predictor_train_fraction",
            float,
            0.2,
            "bucket: fraction of the workload (first by arrival) it is fitted on (default 0.2)",
            minimum=0.0,
        ),
        PolicyOption(
            "length_predictor_default",
            float,
            256.0,
            "bucket: prediction when unfitted (tokens)",
            minimum=1.0,
        ),
    )

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self.medians: dict[int, float] = {}
        self.overall = float(self.opt("length_predictor_default"))

    def fit(self, requests: Sequence[Request]) -> None:
        """Fit on the first fraction of ``requests`` (at least one).

        Raises:
            ValueError: if the fraction is not in (0, 1].
        """
        fraction = self.opt("length_predictor_train_fraction")
        if not 0 < fraction <= 1:
            raise ValueError(f"--length-predictor-train-fraction must be in (0, 1], got {fraction}")
        train = requests[: max(1, int(len(requests) * fraction))]
        if not train:
            return
        buckets = np.array([_bucket(r.num_prompt_tokens) for r in train])
        outputs = np.array([r.max_output_tokens for r in train], dtype=float)
        self.overall = float(np.median(outputs))
        self.medians = {int(b): float(np.median(outputs[buckets == b])) for b in set(buckets)}

    def predict(self, request: Request) -> float:
        """Median output of the request's prompt-length bucket."""
        return self.medians.get(_bucket(request.num_prompt_tokens), self.overall)


class NoPrediction(LengthPredictor):
    """No information: every request is predicted the same length, so length-aware
    policies fall back to their tie-break (arrival order)."""

    name = "none"
    description = "no prediction (a constant): length-aware policies become FIFO"

    def predict(self, request: Request) -> float:
        """1.0 for every request."""
        return 1.0


def _bucket(num_prompt_tokens: int) -> int:
    return int(num_prompt_tokens).bit_length()


@hookimpl
def register_length_predictors() -> list[type[LengthPredictor]]:
    """The built-in length predictors."""
    return [Oracle, NoisyOracle, Bucket, NoPrediction]
