"""prefixpin: a reverse proxy that keeps LLM prompt caches warm for long agent sessions.

The project's folders ``proxy/``, ``adapters/``, ``core/`` and ``fingerprint/`` live at the
repository root and install under this one import name (``prefixpin.proxy``, ...), so that
nothing generic lands in site-packages. In a checkout they are reached through the links
beside this file.
"""
