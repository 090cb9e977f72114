"""1 prefill + 1 decode in push mode (configs/local-cpu.yaml, the README's default), started once for the whole
package with ``make serve`` as the README says (``conftest.py``: a package-scoped app). Its modules run in name
order on that one app: answers, conversations, faults, then observability (which needs all their traffic, and
replaces the decode replica last). Its end checks that Ctrl-C of ``make serve`` ended every process it started,
vLLM engines included, and freed every port."""

CONFIG = "configs/local-cpu.yaml"
MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
