"""Plugin discovery: built-in and third-party policies through pluggy.

Built-in plugins are modules named in :data:`DEFAULT_PLUGINS`, registered
exactly as third-party modules found in the ``roseinfer`` entry-point group.
Nothing happens at import: call :func:`load_registry`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from roseinfer import hookspecs
from roseinfer.interface import (
    AdmissionPolicy,
    ComposedPolicy,
    PolicyOption,
    PolicyOptions,
    PolicyWrapper,
    check_guarantees,
)
from roseinfer.kv_tiers import KVTierPolicy
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION, LengthPredictor
from roseinfer.routing import Router

ENTRY_POINT_GROUP = "roseinfer"
DEFAULT_PLUGINS: tuple[str, ...] = (
    "roseinfer.policies.admission",
    "roseinfer.policies.orderings",
    "roseinfer.policies.wrappers",
    "roseinfer.policies.length",
    "roseinfer.policies.urgency",
    "roseinfer.policies.fairness",
    "roseinfer.policies.cache",
    "roseinfer.policies.predictors",
    "roseinfer.policies.routers",
    "roseinfer.policies.kv_tiers",
)


class UnknownPolicyError(ValueError):
    """A policy or loop-order name no plugin registered (message lists the known ones)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A registered class and the plugin that contributed it."""

    cls: Any  # type[AdmissionPolicy]; type[LengthPredictor] / type[Router] in those tables
    plugin: str


@dataclass(slots=True)
class Registry:
    """Registered admission policies, loop orders and wrappers by name."""

    policies: dict[str, Entry] = field(default_factory=dict)
    loop_orders: dict[str, Entry] = field(default_factory=dict)
    wrappers: dict[str, Entry] = field(default_factory=dict)
    predictors: dict[str, Entry] = field(default_factory=dict)
    routers: dict[str, Entry] = field(default_factory=dict)
    kv_tier_policies: dict[str, Entry] = field(default_factory=dict)

    def kv_tier_policy(self, name: str) -> type[KVTierPolicy]:
        """The KV tier policy class called ``name`` (``--kv-tier-policy``).

        Raises:
            UnknownPolicyError: listing the known names.
        """
        return _lookup(self.kv_tier_policies, name, "KV tier policy", "--kv-tier-policy")

    def router(self, name: str) -> type[Router]:
        """The router class called ``name`` (clusters, ``--router``).

        Raises:
            UnknownPolicyError: listing the known names.
        """
        return _lookup(self.routers, name, "router", "--router")

    def policy(self, name: str) -> type[AdmissionPolicy]:
        """The admission policy class called ``name``.

        Raises:
            UnknownPolicyError: listing the known names.
        """
        return _lookup(self.policies, name, "policy", "--policy")

    def loop_order(self, name: str) -> type[AdmissionPolicy]:
        """The loop-ordering class called ``name``.

        Raises:
            UnknownPolicyError: listing the known names.
        """
        return _lookup(self.loop_orders, name, "loop order", "--loop-order")

    def predictor(self, name: str) -> type[LengthPredictor]:
        """The length predictor class called ``name``.

        Raises:
            UnknownPolicyError: listing the known names.
        """
        return _lookup(self.predictors, name, "length predictor", "--length-predictor")

    def option_specs(
        self, policy: str, loop_order: str, options: PolicyOptions
    ) -> list[PolicyOption]:
        """The typed options a run with these choices reads (policy, its
        predictor when it uses one, loop order, enabled wrappers).

        Raises:
            UnknownPolicyError: for an unknown name.
        """
        cls = self.policy(policy)
        specs = [*cls.option_specs, *self.loop_order(loop_order).option_specs]
        if cls.uses_length_predictor:
            value = options.get("length_predictor", LENGTH_PREDICTOR_OPTION.default)
            specs += self.predictor(str(value)).option_specs
        for entry in self.wrappers.values():
            if entry.cls.enabled(options):
                specs += entry.cls.option_specs
        return specs

    def all_option_specs(self) -> dict[str, PolicyOption]:
        """Every option any registered plugin declares, by name (for the CLI flags).

        Raises:
            ValueError: if two plugins declare one name with different types.
        """
        specs: dict[str, PolicyOption] = {}
        tables = (self.policies, self.loop_orders, self.wrappers, self.predictors)
        for table in tables:
            for entry in table.values():
                for spec in entry.cls.option_specs:
                    known = specs.setdefault(spec.name, spec)
                    if known.type is not spec.type:
                        raise ValueError(
                            f"option {spec.name!r} is declared as {known.type.__name__} and "
                            f"{spec.type.__name__} by different plugins ({entry.plugin})"
                        )
        return specs

    def make(self, policy: str, loop_order: str, options: PolicyOptions) -> ComposedPolicy:
        """Instantiate the policy a run uses: ``policy`` for admission (wrapped by
        every wrapper that ``options`` enable) and ``loop_order`` for ordering. A
        policy with ``uses_length_predictor`` gets ``.predictor`` (``--length-predictor``).

        Raises:
            UnknownPolicyError: for an unknown name.
        """
        admission: AdmissionPolicy = self.policy(policy)(options)
        plugins = [self.policies[policy].plugin]
        if admission.uses_length_predictor:
            name = str(admission.opt("length_predictor"))
            admission.predictor = self.predictor(name)(options)  # type: ignore[attr-defined]
        for entry in self.wrappers.values():
            wrapper_cls = entry.cls
            assert issubclass(wrapper_cls, PolicyWrapper)
            if wrapper_cls.enabled(options):
                admission = wrapper_cls(admission, options)
                plugins.append(entry.plugin)
        ordering = self.loop_order(loop_order)(options)
        names = (", ".join(dict.fromkeys(plugins)), self.loop_orders[loop_order].plugin)
        return ComposedPolicy(admission, ordering, names)

    def describe(self) -> str:
        """A table of every registered name with its plugin (``--list-policies``)."""
        lines: list[str] = []
        for title, table in (
            ("admission policies (--policy)", self.policies),
            ("loop orders (--loop-order)", self.loop_orders),
            ("wrappers (turned on by their option)", self.wrappers),
            ("length predictors (--length-predictor)", self.predictors),
        ):
            lines.append(title + ":")
            for name, entry in sorted(table.items()):
                option = getattr(entry.cls, "option", "")
                extra = f" [--{option.replace('_', '-')}]" if option else ""
                lines.append(
                    f"  {name:<16} {entry.cls.description}{extra}  (plugin: {entry.plugin})"
                )
        lines.append("routers (--router, with --num-replicas N):")
        for name, rentry in sorted(self.routers.items()):
            lines.append(f"  {name:<16} {rentry.cls.description}  (plugin: {rentry.plugin})")
        lines.append("KV tier policies (--kv-tier-policy, with --kv-offloading-size or --kv-tier):")
        for name, tentry in sorted(self.kv_tier_policies.items()):
            lines.append(f"  {name:<16} {tentry.cls.description}  (plugin: {tentry.plugin})")
        return "\n".join(lines)


def _lookup(table: dict[str, Entry], name: str, what: str, flag: str) -> Any:
    entry = table.get(name)
    if entry is None:
        known = ", ".join(sorted(table)) or "(none)"
        raise UnknownPolicyError(f"unknown {what} {name!r} for {flag}; known: {known}")
    return entry.cls


Warn = Callable[[str], None]
"""Where a skipped plugin is reported (the CLIs print ``prog: warning: ...``)."""


_WARNING_SINK: Warn | None = None
_WARNED: set[str] = set()


def set_warning_sink(warn: Warn | None) -> None:
    """Report skipped plugins of every later load that names no ``warn`` through
    ``warn``, each message once per process (a CLI: its ``prog: warning:`` line;
    a sweep loads the plugins once per point). None restores the default, a
    ``RuntimeWarning`` per load."""
    global _WARNING_SINK
    _WARNING_SINK = warn
    _WARNED.clear()


@contextlib.contextmanager
def warning_sink(warn: Warn) -> Iterator[None]:
    """:func:`set_warning_sink` for the duration of a ``with`` block (a CLI's run),
    then the previous sink again."""
    previous = _WARNING_SINK
    set_warning_sink(warn)
    try:
        yield
    finally:
        set_warning_sink(previous)


def current_warning_sink() -> Warn | None:
    """The sink :func:`set_warning_sink` set (None: the default, a ``RuntimeWarning``),
    for other core modules that report through the same channel."""
    return _WARNING_SINK


def _warn_default(message: str) -> None:
    if _WARNING_SINK is None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    elif message not in _WARNED:
        _WARNED.add(message)
        _WARNING_SINK(message)


def make_plugin_manager(
    *, load_entry_points: bool = True, warn: Warn | None = None
) -> pluggy.PluginManager:
    """A fresh plugin manager with the built-ins and (optionally) entry-point plugins.

    An entry-point plugin that fails to import or to register (e.g. a hook with a
    wrong signature) is skipped and reported through ``warn`` (default: a
    ``RuntimeWarning``) naming the entry point, so one broken package never
    breaks ``--policy fifo`` or ``--list-policies``.

    Raises:
        ImportError: if a built-in module cannot be imported.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        _load_entry_points(pm, warn or _warn_default)
    return pm


def _load_entry_points(pm: pluggy.PluginManager, warn: Warn) -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue  # NOTE: as pluggy's loader: the first distribution of a name wins
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as err:  # noqa: BLE001 - any failure of third-party code
            warn(f"skipped plugin entry point {ep.name!r} ({ep.value}): {_describe(err)}")


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def load_registry(pm: pluggy.PluginManager | None = None, *, warn: Warn | None = None) -> Registry:
    """Collect every plugin's classes into a :class:`Registry`.

    A plugin whose ``register_*`` hook raises is skipped entirely (none of its
    classes is registered) and reported through ``warn`` (default: a
    ``RuntimeWarning``); the built-ins' hooks never raise.

    Raises:
        ValueError: if two classes claim the same name, a class lacks a name, or a
            policy declares a guarantee not in :data:`roseinfer.interface.GUARANTEES`.
    """
    warn = warn or _warn_default
    pm = pm if pm is not None else make_plugin_manager(warn=warn)
    registry = Registry()
    hooks: tuple[tuple[str, dict[str, Entry], type], ...] = (
        ("register_admission_policies", registry.policies, AdmissionPolicy),
        ("register_loop_orders", registry.loop_orders, AdmissionPolicy),
        ("register_policy_wrappers", registry.wrappers, AdmissionPolicy),
        ("register_length_predictors", registry.predictors, LengthPredictor),
        ("register_routers", registry.routers, Router),
        ("register_kv_tier_policies", registry.kv_tier_policies, KVTierPolicy),
    )
    found: list[tuple[dict[str, Entry], Any, str, type]] = []
    failed: set[str] = set()
    for hook_name, table, kind in hooks:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
            try:
                found += [(table, cls, plugin, kind) for cls in impl.function() or []]
            except Exception as err:  # noqa: BLE001 - any failure of third-party code
                failed.add(plugin)
                warn(f"skipped plugin {plugin!r}: its {hook_name} hook raised {_describe(err)}")
    for table, cls, plugin, kind in found:
        if plugin not in failed:
            _add(table, cls, plugin, kind)
    return registry


def _add(table: dict[str, Entry], cls: Any, plugin: str, kind: type) -> None:
    name = getattr(cls, "name", "")
    if not (isinstance(cls, type) and issubclass(cls, kind)) or not name:
        raise ValueError(f"plugin {plugin} registered {cls!r}: not a {kind.__name__} with a name")
    if issubclass(cls, AdmissionPolicy):
        try:
            check_guarantees(cls)
        except ValueError as err:
            raise ValueError(f"plugin {plugin} registered {name!r}: {err}") from None
    if name in table:
        other = table[name].plugin
        raise ValueError(f"plugins {other} and {plugin} both register {name!r}")
    table[name] = Entry(cls, plugin)
