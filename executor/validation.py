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
# NOTE: sampling divides float32 logits by the temperature: below vLLM's 1e-2 floor
# (vllm/sampling_params.py clamps there) logits / T overflow to inf and the softmax
# is NaN; a temperature under float32's range even rounds to 0 (a division by 0).
MIN_TEMPERATURE = 1e-2
MIN_TOP_P = 1.1754943508222875e-38  # float32's smallest normal number: top_p > 0 in float32
MAX_TOP_K = 2**63 - 1  # the sampler holds top_k in an int64 tensor; >= the vocabulary = no limit
# NOTE: caps on a request's stop conditions. Every output token is checked against
# each stop string (text held back is at most the longest one) and against the stop
# token ids; OpenAI allows 4 stop strings, a model's own stop tokens are a handful.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # a request's own stop token ids
# NOTE: a front end adds the model's end-of-sequence id to a request's stop token ids
# (rose-serve, StreamingEngine's default), so the engine takes one more than a
# request may name: the limit applies to what the client sent.
MAX_ENGINE_STOP_TOKEN_IDS = MAX_STOP_TOKEN_IDS + 1


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
        raise InvalidRequestError(field, f"must be an integer >= 1, got {_clip(max_tokens)}")
    return int(max_tokens)


def check_token_ids(
    ids: Any, vocab_size: int, field: str = "prompt", max_len: int | None = None
) -> tuple[int, ...]:
    """Return ``ids`` as a tuple of ints if it is a non-empty sequence of integer
    ids in ``[0, vocab_size)`` (bools and floats refused, never truncated).

    Args:
        max_len: most ids, checked before any id is looked at (None: no limit).

    Raises:
        InvalidRequestError: naming the length, or the first bad id and its position.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequestError(field, f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    if max_len is not None and len(ids) > max_len:
        raise InvalidRequestError(
            field, f"has {len(ids)} tokens; at most {max_len} fit under max_model_len"
        )
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                field,
                f"token id {_clip(t)} outside the model's vocabulary (position {i}): token ids "
                f"are integers in [0, {vocab_size})",
            )
    return tuple(int(t) for t in ids)


def check_sampling(params: SamplingParams) -> None:
    """Check every field of ``params`` as sampling (float32) will use it.

    ``temperature`` 0 (greedy) or a finite number >= :data:`MIN_TEMPERATURE`;
    ``top_p`` in ``[MIN_TOP_P, 1]`` (> 0 in float32); integer ``top_k`` in
    ``[0, MAX_TOP_K]`` or -1 (0 and -1 disable, -1 as in vLLM; a value >= the
    vocabulary keeps every token); ``seed`` None or an integer that fits 64 bits;
    bool ``ignore_eos``; at most :data:`MAX_ENGINE_STOP_TOKEN_IDS` integer
    ``stop_token_ids`` (a request's own and the model's end-of-sequence id).

    Raises:
        InvalidRequestError: naming the first bad field.
    """
    check_sampling_values(params.temperature, params.top_p, params.top_k)
    seed = params.seed
    if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
        raise InvalidRequestError(
            "seed", f"must be an integer in [-2**63, 2**64) (64 bits), got {_clip(seed)}"
        )
    if not isinstance(params.ignore_eos, bool):
        raise InvalidRequestError("ignore_eos", f"must be true or false, got {params.ignore_eos!r}")
    check_stop_token_ids(params.stop_token_ids, MAX_ENGINE_STOP_TOKEN_IDS)


def check_sampling_values(temperature: Any, top_p: Any, top_k: Any) -> None:
    """Check the three values sampling computes with (see :func:`check_sampling`).

    Raises:
        InvalidRequestError: naming the first bad one.
    """
    t, p, k = temperature, top_p, top_k
    if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
        raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {_clip(t)}")
    if 0 < float(t) < MIN_TEMPERATURE:
        raise InvalidRequestError(
            "temperature",
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t!r}: float32 logits divided "
            "by a smaller temperature overflow; send 0 for greedy decoding",
        )
    if isinstance(p, bool) or not isinstance(p, Real) or not MIN_TOP_P <= float(p) <= 1:
        raise InvalidRequestError(
            "top_p",
            f"must be a number in (0, 1] that float32 holds (>= {MIN_TOP_P:.4g}), got {_clip(p)}",
        )
    if not _is_int(k) or not -1 <= k <= MAX_TOP_K:
        raise InvalidRequestError(
            "top_k", f"must be an integer in [0, 2**63), or -1 (no limit), got {_clip(k)}"
        )


def check_stop_token_ids(ids: Any, max_ids: int = MAX_STOP_TOKEN_IDS) -> tuple[int, ...]:
    """Return ``ids`` as :class:`StopTokenIds` if it is a sequence of at most
    ``max_ids`` integers (the request ends when it samples one).

    Args:
        max_ids: most ids (:data:`MAX_STOP_TOKEN_IDS`: what a request may name).

    Raises:
        InvalidRequestError: naming ``stop_token_ids``, the count, or the first
            element that is not an integer (``null`` included) and its position.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequestError(
            "stop_token_ids", f"must be a list of token ids, got {_clip(ids)}"
        )
    if len(ids) > max_ids:
        raise InvalidRequestError(
            "stop_token_ids", f"has {len(ids)} ids; at most {max_ids} are allowed"
        )
    bad = next((i for i, s in enumerate(ids) if not _is_int(s)), None)
    if bad is not None:
        raise InvalidRequestError(
            "stop_token_ids", f"must be integers, got {_clip(ids[bad])} at position {bad}"
        )
    return ids if isinstance(ids, StopTokenIds) else StopTokenIds(int(s) for s in ids)


class StopTokenIds(tuple[int, ...]):
    """Stop token ids: a tuple (``SamplingParams.stop_token_ids``) whose ``in`` is
    a set lookup, O(1) per sampled token whatever the list's length."""

    def __init__(self, ids: Any = ()) -> None:
        self._set = frozenset(self)

    def __contains__(self, token: object) -> bool:
        return token in self._set


def check_stop(stop: Any, field: str = "stop") -> tuple[str, ...]:
    """Return stop strings as a tuple: a string or a sequence of at most
    :data:`MAX_STOP_STRINGS` non-empty strings of at most
    :data:`MAX_STOP_STRING_CHARS` characters, valid Unicode (no lone surrogate).

    Raises:
        InvalidRequestError: naming ``field``.
    """
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, bytes) or not isinstance(stops, Sequence):
        raise InvalidRequestError(
            field, f"must be a non-empty string or a list of them, got {_clip(stop)}"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            field, f"has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(
                field, f"must be a non-empty string or a list of them, got {_clip(s)}"
            )
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                field,
                f"has a string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
            )
        check_text(s, field)
    return tuple(stops)


def check_text(text: str, field: str) -> str:
    """Return ``text`` if it encodes as UTF-8 (JSON may carry a lone surrogate
    such as ``\\ud800``, which no tokenizer takes).

    Raises:
        InvalidRequestError: naming ``field`` and the character's position.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            field,
            f"is not valid Unicode: a lone surrogate {text[err.start]!r} at character {err.start}",
        ) from None
    return text


def _clip(value: Any, max_chars: int = 60) -> str:
    """``repr(value)`` cut to ``max_chars`` (a message never echoes a huge value)."""
    if isinstance(value, int) and value.bit_length() > 128:  # str() of a huge int is slow
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text)} characters)"


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
