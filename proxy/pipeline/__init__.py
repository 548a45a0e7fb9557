"""The pipeline: the router, the plan, the generation every client of a request reads, the
relay to each client, and joining retries."""
