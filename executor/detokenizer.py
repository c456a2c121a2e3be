"""Incremental detokenization for streams.

Decoding token by token breaks words made of several tokens and multi-byte
characters split across tokens. As vLLM's ``detokenize_incrementally`` does,
keep a short window of earlier tokens, decode the window with and without
the new tokens, and emit only the new suffix once it no longer ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
_WINDOW_TOKENS = 6  # earlier tokens decoded for context (vLLM uses a similar offset)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        prompt_ids: the prompt, whose last tokens give context to the first piece.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _WINDOW_TOKENS, 0)
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append a token and return the new text it completes ("" if none yet)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end of the stream."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
