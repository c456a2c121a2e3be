"""Hook specifications of the ``roseinfer`` plugin namespace.

Plugins implement these with ``@roseinfer.hookimpl``. Built-in plugins are
ordinary modules listed in ``roseinfer.registry.DEFAULT_PLUGINS`` and are
registered exactly as third-party modules found in the ``roseinfer``
entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from roseinfer.interface import AdmissionPolicy, PolicyWrapper
    from roseinfer.kv_tiers import KVTierPolicy
    from roseinfer.prediction import LengthPredictor
    from roseinfer.routing import Router

PROJECT_NAME = "roseinfer"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_admission_policies() -> list[type[AdmissionPolicy]]:  # type: ignore[empty-body]
    """Return admission policy classes contributed by this plugin.

    Each class subclasses :class:`roseinfer.interface.AdmissionPolicy`, has a
    unique ``name`` (the ``--policy`` value) and overrides ``admit``. All
    implementations are collected (a list of lists); duplicate names are an error.
    """


@hookspec
def register_loop_orders() -> list[type[AdmissionPolicy]]:  # type: ignore[empty-body]
    """Return loop-ordering classes contributed by this plugin.

    Each class subclasses :class:`roseinfer.interface.AdmissionPolicy`, has a
    unique ``name`` (the ``--loop-order`` value) and overrides ``order``
    (prefill-first or decode-first for the next iteration). All implementations
    are collected; duplicate names are an error.
    """


@hookspec
def register_policy_wrappers() -> list[type[PolicyWrapper]]:  # type: ignore[empty-body]
    """Return policy wrapper classes contributed by this plugin.

    A wrapper (subclass of :class:`roseinfer.interface.PolicyWrapper`) wraps
    whatever admission policy a run chose, when its ``enabled(options)``
    class method says the run's options ask for it (e.g. force-FIFO when
    ``--force-fifo-every N`` is given). All implementations are collected.
    """


@hookspec
def register_length_predictors() -> list[type[LengthPredictor]]:  # type: ignore[empty-body]
    """Return output-length predictor classes contributed by this plugin.

    Each class subclasses :class:`roseinfer.prediction.LengthPredictor`, has a
    unique ``name`` (the ``--length-predictor`` value) and overrides
    ``predict`` (and ``fit`` to learn from a training slice). All
    implementations are collected; duplicate names are an error.
    """


@hookspec
def register_routers() -> list[type[Router]]:  # type: ignore[empty-body]
    """Return router classes contributed by this plugin.

    Each class subclasses :class:`roseinfer.routing.Router`, has a unique
    ``name`` (the ``--router`` value) and overrides ``score`` and/or ``pick``
    (and ``filter``). Used by clusters (``rose-sim --num-replicas N``). All
    implementations are collected; duplicate names are an error.
    """


@hookspec
def register_kv_tier_policies() -> list[type[KVTierPolicy]]:  # type: ignore[empty-body]
    """Return KV tier policy classes contributed by this plugin.

    Each class subclasses :class:`roseinfer.kv_tiers.KVTierPolicy`, has a unique
    ``name`` (the ``--kv-tier-policy`` value) and decides which block a full KV
    tier evicts (and whether an evicted device block is stored at all). All
    implementations are collected; duplicate names are an error.
    """
