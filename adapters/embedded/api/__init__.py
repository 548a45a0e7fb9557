"""llama-server's HTTP surface over the embedded engine: its routes, bodies, reports and the
seam they read the engine through."""
