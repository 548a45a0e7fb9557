"""The replay benchmark: synthetic agent transcripts, rewriting clients and the harness.

Nothing here runs at import time; the entry points are ``bench/make_transcripts.py`` and
``bench/replay.py``.
"""
