"""roseinfer.experiments: studies built on the simulator (and, for fidelity, the executor).

``sweep`` (policies x request rates x knobs into one DataFrame, serially or on
Ray), ``capacity`` (the highest rate meeting SLOs), ``fidelity`` (rose-sim vs a
real run on the same requests). Their commands, ``rose-sim sweep`` and
``rose-sim capacity``, are ``roseinfer.cli.sweep`` and ``roseinfer.cli.capacity``.
"""
