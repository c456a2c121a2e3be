"""OpenAI request bodies -> engine arguments, and the response bodies.

Fields follow OpenAI's Completions and Chat Completions APIs, with vLLM's
extensions where OpenAI has none (``top_k``, ``ignore_eos``, ``stop_token_ids``,
token-id prompts). A field the engine cannot honour is refused (400 naming it)
rather than ignored: ``n`` > 1, ``logprobs``, ``echo``, penalties. Unknown
fields are ignored, as OpenAI-compatible servers do. Python's silent
conversions are refused: ``max_tokens`` 2.5 or ``true``, float token ids.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from roseinfer.executor.validation import InvalidRequestError, check_sampling, check_token_ids
from roseinfer.request import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Fields accepted only at their no-op value: (name, allowed values).
NO_OP_FIELDS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("n", (None, 1)),
    ("best_of", (None, 1)),
    ("echo", (None, False)),
    ("logprobs", (None, False, 0)),
    ("top_logprobs", (None, 0)),
    ("suffix", (None, "")),
    ("presence_penalty", (None, 0, 0.0)),
    ("frequency_penalty", (None, 0, 0.0)),
    ("repetition_penalty", (None, 1, 1.0)),
    ("min_p", (None, 0, 0.0)),
    ("logit_bias", (None, {})),
)


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: ``{"error": {message, type, param, code}}``."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}
        }


def bad(field: str, message: str) -> ApiError:
    """A 400 naming ``field``."""
    return ApiError(400, f"{field}: {message}", param=field)


@dataclass(frozen=True, slots=True)
class Generation:
    """One request, as the engine takes it.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: most output tokens.
        sampling: sampling parameters (checked).
        stop: stop strings (the text is cut before the first one found).
        stream: answer as server-sent events.
        include_usage: streaming: send a usage chunk before ``[DONE]``.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What parsing needs to know of the served model."""

    name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int


def _int(body: dict[str, Any], field: str, default: int | None) -> int | None:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise bad(field, f"must be an integer, got {value!r}")
    return int(value)


def _number(body: dict[str, Any], field: str, default: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise bad(field, f"must be a finite number, got {value!r}")
    return float(value)


def _bool(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(field, f"must be true or false, got {value!r}")
    return value


def _check_model(body: dict[str, Any], ctx: ModelContext) -> None:
    model = body.get("model")
    if model is not None and model != ctx.name:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {ctx.name!r}", "model"
        )


def _check_no_ops(body: dict[str, Any]) -> None:
    for field, allowed in NO_OP_FIELDS:
        if field in body and not any(
            body[field] == a and type(body[field]) is type(a) for a in allowed
        ):
            raise bad(field, f"is not supported (only {allowed[1]!r}), got {body[field]!r}")


def encode_text(text: str, ctx: ModelContext, field: str = "prompt") -> tuple[int, ...]:
    """Token ids of ``text``; refuses words the synthetic vocabulary lacks.

    Raises:
        ApiError: 400 naming ``field``.
    """
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    unk = getattr(ctx.tokenizer, "unk_token_id", None)
    if getattr(ctx.tokenizer, "is_synthetic", False) and unk in ids:
        word = next(w for w in text.split() if ctx.tokenizer.convert_tokens_to_ids(w) == unk)
        raise bad(
            field,
            f"{word[:40]!r} is not a word of this random-weight model's synthetic vocabulary "
            f"(t0 .. t{ctx.vocab_size - 1}); send token ids, or start rose-serve with "
            "--tokenizer DIR",
        )
    if not ids:
        raise bad(field, "must not be empty")
    return tuple(ids)


def _prompt_ids(prompt: Any, ctx: ModelContext) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise bad("prompt", "batches of prompts are not supported; send one request per prompt")
    if isinstance(prompt, str):
        return encode_text(prompt, ctx)
    try:
        return check_token_ids(prompt, ctx.vocab_size)
    except InvalidRequestError as err:
        raise bad("prompt", str(err).removeprefix("prompt ")) from None


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stops)


def _sampling(body: dict[str, Any], eos_token_id: int | None) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _int(body, "top_k", -1)
    if temperature < 0:
        raise bad("temperature", f"must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < -1:
        raise bad("top_k", f"must be >= 0, or -1 (no limit), got {top_k}")
    ignore_eos = _bool(body, "ignore_eos", False)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad("stop_token_ids", f"must be a list of token ids, got {stop_ids!r}")
    if eos_token_id is not None and not ignore_eos:
        stop_ids = [*stop_ids, eos_token_id]
    # NOTE: the engine's ignore_eos turns every stop id off; here it drops EOS only (vLLM's meaning).
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k if top_k is not None else -1,
        top_p=top_p,
        seed=_int(body, "seed", None),
        ignore_eos=not stop_ids,
        stop_token_ids=tuple(stop_ids),
    )
    try:
        check_sampling(params)
    except InvalidRequestError as err:
        raise bad(err.field, str(err).removeprefix(f"{err.field} ")) from None
    return params


def _generation(
    body: dict[str, Any], ids: tuple[int, ...], max_tokens: int | None, ctx: ModelContext
) -> Generation:
    room = ctx.max_model_len - len(ids)
    if room < 1:
        raise bad(
            "prompt", f"{len(ids)} tokens leave no room under max_model_len {ctx.max_model_len}"
        )
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise bad(
            "max_tokens",
            f"{max_tokens} + {len(ids)} prompt tokens > max_model_len {ctx.max_model_len}; "
            f"use at most {room}",
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", f"must be an object, got {options!r}")
    eos = getattr(ctx.tokenizer, "eos_token_id", None)
    return Generation(
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=_sampling(body, eos if isinstance(eos, int) else None),
        stop=_stop(body),
        stream=_bool(body, "stream", False),
        include_usage=_bool(options, "include_usage", False),
    )


def parse_completion(body: Any, ctx: ModelContext) -> Generation:
    """A ``/v1/completions`` body as engine arguments.

    Raises:
        ApiError: 400 naming the bad field, 404 for another model's name.
    """
    body = _object(body)
    _check_model(body, ctx)
    _check_no_ops(body)
    if "prompt" not in body:
        raise bad("prompt", "is required (text or a list of token ids)")
    ids = _prompt_ids(body["prompt"], ctx)
    return _generation(body, ids, _int(body, "max_tokens", DEFAULT_MAX_TOKENS), ctx)


def parse_chat(body: Any, ctx: ModelContext) -> Generation:
    """A ``/v1/chat/completions`` body as engine arguments (the tokenizer's chat
    template renders ``messages``).

    Raises:
        ApiError: 400 naming the bad field, or when the tokenizer has no chat template.
    """
    body = _object(body)
    _check_model(body, ctx)
    _check_no_ops(body)
    if getattr(ctx.tokenizer, "chat_template", None) is None:
        raise bad("messages", "this model's tokenizer has no chat template; use /v1/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise bad("messages", "must be a non-empty list of {role, content: string} objects")
    text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = encode_text(text, ctx, field="messages")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    return _generation(body, ids, max_tokens, ctx)


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    """OpenAI's usage object (tokens)."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], chat: bool, chunk: bool
) -> dict[str, Any]:
    """The envelope of a (chat) completion or of one of its stream chunks."""
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": rid,
        "object": f"{kind}.chunk" if chat and chunk else kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def choice(
    text: str, finish_reason: str | None, chat: bool, chunk: bool, first: bool = False
) -> dict[str, Any]:
    """One choice: ``text`` (completions), ``message`` or ``delta`` (chat)."""
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    message = {"role": "assistant", "content": text}
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
