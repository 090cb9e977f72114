"""Kubernetes deployment: render ``k8s/`` with a ``configs/*.yaml`` file and check that they fit.

``render`` builds the kustomize tree and injects the serve config as the RayService's
``serveConfigV2``; ``checks`` compares the two (accelerators, placement, ports). Neither imports
Ray or vLLM.
"""
