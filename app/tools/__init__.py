"""Commands a user runs, not part of the served app: ``python -m app.tools.run CONFIG`` (``make serve``),
``python -m app.tools.procs [--kill]`` (a run's processes), ``python -m app.tools.cluster up|down`` (a
three-node cluster on this machine, planned by ``cluster_plan``; ``cluster_redis`` is its GCS fault tolerance's
Redis), ``python -m app.tools.drill head|gcs`` (a
head or GCS restart under traffic, on that cluster with GCS fault tolerance) and the ports check before a start
(``preflight``); ``metrics_text`` reads some metrics' lines of a Prometheus endpoint (the drill, bench and tests).

Tools import the app; nothing in the served app imports ``tools/`` (the benchmarks and tests do).
"""
