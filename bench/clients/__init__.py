"""Replay clients, one module per way real agents rewrite (or stress) their history."""

from bench.clients.base import Client, Request

__all__ = ["Client", "Request"]
