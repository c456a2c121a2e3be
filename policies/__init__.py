"""Built-in policy plugins (registered exactly like third-party ones).

- ``admission``: ``fifo``, ``budget``, ``pack`` (seeds 027, 031, 033).
- ``orderings``: ``prefill-first``, ``decode-first`` (seed 032).
- ``wrappers``: ``force-fifo`` (seed 033's fairness fallback).
"""
