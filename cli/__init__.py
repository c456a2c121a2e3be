"""The command-line wing: one module per command over shared flag modules.

Commands: :mod:`~roseinfer.cli.sim` (``rose-sim``), :mod:`~roseinfer.cli.sweep`
(``rose-sim sweep``), :mod:`~roseinfer.cli.capacity` (``rose-sim capacity``),
:mod:`~roseinfer.cli.run` (``rose-run``), :mod:`~roseinfer.cli.profile`
(``rose-run profile``) and :mod:`~roseinfer.cli.serve` (``rose-serve``); a
cluster run of ``rose-sim`` is :mod:`~roseinfer.cli.cluster`. Shared:
:mod:`~roseinfer.cli.flags` (value types, the flags two commands take, the error
contract), :mod:`~roseinfer.cli.groups` (a run's flag groups),
:mod:`~roseinfer.cli.config` (flags to a scheduler config),
:mod:`~roseinfer.cli.workload` (flags to requests), :mod:`~roseinfer.cli.report`
(the summary) and :mod:`~roseinfer.cli.executor_flags` (the model flags).

The commands call the library (``roseinfer.simulator.setup``,
``roseinfer.executor.builder``, ``roseinfer.policy_args``, ...); nothing outside
this package imports it.
"""
