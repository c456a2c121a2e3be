"""Prefill/decode disaggregation: a request's two stages and the KV handoff between them.

In a disaggregated cluster (DistServe, OSDI'24; Splitwise, ISCA'24; vLLM's
disaggregated prefill) a request is served in two stages on two replicas:

1. **prefill**: a ``prefill`` replica computes the prompt's KV and samples the
   first output token (:func:`prefill_stage`: the request with one output token);
2. **handoff**: the KV of the prompt moves to a ``decode`` replica over a link
   (:class:`KVTransfer`);
3. **decode**: the request joins that replica's waiting queue when its KV has
   arrived (:func:`decode_stage`: prompt + first token, of which the prompt's KV
   is there already; the rest of the output).

This module holds the rules of the split; the cluster's event loop
(``roseinfer.simulator.cluster``) runs it, and :func:`merge_stages` joins each
request's two record rows into one, so the metrics read a disaggregated run as
they read any other.

Simplifications, each an upper or lower bound on a real system: the prefill
replica frees the request's blocks when its prefill ends (a real one holds them
until the decode side has pulled them); the transfer starts after the prefill
(no layer-by-layer streaming, as Mooncake and DistServe overlap); transfers from
one replica, and into one replica, go one at a time at the link's bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from roseinfer.calibration.specs import LinkSpec
from roseinfer.request import Request

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd


def prefill_stage(request: Request) -> Request:
    """What the prefill replica serves: the prompt, sampling the first output token."""
    return replace(request, max_output_tokens=1)


def decode_stage(request: Request, ready_s: float) -> Request:
    """What the decode replica serves, arriving at ``ready_s`` (s) when the KV has moved.

    Its prompt is the original prompt plus the first output token, whose KV the
    decode replica computes in its first step (sampling the second token); the
    prompt's KV arrived (``num_transferred_tokens``). The first token's id is
    not known to the simulator, so with token ids a placeholder (0) stands in;
    it only lengthens the prompt, and it is not a full block of a shared prefix.

    Raises:
        ValueError: if ``request`` has fewer than two output tokens (nothing to decode).
    """
    if request.max_output_tokens < 2:
        raise ValueError(f"request {request.request_id}: nothing to decode after its prefill")
    ids = request.prompt_token_ids
    return replace(
        request,
        arrival_time_s=ready_s,
        num_prompt_tokens=request.num_prompt_tokens + 1,
        max_output_tokens=request.max_output_tokens - 1,
        prompt_token_ids=None if ids is None else (*ids, 0),
        deadline_s=None,  # the TTFT deadline belongs to the prefill stage
        num_transferred_tokens=request.num_prompt_tokens,
    )


@dataclass(slots=True)
class Handoff:
    """One request's move from its prefill replica to its decode replica.

    Attributes:
        request_id: the request.
        prefill_replica: index of the replica that prefilled it.
        decode_replica: index of the replica that decodes it.
        prefill_end_s: when its prefill step ended (s).
        start_s: when its transfer began (s; later than ``prefill_end_s`` when a
            link was busy with other transfers).
        ready_s: when its KV had arrived (s): it joins the decode queue then.
        num_tokens: tokens whose KV moved (the prompt minus what the decode
            replica's prefix cache held).
        num_bytes: bytes moved.
    """

    request_id: str
    prefill_replica: int
    decode_replica: int
    prefill_end_s: float
    start_s: float
    ready_s: float
    num_tokens: int
    num_bytes: float


class KVTransfer:
    """Prices KV handoffs: bytes over a link, one transfer at a time per sender and
    per receiver.

    A transfer of ``B`` bytes between replicas of ``g_p`` and ``g_d`` GPUs takes
    ``latency + B / (bandwidth x min(g_p, g_d))`` s: each GPU holds its shard of
    every layer's KV (tensor parallelism) and sends it over its own NIC, as a
    DGX node has one NIC per GPU. A transfer starts when its prefill ended and
    both the sender's and the receiver's links are free.

    Args:
        link: the link (``roseinfer.calibration.specs.LINKS``).
        num_replicas: replicas in the cluster (indices 0..N-1).

    Raises:
        ValueError: on fewer than one replica.
    """

    def __init__(self, link: LinkSpec, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError("a KV transfer needs at least one replica")
        self.link = link
        self._send_free_s = [0.0] * num_replicas
        self._recv_free_s = [0.0] * num_replicas

    def duration_s(self, num_bytes: float, num_gpus: int) -> float:
        """Seconds to move ``num_bytes`` spread over ``num_gpus`` parallel links."""
        return self.link.latency_s + num_bytes / (self.link.bandwidth * max(1, num_gpus))

    def schedule(
        self, src: int, dst: int, prefill_end_s: float, num_bytes: float, num_gpus: int
    ) -> tuple[float, float]:
        """Book the transfer of ``num_bytes`` from replica ``src`` to ``dst``.

        Returns:
            ``(start_s, ready_s)``: when it begins and when the KV has arrived.
        """
        start = max(prefill_end_s, self._send_free_s[src], self._recv_free_s[dst])
        ready = start + self.duration_s(num_bytes, num_gpus)
        self._send_free_s[src] = self._recv_free_s[dst] = ready
        return start, ready


_SUM_COLUMNS = ("num_output_tokens", "num_preemptions")
_DECODE_COLUMNS = ("status", "reject_reason", "finish_s", "stop_reason")


def merge_stages(stages: pd.DataFrame, handoffs: list[Handoff]) -> pd.DataFrame:
    """One record row per request from the rows of its two stages.

    Args:
        stages: every replica's rows (``roseinfer.metrics.schema`` plus
            ``replica`` and ``stage``, ``prefill`` or ``decode``); a request has
            one prefill row, and a decode row when it was handed off.
        handoffs: one per decode row.

    Returns:
        The prefill rows, each completed by its decode row: status, finish time
        and stop reason from the decode stage, output tokens and preemptions
        summed, token times joined, ``replica`` the decode replica, plus
        ``prefill_replica`` and ``kv_transfer_s`` (prefill end to KV arrival,
        NaN when nothing moved). The arrival, admission, first token and prefix
        hit are the prefill stage's.

    Raises:
        ValueError: if a decode row has no prefill row or no handoff.
    """
    is_decode = (stages["stage"] == "decode").to_numpy()
    pre = stages[~is_decode].set_index("request_id", drop=False)
    dec = stages[is_decode].set_index("request_id")
    if not dec.index.isin(pre.index).all() or len(handoffs) != len(dec):
        raise ValueError("a decode stage without its prefill stage or handoff (a cluster bug)")
    merged = pre.copy()
    merged["prefill_replica"] = merged["replica"]
    merged["kv_transfer_s"] = np.nan
    if len(dec):
        ids = dec.index
        for col in _DECODE_COLUMNS:
            merged.loc[ids, col] = dec[col].to_numpy()
        for col in _SUM_COLUMNS:
            merged.loc[ids, col] = merged.loc[ids, col].to_numpy() + dec[col].to_numpy()
        merged.loc[ids, "replica"] = dec["replica"].to_numpy()
        moved = pd.Series({h.request_id: h.ready_s - h.prefill_end_s for h in handoffs})
        merged.loc[ids, "kv_transfer_s"] = moved.reindex(ids).to_numpy()
        if merged["token_times_s"].notna().any():
            times = merged.loc[ids, "token_times_s"].to_numpy()
            joined = [np.concatenate([a, b]) for a, b in zip(times, dec["token_times_s"])]
            merged.loc[ids, "token_times_s"] = pd.Series(joined, index=ids, dtype=object)
    return merged.drop(columns="stage").reset_index(drop=True)


def handoff_gaps_s(stages: pd.DataFrame) -> np.ndarray:
    """The inter-token gap that spans each handoff: the decode stage's first token
    time minus the prefill stage's (s), for finished decode stages. A decode
    replica's ITL histogram lacks these gaps; the cluster's adds them."""
    pre = stages[stages["stage"] == "prefill"].set_index("request_id")["first_token_s"]
    dec = stages[(stages["stage"] == "decode") & (stages["status"] == "finished")]
    dec = dec.set_index("request_id")["first_token_s"]
    return (dec - pre.reindex(dec.index)).to_numpy(dtype=float)


def stage_report(
    stages: pd.DataFrame, handoffs: list[Handoff], link: LinkSpec
) -> dict[str, float | str | int]:
    """Per-stage queueing and the handoffs' transfer times, in ms.

    Keys: ``kv_transfer_link``; ``num_kv_transfers``; ``kv_transfer_gb`` (total);
    ``mean_kv_transfer_ms`` / ``p99_kv_transfer_ms`` (prefill end to KV arrival,
    link queueing included) and ``mean_kv_transfer_wait_ms`` (of which waiting
    for a busy link); ``mean_prefill_queue_ms`` / ``p99_prefill_queue_ms``
    (arrival to prefill admission) and the same for ``decode`` (KV arrival to
    decode admission).
    """
    out: dict[str, float | str | int] = {
        "kv_transfer_link": link.name,
        "num_kv_transfers": len(handoffs),
        "kv_transfer_gb": sum(h.num_bytes for h in handoffs) / 1e9,
    }
    moved = np.array([h.ready_s - h.prefill_end_s for h in handoffs])
    wait = np.array([h.start_s - h.prefill_end_s for h in handoffs])
    for name, values in (("kv_transfer", moved), ("kv_transfer_wait", wait)):
        out[f"mean_{name}_ms"] = 1e3 * float(values.mean()) if len(values) else 0.0
    out["p99_kv_transfer_ms"] = 1e3 * float(np.percentile(moved, 99)) if len(moved) else 0.0
    for stage in ("prefill", "decode"):
        rows = stages[(stages["stage"] == stage) & (stages["status"] == "finished")]
        queue = (rows["admitted_s"] - rows["arrival_s"]).to_numpy(dtype=float)
        out[f"mean_{stage}_queue_ms"] = 1e3 * float(queue.mean()) if len(queue) else 0.0
        out[f"p99_{stage}_queue_ms"] = 1e3 * float(np.percentile(queue, 99)) if len(queue) else 0.0
    return out
