"""The test and bench rig: a llama-server built from source, the models from PyPI wheels
(``proxy.engine.models``), and the real redis-server, chromium and proxy replicas the end-to-end
tests start. Test-only: it is not in the wheel, and product code never imports it.

Nothing here runs at import time. Builds and models are cached outside the repo
(``$PREFIXPIN_CACHE`` or ``~/.cache/prefixpin``) and reused; ``python -m tests.rig
prepare`` makes every part ahead of a test run (``tests.rig.parts``: what a missing one
does).
"""
