"""Sessions: which session a request names, its history and repairs, the bytes that decide
affinity, and the slot it runs in."""
