"""Checks of request fields at the engine's API boundary (``add_request``).

A value the model loop cannot take must be refused here, with the field
named, and never reach a step: a NaN temperature or a seed beyond 64 bits
found inside sampling used to end every client's stream. Python's silent
conversions are refused too: ``max_tokens=2.5`` is not 3 tokens, ``True`` is
not 1, and a float token id is not truncated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

from roseinfer.request import Request, SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class InvalidRequestError(ValueError):
    """A request field the engine cannot take.

    Attributes:
        field: the field's name (``temperature``, ``prompt``, ``max_tokens``, ...),
            as an HTTP front end reports it (e.g. OpenAI's ``param``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_request_id(request_id: Any) -> str:
    """Return ``request_id`` if it is a non-empty string.

    Raises:
        InvalidRequestError: otherwise (field ``request_id``).
    """
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id", f"must be a non-empty string, got {request_id!r}")
    return request_id


def check_max_tokens(max_tokens: Any, field: str = "max_tokens") -> int:
    """Return ``max_tokens`` as an int if it is an integer >= 1 (bools refused).

    Raises:
        InvalidRequestError: otherwise.
    """
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequestError(field, f"must be an integer >= 1, got {max_tokens!r}")
    return int(max_tokens)


def check_token_ids(ids: Any, vocab_size: int, field: str = "prompt") -> tuple[int, ...]:
    """Return ``ids`` as a tuple of ints if it is a non-empty sequence of integer
    ids in ``[0, vocab_size)`` (bools and floats refused, never truncated).

    Raises:
        InvalidRequestError: naming the first bad id and its position.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequestError(field, f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                field,
                f"token id {t!r} outside the model's vocabulary (position {i}): token ids "
                f"are integers in [0, {vocab_size})",
            )
    return tuple(int(t) for t in ids)


def check_sampling(params: SamplingParams) -> None:
    """Check every field of ``params`` as sampling will use it.

    Finite ``temperature >= 0``; finite ``0 < top_p <= 1``; integer ``top_k >= 0``
    or -1 (both disable, -1 as in vLLM); ``seed`` None or an integer that fits
    64 bits; bool ``ignore_eos``; integer ``stop_token_ids``.

    Raises:
        InvalidRequestError: naming the first bad field.
    """
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
        raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {t!r}")
    p = params.top_p
    if isinstance(p, bool) or not isinstance(p, Real) or not 0 < p <= 1:
        raise InvalidRequestError("top_p", f"must be a number in (0, 1], got {p!r}")
    k = params.top_k
    if not _is_int(k) or k < -1:
        raise InvalidRequestError("top_k", f"must be an integer >= 0, or -1 (no limit), got {k!r}")
    seed = params.seed
    if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
        raise InvalidRequestError(
            "seed", f"must be an integer in [-2**63, 2**64) (64 bits), got {seed!r}"
        )
    if not isinstance(params.ignore_eos, bool):
        raise InvalidRequestError("ignore_eos", f"must be true or false, got {params.ignore_eos!r}")
    bad = next((s for s in params.stop_token_ids if not _is_int(s)), None)
    if bad is not None:
        raise InvalidRequestError("stop_token_ids", f"must be integers, got {bad!r}")


def check_request(request: Request, vocab_size: int) -> None:
    """Check the fields of ``request`` the executor reads (id, output length,
    prompt ids, sampling).

    Raises:
        InvalidRequestError: naming the first bad field.
    """
    check_request_id(request.request_id)
    check_max_tokens(request.max_output_tokens)
    if request.prompt_token_ids is not None:
        check_token_ids(request.prompt_token_ids, vocab_size)
    check_sampling(request.sampling)
