"""llama.cpp's own server tests as an independent client of prefixpin: ``run.py`` runs them
directly against llama-server and through prefixpin, and compares the outcomes per test;
``plugin.py`` is the pytest plugin it loads into that suite."""
