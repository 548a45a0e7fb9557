"""State shared by several proxy replicas, in Redis (``--redis URL``).

    core       the connection, key names, this replica's heartbeat and who else is alive
    sessions   the session table: committed histories, read before planning, written at commit
    slots      per backend, which session each slot holds; a lease is a Redis lock with a TTL
    homes      per session identity, the backend it lives on (rendezvous placement's memory)
    inflight   the in-flight registry: a retry on another replica joins the running
               generation through a Redis stream of its frames
    park_index the park index (``proxy.parking``), JSON records: a session one replica
               parked is restored by another

Without ``--redis`` none of this is imported: the single-process stores stay the default and
the core install does not need the ``redis`` package.
"""
