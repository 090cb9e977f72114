"""KV-transfer plumbing.

Pure modules (``params``, ``ports``, ``engine_env``) import neither Ray nor vLLM.
``ray_backend`` is the Ray-side connector backend; vLLM-side connector code must never
import Ray or ``app``.
"""
