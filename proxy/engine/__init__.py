"""Engines: each engine kind, the lane that runs one, what is known of it, and the watch on it."""
