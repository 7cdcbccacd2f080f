"""SpecEE: speculative early exiting (docs/SPECEE.md). The target stops at an intermediate layer for a token
when a tiny per-layer predictor, fed only the logits of a few speculative candidate tokens, says the
answer is already known.

    candidates.py   candidate tokens' logits from their LM-head rows, and the predictor's features
    predictors.py   the per-layer MLPs (saved beside a head), their offline layer set
    schedule.py     online scheduling: check only layers near the exit layers of recent tokens
    ragged.py       one token's pass when earlier tokens skipped layers (their KV is filled on the way)
    decode.py       the two modes: ``specee`` (lossy, as published) and ``specee-verified`` (lossless)
"""
