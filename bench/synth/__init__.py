"""Deterministic text synthesis for the bench transcripts (pure functions of a ``Random``)."""
