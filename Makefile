# Entry points for users. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TOOLS       := .tools/bin
KUBECONFORM_VERSION := v0.7.0
KUBECONFORM := $(TOOLS)/kubeconform
# CRDs for offline validation: the shared test data when it is there, else the cache `make crds` fills.
CRDS_DIR    ?= $(if $(wildcard ../shared/crds/README.md),../shared/crds,.cache/crds)
RUN_DIR     ?= runs/local
GROUPS      ?= 3
SPEEDUP     ?= 20
# The stack's simulated KV capacity follows the load-test workload `make compare` will send:
# `demo` is the article's workload / 6, so its simulators get KV / 6 (as `make demo` does).
KV_SCALE    ?= $(if $(filter demo,$(WORKLOAD)),6,1)

export PYTHONPATH := $(CURDIR):$(CURDIR)/picker/src

.PHONY: help setup tools lock crds validate test demo up down loadtest compare bench bench-picker

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp: requirements.txt picker/pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e picker
	touch $@

setup: $(VENV)/.stamp tools ## build the virtualenv and the pinned tools into the working tree

$(KUBECONFORM):
	mkdir -p $(TOOLS)
	GOBIN=$(CURDIR)/$(TOOLS) GOFLAGS=-mod=mod go install github.com/yannh/kubeconform/cmd/kubeconform@$(KUBECONFORM_VERSION)

# Envoy Gateway and egctl (its offline translator), pinned in one place: local/dataplane.py.
# A cold build takes several minutes; Go's module and build caches live outside the repo.
EG_VERSION  := $(shell sed -n 's/^EG_VERSION = "\(.*\)"/\1/p' local/dataplane.py)
ENVOY_GATEWAY := $(TOOLS)/envoy-gateway
EGCTL       := $(TOOLS)/egctl

$(ENVOY_GATEWAY) $(EGCTL) &: local/dataplane.py
	mkdir -p $(TOOLS)
	GOBIN=$(CURDIR)/$(TOOLS) GOFLAGS=-mod=mod go install github.com/envoyproxy/gateway/cmd/envoy-gateway@$(EG_VERSION) \
		github.com/envoyproxy/gateway/cmd/egctl@$(EG_VERSION)
	touch $(ENVOY_GATEWAY) $(EGCTL)

tools: $(KUBECONFORM) $(ENVOY_GATEWAY) $(EGCTL) $(TOOLS)/picker-loadclient ## build the pinned tools into .tools/bin: kubeconform, Envoy Gateway + egctl, the picker benchmark's load client

lock: ## re-resolve requirements.in into the pinned requirements.txt
	rm -rf .cache/lock-venv && $(PYTHON_BOOT) -m venv .cache/lock-venv
	.cache/lock-venv/bin/pip install --quiet -r requirements.in
	{ sed -n '1,2p' requirements.txt; .cache/lock-venv/bin/pip freeze; } > requirements.txt.new && mv requirements.txt.new requirements.txt

crds: $(VENV)/.stamp ## download the pinned upstream CRDs into .cache/crds (for CRDS_DIR when ../shared/crds is absent)
	$(PY) -m validation.crds --dest .cache/crds

validate: setup ## render every overlay and Argo CD app path; schemas + CRDs (defaults, CEL), kubeconform, workflows; policy suite
	@test -d $(CRDS_DIR) || $(MAKE) --no-print-directory crds
	$(PY) -m validation --crds-dir $(CRDS_DIR) --kubeconform $(KUBECONFORM)
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q tests/policy

test: setup ## make validate, then every test suite: unit, protocol, lab smoke, end-to-end on the local stack
	$(MAKE) --no-print-directory validate
	$(PY) -m pytest -q picker/tests local/tests lab/tests loadtest/tests bench/tests tests/e2e

up: setup ## start the local stack in the background (simulators, picker, Envoy Gateway + Envoy on 18080/18081); `make down` stops it
	$(PY) -m local.stack up --name $(notdir $(RUN_DIR)) --groups $(GROUPS) --speedup $(SPEEDUP) --kv-scale $(KV_SCALE)

down: ## stop the local stack started by `make up`
	@if [ -x $(PY) ]; then $(PY) -m local.stack down --name $(notdir $(RUN_DIR)); fi

DEMO_ARGS ?=
demo: setup ## start the stack, compare listener http vs llm-gw on the article workload scaled / 6 (speedup 5), print the table, stop it
	$(PY) -m local.stack demo --name demo --groups $(GROUPS) $(DEMO_ARGS)

# Load tests (loadtest/): LT_HOST is the Gateway address (local stack by default, or a cluster's).
# LT_PORTS: listeners `http` and `llm-gw`; the local stack runs them at the cluster ports + 10000
# (local/dataplane.py LISTENER_PORT_OFFSET); against a cluster use LT_PORTS="8080 8081".
LT_HOST      ?= 127.0.0.1
LT_PORTS     ?= $(if $(filter 127.0.0.1 localhost,$(LT_HOST)),18080 18081,8080 8081)
WORKLOAD     ?= demo
SEED         ?= 0
USERS        ?= 18
COMPARE_ARGS ?=

loadtest: setup ## locust web UI on http://127.0.0.1:8089 driving both listeners of LT_HOST (`make up` first, or LT_HOST=<gateway IP>)
	$(VENV)/bin/locust -f loadtest/locustfile.py --host http://$(LT_HOST) --ports "$(LT_PORTS)" \
		--workload $(WORKLOAD) --seed $(SEED) -u $(USERS) -r $(USERS) --web-host 127.0.0.1

compare: setup ## headless: same workload on both listeners (LT_PORTS) -> results/compare-<time>/ (report.md, JSONs, PNGs); COMPARE_ARGS=...
	$(PY) -m loadtest compare --host $(LT_HOST) --ports $(LT_PORTS) --workload $(WORKLOAD) --seed $(SEED) \
		--out results/compare-$$(date +%Y%m%d-%H%M%S) $(COMPARE_ARGS)

bench: setup ## every benchmark (validation, picker, lab, HTTP vs lab crosscheck, make demo; 20-30 min) -> BENCHMARKS.md
	$(PY) -m bench

bench-picker: setup $(TOOLS)/picker-loadclient ## benchmark the picker (~11 min): decisions/s and latency (3/16/64 endpoints, gRPC), scrape CPU
	mkdir -p results && $(PY) -m picker.bench --json results/bench-picker.json

# The benchmark's load generator (Go: it must not eat the server's CPU); go.sum pins its modules.
$(TOOLS)/picker-loadclient: picker/bench/loadclient/main.go picker/bench/loadclient/go.mod picker/bench/loadclient/go.sum
	mkdir -p $(TOOLS) && cd picker/bench/loadclient && go build -o $(CURDIR)/$(TOOLS)/picker-loadclient .

# Routing lab (lab/): virtual time, 3 simulated A10 groups; results/lab-<workload>/summary.{json,md} + PNGs.
LAB_SEEDS    ?= 0 1 2 3 4
LAB_POLICIES ?= --policy least-request --policy picker --policy picker-upstream
LAB_OUT      ?= results
.PHONY: lab
lab: setup ## routing lab: article + shared-prefix workloads, least request vs picker default vs upstream-default, 5 seeds, plots -> results/lab-<workload>/
	for w in article shared-prefix; do \
		$(PY) -m lab run --workload $$w $(LAB_POLICIES) --seeds $(LAB_SEEDS) --out $(LAB_OUT)/lab-$$w --plots || exit 1; \
	done
