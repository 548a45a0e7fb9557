"""Fuzzing of the compiled relay (``core/_relay.c``): ``python -m tests.fuzz.relay_fuzz``
drives its socket loop and its scanner with seeded cases, checked against the reference
parser here (``tests.fuzz.reference``); ``tests/unit/test_relay_sanitizers.py`` runs it
under AddressSanitizer and UndefinedBehaviorSanitizer."""
