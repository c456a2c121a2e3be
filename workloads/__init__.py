"""roseinfer.workloads: the requests a run replays (trace files and generators).

- :mod:`~roseinfer.workloads.traces`: Azure 2023 CSV, Mooncake JSONL and plain
  CSV/JSONL loaders with ``file:line`` errors, and the embedded default trace.
- :mod:`~roseinfer.workloads.catalog`: named public traces (``azure-conv-2023``,
  ``mooncake-conversation``, ...) with source URL, licence and SHA-256, fetched
  and cached on first use wherever a trace path is accepted.
- :mod:`~roseinfer.workloads.arrivals`: slicing and vLLM-bench arrival re-drawing.
- :mod:`~roseinfer.workloads.synthetic`: the seed posts' synthetic request mixes.
- :mod:`~roseinfer.workloads.groups`: Poisson groups with tenant, priority and deadline.
- :mod:`~roseinfer.workloads.fit`: lengths fitted to a model's context (``--fit-lengths``)
  and made-up token ids for length-only traces.

Every function returns ``list[Request]`` sorted by arrival, the first at 0 s.
"""

from roseinfer.workloads.arrivals import rescale_arrivals, select, time_scale
from roseinfer.workloads.catalog import CATALOGUE, PublicTrace, cache_dir, fetch_trace
from roseinfer.workloads.errors import WorkloadError
from roseinfer.workloads.fit import FIT_MODES, fit_lengths, with_token_ids
from roseinfer.workloads.groups import GroupSpec, groups, two_tenant
from roseinfer.workloads.synthetic import (
    GPT2_VOCAB_SIZE,
    SEED_WORKLOADS,
    SeedWorkload,
    SyntheticSpec,
    generate,
    seed_workload,
    synthetic,
)
from roseinfer.workloads.traces import (
    DEFAULT_TRACE_NAME,
    KNOWN_FORMATS,
    detect_format,
    load_default_trace,
    load_trace,
    resolve_trace,
)

__all__ = [
    "CATALOGUE",
    "PublicTrace",
    "cache_dir",
    "fetch_trace",
    "resolve_trace",
    "DEFAULT_TRACE_NAME",
    "FIT_MODES",
    "GPT2_VOCAB_SIZE",
    "GroupSpec",
    "KNOWN_FORMATS",
    "SEED_WORKLOADS",
    "SeedWorkload",
    "SyntheticSpec",
    "WorkloadError",
    "fit_lengths",
    "with_token_ids",
    "detect_format",
    "generate",
    "groups",
    "load_default_trace",
    "load_trace",
    "rescale_arrivals",
    "seed_workload",
    "select",
    "synthetic",
    "time_scale",
    "two_tenant",
]
