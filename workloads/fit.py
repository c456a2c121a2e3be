"""Fitting a workload to a real model: lengths that fit its context, token ids.

A trace gives lengths, not text; the executor needs token ids and requests that
fit the model's context. These helpers make both, deterministically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import numpy as np

from roseinfer.request import Request
from roseinfer.workloads.errors import WorkloadError
from roseinfer.workloads.synthetic import GPT2_VOCAB_SIZE

FIT_MODES = ("clip", "scale")  # --fit-lengths, besides "off"


MAX_MADE_UP_TOKENS = 2**24
"""Most prompt tokens made up for one request (16.8M, above any model's context): a
trace row of 2^31 tokens must not allocate 16 GB of ids for a request no model takes."""


def with_token_ids(
    requests: Sequence[Request],
    vocab_size: int = GPT2_VOCAB_SIZE,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[Request]:
    """Copies with made-up, deterministic ``prompt_token_ids`` where they are missing.

    For replaying a length-only trace on the real executor. A request with
    ``prefix_hash_ids`` gets, for each hash id, ``prefix_hash_block_tokens`` ids
    drawn from ``default_rng([seed, 0, hash_id])``, so equal leading hash ids give
    equal leading tokens and prefix sharing survives; tokens past the hashed
    blocks (and all tokens of a request without hash ids) come from a generator
    seeded by ``seed`` and the request id. Requests that have ids are kept as is.

    Args:
        requests: any workload.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seed: a non-negative int.
        max_model_len: the model's context: a request without ids that is longer
            is left without ids (no id is made for it: the scheduler rejects it on
            arrival, as vLLM rejects a request beyond the model's context).

    Raises:
        WorkloadError: on ``vocab_size <= 0`` or a negative seed, or a request
            that would get ids and is longer than :data:`MAX_MADE_UP_TOKENS`
            (checked for every request before anything is built).
    """
    if vocab_size <= 0 or seed < 0:
        raise WorkloadError(f"need vocab_size > 0 and seed >= 0, got {vocab_size}, {seed}")
    needs_ids = [
        r.prompt_token_ids is None and (max_model_len is None or r.max_num_tokens <= max_model_len)
        for r in requests
    ]
    _check_lengths([r for r, needs in zip(requests, needs_ids) if needs])
    blocks: dict[tuple[int, int], np.ndarray] = {}  # NOTE: shared hash blocks made once
    return [
        dataclasses.replace(r, prompt_token_ids=_made_up_ids(r, vocab_size, seed, blocks))
        if needs
        else r
        for r, needs in zip(requests, needs_ids)
    ]


def _check_lengths(requests: Sequence[Request]) -> None:
    """Refuse the first request too long to make ids for (see :func:`with_token_ids`)."""
    fix = "fit the lengths (--fit-lengths clip or scale) or drop the row"
    for r in requests:
        if r.num_prompt_tokens > MAX_MADE_UP_TOKENS:
            raise WorkloadError(
                f"request {r.request_id[:80]} has {r.num_prompt_tokens} prompt tokens, beyond "
                f"any model's context ({MAX_MADE_UP_TOKENS}); {fix}"
            )


def _made_up_ids(
    r: Request, vocab_size: int, seed: int, blocks: dict[tuple[int, int], np.ndarray]
) -> tuple[int, ...]:
    span = r.prefix_hash_block_tokens
    parts = []
    for hash_id in r.prefix_hash_ids or ():
        key = (hash_id, span)
        if key not in blocks:
            rng = np.random.default_rng([seed, 0, hash_id % 2**64])
            blocks[key] = rng.integers(0, vocab_size, size=span)
        parts.append(blocks[key])
    num_rest = r.num_prompt_tokens - len(parts) * span
    if num_rest > 0:
        rng = np.random.default_rng([seed, 1, _stable_int(r.request_id)])
        parts.append(rng.integers(0, vocab_size, size=num_rest))
    return tuple(np.concatenate(parts)[: r.num_prompt_tokens].tolist())


def _stable_int(text: str) -> int:
    """A 64-bit int from ``text``, equal across processes (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def fit_lengths(
    requests: Sequence[Request], max_model_len: int, mode: str = "clip"
) -> tuple[list[Request], str]:
    """Make every request fit ``prompt + output <= max_model_len`` tokens.

    Modes:
        ``"off"``: change nothing (the scheduler rejects the requests that do
            not fit, as vLLM does); the note counts them.
        ``"clip"``: shorten only the requests that do not fit: the prompt first
            (keeping its leading tokens/hash ids), then the output, keeping at
            least 1 token of each.
        ``"scale"``: multiply every prompt and output length by one factor
            ``max_model_len / longest`` (floored, at least 1 token), so the
            longest request just fits and the length distribution keeps its
            shape; ``prefix_hash_block_tokens`` is scaled too (rounded up), so
            hash-id prefix sharing keeps its proportions.

    Returns:
        (new requests in the same order, a one-line description of the change
        for the results). Requests that already fit are returned unchanged.

    Raises:
        WorkloadError: on an unknown mode (lists ``FIT_MODES`` and ``off``) or
            ``max_model_len < 2``.
    """
    if mode not in (*FIT_MODES, "off"):
        raise WorkloadError(f"unknown fit mode {mode!r}; known: {', '.join(FIT_MODES)}, off")
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
    longest = max((r.max_num_tokens for r in requests), default=0)
    if longest <= max_model_len:
        fits = f"all {len(requests)} requests fit max_model_len={max_model_len}"
        return list(requests), fits if mode != "off" else f"off: {fits}"
    if mode == "off":
        beyond = sum(r.max_num_tokens > max_model_len for r in requests)
        return list(requests), (
            f"off: {beyond} of {len(requests)} requests beyond max_model_len={max_model_len} "
            "(rejected)"
        )
    if mode == "clip":
        return _clip_all(requests, max_model_len)
    return _scale_all(requests, max_model_len, longest)


def _resized(r: Request, num_prompt: int, num_output: int, span: int) -> Request:
    ids = None if r.prompt_token_ids is None else r.prompt_token_ids[:num_prompt]
    hashes = r.prefix_hash_ids
    if hashes is not None:
        hashes = hashes[: -(-num_prompt // span)]
    return dataclasses.replace(
        r,
        num_prompt_tokens=num_prompt,
        max_output_tokens=num_output,
        prompt_token_ids=ids,
        prefix_hash_ids=hashes,
        prefix_hash_block_tokens=span,
    )


def _clip(r: Request, max_model_len: int) -> Request:
    if r.max_num_tokens <= max_model_len:
        return r
    num_prompt = min(r.num_prompt_tokens, max(1, max_model_len - r.max_output_tokens))
    num_output = min(r.max_output_tokens, max_model_len - num_prompt)
    return _resized(r, num_prompt, num_output, r.prefix_hash_block_tokens)


def _clip_all(requests: Sequence[Request], max_model_len: int) -> tuple[list[Request], str]:
    out = [_clip(r, max_model_len) for r in requests]
    num_changed = sum(a is not b for a, b in zip(requests, out))
    num_prompt_cut = sum(a.num_prompt_tokens - b.num_prompt_tokens for a, b in zip(requests, out))
    num_output_cut = sum(a.max_output_tokens - b.max_output_tokens for a, b in zip(requests, out))
    return out, (
        f"clipped {num_changed} of {len(out)} requests to max_model_len={max_model_len} "
        f"(removed {num_prompt_cut} prompt and {num_output_cut} output tokens)"
    )


def _scale_all(
    requests: Sequence[Request], max_model_len: int, longest: int
) -> tuple[list[Request], str]:
    factor = max_model_len / longest

    def scaled(r: Request) -> Request:
        num_prompt = max(1, math.floor(r.num_prompt_tokens * factor))
        num_output = max(1, math.floor(r.max_output_tokens * factor))
        span = max(1, math.ceil(r.prefix_hash_block_tokens * factor))
        return _clip(_resized(r, num_prompt, num_output, span), max_model_len)

    out = [scaled(r) for r in requests]
    return out, (
        f"scaled prompt and output lengths of {len(out)} requests by {factor:.4g} "
        f"(longest request {longest} tokens -> max_model_len={max_model_len})"
    )
