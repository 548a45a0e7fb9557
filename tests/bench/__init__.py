"""Tests of the replay bench (bench/): clients, checks, clock, report; no server."""
