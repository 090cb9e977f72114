"""What the decode and the prefill replicas share: a prompt's token ids as a replica renders them
(``prompts``), the warm-up generations before a replica takes traffic (``warmup``) and Ray Serve LLM's node
initialization, skipped when there is nothing to download (``node_init``); a heartbeat gauge that tells how fresh
a replica's metrics are (``heartbeat``; the ingress has one too).

It imports no role (``ingress/``, ``decode/``, ``prefill/``) nor ``tools/``.
"""
