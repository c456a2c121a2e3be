"""Token sampling from last-token logits: greedy, temperature, top-k, top-p.

Rows are filtered together (one sort for the whole batch); the random draw is
made per generator, so a request with its own seeded ``torch.Generator`` gets
the same tokens whatever else shares its batch. Rows without a seed share the
engine-wide generator (seeded by ``--seed``), drawn in batch order.

Filtering follows vLLM's sampler: temperature, then top-k, then top-p on the
renormalised top-k distribution, keeping the smallest set of most likely tokens
whose probability mass reaches ``top_p`` (always at least one token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roseinfer.request import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row.

    Args:
        logits: ``[B, vocab]`` (any float dtype; computed in float32).
        params: one :class:`SamplingParams` per row; greedy rows (temperature 0
            or ``top_k == 1``) take the argmax and draw no random number.
        generators: one per row, on the logits' device: a request's own seeded
            generator, or the engine-wide one (None uses torch's default).

    Returns:
        ``B`` token ids (one host sync).

    Raises:
        ValueError: if the three lengths differ.
    """
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} logits rows, {len(params)} params, {len(generators)} generators"
        )
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        probs = filtered_probs(
            logits.index_select(0, rows).float(), [params[i] for i in random_rows]
        )
        drawn = _draw(probs, [generators[i] for i in random_rows])
        tokens = tokens.index_copy(0, rows, drawn)
    return tokens.tolist()


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p applied to ``[B, vocab]`` float32 logits.

    Returns:
        probabilities ``[B, vocab]``, zero outside each row's kept set.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    # Mass of the strictly more likely tokens; the top token always has 0, so it stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top_p 1 = off, exactly
    sorted_probs = sorted_probs.masked_fill(cut, 0.0)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One ``torch.multinomial`` per distinct generator (rows in batch order).

    Returns:
        ``[B]`` int64 token ids.
    """
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    groups: dict[int, list[int]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), []).append(row)
    for rows in groups.values():
        gen = generators[rows[0]]
        idx = torch.tensor(rows, dtype=torch.long, device=probs.device)
        drawn = torch.multinomial(probs.index_select(0, idx), 1, generator=gen)
        out.index_copy_(0, idx, drawn[:, 0])
    return out
