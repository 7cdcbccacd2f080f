"""Batched decoding: several requests stepping together.

step.py       ``step``: one batched round, every sequence's rows through the layers together (ragged: each
              over its own cache), then each verifies and commits on its own (``selfspec.round``)
scheduler.py  ``Scheduler``: continuous batching (requests join and leave between steps), one ``step`` per
              step: EXSPEC with no realignment at all; ``decode_batch`` for a list of prompts
The padded layout that realigns after every verification (EQSPEC) is the measured comparison in
``selfspec.bench.eqspec``. See docs/BATCHING.md.
"""
