"""The app's configuration: the typed ``args`` of a config file (``args``) and the two ``LLMConfig`` dicts
built from them (``llm_configs``).

Pure: imports neither Ray, vLLM nor torch, directly or through the repository. From ``app`` it imports only
``config/`` and ``routing/`` (the routing policies it validates); ``connector/``'s pure modules give it the
transfer settings.
"""
