"""OpenAI request bodies -> engine arguments, and the response bodies.

Fields follow OpenAI's Completions and Chat Completions APIs, with vLLM's
extensions where OpenAI has none (``top_k``, ``ignore_eos``, ``stop_token_ids``,
token-id prompts). A field the engine cannot honour is refused (400 naming it)
rather than ignored: ``n`` > 1, ``logprobs``, ``echo``, penalties. Unknown
fields are ignored, as OpenAI-compatible servers do. Python's silent
conversions are refused: ``max_tokens`` 2.5 or ``true``, float token ids.

Parsing is bounded before it is costly: a body is decoded with integers over
:data:`MAX_INT_DIGITS` digits kept as text (no quadratic conversion) and
nesting limited by the recursion limit; every cheap field is checked before the
prompt is tokenized; a prompt longer than ``max_model_len`` tokens, or a text
longer than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters, is refused
before tokenizing (the exact token count is checked after).

Decoding is bounded too (:func:`parse_body`): a body holding more JSON values
than a request to the model can (:attr:`ModelContext.max_json_values`, counted
from above by its ``[``, ``{`` and ``,`` bytes) is refused before any object is
built, and a body is decoded and parsed with the cyclic garbage collector
paused, so its objects (350,000 lists in 1 MB of ``[[],[],...]``) never make the
collector walk the server's heap while the parsing thread holds the GIL.
"""

from __future__ import annotations

import gc
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from roseinfer.executor.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
    StopTokenIds,
    check_sampling,
    check_sampling_values,
    check_stop,
    check_stop_token_ids,
    check_text,
    check_token_ids,
)
from roseinfer.request import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# NOTE: characters per token, generously: tokenizers average 3-5 characters per token
# on text and code; only long runs of one character pack more. A text over
# max_model_len * this is refused untokenized: it cannot fit, and tokenizing it costs.
MAX_CHARS_PER_TOKEN = 32
MAX_INT_DIGITS = 100  # longer JSON integers stay text: no field takes one (seeds have 20)
# JSON bytes of one character at most: "\uXXXX" (ensure_ascii clients escape every non-ASCII)
MAX_JSON_BYTES_PER_CHAR = 6
REQUEST_BYTES_SLACK = 1 << 20  # the other fields: stop strings, messages' framing, options
# NOTE: JSON values of a body beyond its prompt and stop conditions: chat messages'
# framing (3 per message), options, fields a server ignores (e.g. tools' schemas)
JSON_VALUES_SLACK = 1 << 16
DEFAULT_TIMEOUT_REQUEST_BODY_S = (
    30.0  # s for a body: the 2.5 MiB default at 8192 tokens, 0.7 Mbit/s
)
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


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body limit (bytes): room for a prompt of the most characters
    parsing takes (``max_model_len * MAX_CHARS_PER_TOKEN``), each JSON-escaped
    (``MAX_JSON_BYTES_PER_CHAR``), plus :data:`REQUEST_BYTES_SLACK` for the rest."""
    return max_model_len * MAX_CHARS_PER_TOKEN * MAX_JSON_BYTES_PER_CHAR + REQUEST_BYTES_SLACK


class HugeInt:
    """A JSON integer of more than :data:`MAX_INT_DIGITS` digits, kept as its
    digit count: every field refuses it by name."""

    __slots__ = ("num_digits",)

    def __init__(self, text: str) -> None:
        self.num_digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.num_digits} digits"


def _parse_int(text: str) -> int | HugeInt:
    return HugeInt(text) if len(text) > MAX_INT_DIGITS else int(text)


def _parse_float(text: str) -> float:
    # NOTE: a Python function, as _parse_int: the decoder runs Python code per number,
    # where another thread may take the GIL; its C float path holds the GIL for a
    # whole array (300,000 floats: 60 ms on a quiet 2-core CPU)
    return float(text)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (for every thread) inside the block,
    then restore it (on again only if it was on).

    The collector runs on allocation counts: decoding a 1 MB body of empty lists
    makes about 350,000 container objects, which set off full collections, each
    walking every object the process holds (torch and transformers: 0.3-1.0 s for
    450,000 objects on a 2-core CPU) while the GIL is held. Objects made and
    dropped inside the block are freed by reference counting, never walked.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def parse_body(
    raw: bytes, parse: Callable[[Any, ModelContext], Generation], ctx: ModelContext
) -> Generation:
    """Decode a request body and ``parse`` it (:func:`parse_completion`,
    :func:`parse_chat`) with the garbage collector paused
    (:func:`collector_paused`); the decoded body is dropped before it resumes.

    Raises:
        ApiError: 400 (param ``body``) before decoding when the body holds more
            JSON values than ``ctx.max_json_values``; as :func:`decode_body` and
            ``parse`` do (raised anew, so its traceback holds no frame that holds
            the body).
    """
    # every value but the outermost follows a ',' or opens its container: <= this + 1
    num_values = raw.count(b"[") + raw.count(b"{") + raw.count(b",")
    if num_values > ctx.max_json_values:
        raise ApiError(
            400,
            f"the request body holds up to {num_values} JSON values (its '[', '{{' and ',' "
            f"bytes); a request to this model holds at most {ctx.max_json_values}: a prompt "
            f"of {ctx.max_prompt_chars} characters or {ctx.max_model_len} token ids, the stop "
            f"strings and ids, and {JSON_VALUES_SLACK} more",
            "body",
        )
    with collector_paused():
        body = decode_body(raw)
        try:
            return parse(body, ctx)
        except ApiError as err:
            refused = ApiError(err.status, str(err), err.param)
        del body
    raise refused


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object.

    Raises:
        ApiError: 400 if it is not JSON (also: not UTF-8, nested deeper than the
            recursion limit), or not an object.
    """
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {str(err)[:200]}") from None
    return _object(body)


@dataclass(frozen=True, slots=True)
class Generation:
    """One request, as the engine takes it.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: most output tokens.
        sampling: sampling parameters (checked).
        stop: stop strings (checked; the engine cuts the text before the first one
            found and finishes the request there).
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

    @property
    def max_prompt_chars(self) -> int:
        """Most characters of text tokenized for one request (see :data:`MAX_CHARS_PER_TOKEN`)."""
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    @property
    def max_json_values(self) -> int:
        """Most JSON values (arrays, objects and their elements) a request body may
        hold: a prompt of :attr:`max_prompt_chars` characters (each may be a ``[``,
        ``{`` or ``,``) and ``max_model_len`` token ids, the most stop strings'
        characters and stop token ids, and :data:`JSON_VALUES_SLACK`."""
        return (
            self.max_prompt_chars
            + self.max_model_len
            + MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS
            + MAX_STOP_TOKEN_IDS
            + JSON_VALUES_SLACK
        )


def _int(body: dict[str, Any], field: str, default: int | None) -> int | None:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, HugeInt):
        raise bad(field, f"must be an integer of at most {MAX_INT_DIGITS} digits, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise bad(field, f"must be an integer, got {_clip(value)}")
    return int(value)


def _number(body: dict[str, Any], field: str, default: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise bad(field, f"must be a finite number, got {_clip(value)}")
    return float(value)


def _clip(value: Any, max_chars: int = 60) -> str:
    """``repr(value)`` cut to ``max_chars``: a message never echoes a huge value."""
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text)} characters)"


def _checked(check: Any, *args: Any) -> Any:
    """``check(*args)`` with its :class:`InvalidRequestError` as a 400 naming the field."""
    try:
        return check(*args)
    except InvalidRequestError as err:
        raise bad(err.field, str(err).removeprefix(f"{err.field} ")) from None


def _bool(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(field, f"must be true or false, got {_clip(value)}")
    return value


def _check_model(body: dict[str, Any], ctx: ModelContext) -> None:
    model = body.get("model")
    if model is not None and model != ctx.name:
        raise ApiError(
            404, f"model {_clip(model)} does not exist; this server serves {ctx.name!r}", "model"
        )


def _check_no_ops(body: dict[str, Any]) -> None:
    for field, allowed in NO_OP_FIELDS:
        if field in body and not any(
            body[field] == a and type(body[field]) is type(a) for a in allowed
        ):
            raise bad(field, f"is not supported (only {allowed[1]!r}), got {_clip(body[field])}")


def encode_text(text: str, ctx: ModelContext, field: str = "prompt") -> tuple[int, ...]:
    """Token ids of ``text``; refuses a text too long to tokenize, a lone surrogate,
    and words the synthetic vocabulary lacks (named as the tokenizer split them).

    Raises:
        ApiError: 400 naming ``field``.
    """
    if len(text) > ctx.max_prompt_chars:
        raise bad(
            field,
            f"has {len(text)} characters; at most {ctx.max_prompt_chars} are tokenized "
            f"(max_model_len {ctx.max_model_len} x {MAX_CHARS_PER_TOKEN} characters per token)",
        )
    _checked(check_text, text, field)
    try:
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    except Exception as err:  # noqa: BLE001 - the client's text, not the server, is at fault
        raise bad(field, f"could not be tokenized: {str(err)[:200]}") from None
    unk = getattr(ctx.tokenizer, "unk_token_id", None)
    if getattr(ctx.tokenizer, "is_synthetic", False) and isinstance(unk, int) and unk in ids:
        raise bad(
            field,
            f"{_unknown_word(text, ctx, unk)!r} is not a word of this random-weight model's "
            f"synthetic vocabulary (t0 .. t{ctx.vocab_size - 1}); send token ids, or start "
            "rose-serve with --tokenizer DIR",
        )
    if not ids:
        raise bad(field, "must not be empty")
    return tuple(ids)


def _unknown_word(text: str, ctx: ModelContext, unk: int) -> str:
    """The first word of ``text`` the tokenizer maps to ``unk``, as the tokenizer
    split it (``str.split`` splits on other characters, e.g. ``\\x1f``)."""
    enc = ctx.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start, end = enc["offset_mapping"][enc["input_ids"].index(unk)]
    return text[start:end][:40]


def _prompt_ids(prompt: Any, ctx: ModelContext) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise bad("prompt", "batches of prompts are not supported; send one request per prompt")
    if isinstance(prompt, str):
        return encode_text(prompt, ctx)
    return _checked(check_token_ids, prompt, ctx.vocab_size, "prompt", ctx.max_model_len - 1)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if not isinstance(stop, (str, list)):
        raise bad("stop", f"must be a non-empty string or a list of them, got {_clip(stop)}")
    return _checked(check_stop, stop)


def _sampling(body: dict[str, Any], ctx: ModelContext) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _int(body, "top_k", -1)
    if top_k is not None and top_k > ctx.vocab_size:  # NOTE: the same tokens: all of them
        top_k = ctx.vocab_size
    ignore_eos = _bool(body, "ignore_eos", False)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list):
        raise bad("stop_token_ids", f"must be a list of token ids, got {_clip(stop_ids)}")
    stop_ids = list(_checked(check_stop_token_ids, stop_ids))
    eos = getattr(ctx.tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and not ignore_eos and eos not in stop_ids:
        stop_ids.append(eos)  # checked with room for it (MAX_ENGINE_STOP_TOKEN_IDS)
    # NOTE: the engine's ignore_eos turns every stop id off; here it drops EOS only (vLLM's meaning).
    _checked(check_sampling_values, temperature, top_p, top_k)
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k if top_k is not None else -1,
        top_p=top_p,
        seed=_int(body, "seed", None),
        ignore_eos=not stop_ids,
        stop_token_ids=StopTokenIds(stop_ids),
    )
    _checked(check_sampling, params)
    return params


@dataclass(frozen=True, slots=True)
class _Options:
    """A body's fields other than the prompt and ``max_tokens``, checked."""

    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _options(body: dict[str, Any], ctx: ModelContext) -> _Options:
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):  # NOTE: [], "" and 0 too: falsy is not absent
        raise bad("stream_options", f"must be an object or null, got {_clip(options)}")
    return _Options(
        sampling=_sampling(body, ctx),
        stop=_stop(body),
        stream=_bool(body, "stream", False),
        include_usage=_bool(options, "include_usage", False),
    )


def _generation(
    ids: tuple[int, ...], max_tokens: int | None, options: _Options, ctx: ModelContext
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
    return Generation(
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=options.sampling,
        stop=options.stop,
        stream=options.stream,
        include_usage=options.include_usage,
    )


def parse_completion(body: Any, ctx: ModelContext) -> Generation:
    """A ``/v1/completions`` body as engine arguments; every other field is checked
    before the prompt is tokenized.

    Raises:
        ApiError: 400 naming the bad field, 404 for another model's name.
    """
    body = _object(body)
    _check_model(body, ctx)
    _check_no_ops(body)
    if "prompt" not in body:
        raise bad("prompt", "is required (text or a list of token ids)")
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    options = _options(body, ctx)
    return _generation(_prompt_ids(body["prompt"], ctx), max_tokens, options, ctx)


def parse_chat(body: Any, ctx: ModelContext) -> Generation:
    """A ``/v1/chat/completions`` body as engine arguments (the tokenizer's chat
    template renders ``messages``, once their text is checked and bounded).

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
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    options = _options(body, ctx)
    return _generation(_chat_ids(messages, ctx), max_tokens, options, ctx)


def _chat_ids(messages: list[dict[str, Any]], ctx: ModelContext) -> tuple[int, ...]:
    num_chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
    if num_chars > ctx.max_prompt_chars:
        raise bad(
            "messages",
            f"have {num_chars} characters; at most {ctx.max_prompt_chars} are tokenized "
            f"(max_model_len {ctx.max_model_len} x {MAX_CHARS_PER_TOKEN} characters per token)",
        )
    for m in messages:
        _checked(check_text, m["role"], "messages")
        _checked(check_text, m["content"], "messages")
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # noqa: BLE001 - a template refusing the messages (e.g. roles)
        raise bad("messages", f"the chat template refused them: {str(err)[:200]}") from None
    return encode_text(text, ctx, field="messages")


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
