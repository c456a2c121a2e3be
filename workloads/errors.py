"""The workload error type (bad trace rows, bad generator arguments)."""

from __future__ import annotations


class WorkloadError(ValueError):
    """Bad workload input; the message names ``file:line``, the field and the fix."""
