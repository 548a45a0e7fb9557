"""prefixpin: a reverse proxy that keeps LLM prompt caches warm for long agent sessions.

The project's folders ``proxy/``, ``adapters/``, ``core/`` and ``fingerprint/`` live at the
repository root and install under this one import name (``prefixpin.proxy``, ...) through
the build's package mapping (pyproject.toml). In a checkout this file is found first (the
root is on ``sys.path`` when tests or ``python -m`` run from it), so it adds the root to
the package's path: ``prefixpin.proxy`` is then the root's ``proxy/``, as installed.
"""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "proxy" / "__init__.py").is_file():
    __path__.append(str(_ROOT))
