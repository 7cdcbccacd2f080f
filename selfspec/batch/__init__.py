"""Batched decoding: several requests stepping together.

scheduler.py  ``Scheduler``: continuous batching (requests join and leave between steps) over the
              engine's ragged step (``Engine.step_batch``): EXSPEC with no realignment at all
padded.py     ``PaddedBatch``: EQSPEC, the padded layout that realigns after every verification (the
              measured comparison, docs/BENCHMARKS.md)
See docs/BATCHING.md.
"""
