"""Our Serve request routers built with Ray Serve's own constructor (no Ray started: it only sets up
state and metric objects), then given their policy as Serve does, by ``initialize_state``."""

from __future__ import annotations

from ray.serve._private.common import DeploymentHandleSource, DeploymentID


def serve_router(cls, **state):
    """``cls`` as Serve builds it for a handle (Serve's own queue-length cache off, its default), then
    ``initialize_state(**state)``."""
    router = cls(DeploymentID(name="Deployment", app_name="rendezvous"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**state)
    return router
