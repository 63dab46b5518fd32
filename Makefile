# Entry points for users. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TOOLS       := .tools/bin
KUBECONFORM_VERSION := v0.7.0
KUBECONFORM := $(TOOLS)/kubeconform
# The web UI test drives Debian's chromium with playwright (no browser download). Defined here,
# before the rules that list it as a prerequisite (make expands those when it reads them).
CHROMIUM    := /usr/bin/chromium
# CRDs for offline validation: the shared test data when it is there, else the cache `make crds` fills.
CRDS_DIR    ?= $(if $(wildcard ../shared/crds/README.md),../shared/crds,.cache/crds)
# CRDs that ship in pinned Go modules (the Prometheus Operator's, for components/monitoring).
EXTRA_CRDS_DIR := .cache/crds-extra
RUN_DIR     ?= runs/local
# ENGINE=vllm: real vLLM's CPU build serves the groups (`make vllm` builds it); 2 groups by
# default then (each server holds ~2-4 GB)
ENGINE      ?= sim
GROUPS      ?= $(if $(filter vllm,$(ENGINE)),2,3)
SPEEDUP     ?= 20
# PICKERS=2: the picker as base/picker runs it, active-passive on a Lease of a real API server
# (built by `make tools`), both replicas behind Envoy's health checks (docs/failover.md)
PICKERS     ?= 1
# The stack's simulated KV capacity follows the load-test workload `make compare` will send:
# `demo` is the article's workload / DEMO_SCALE (loadtest/workloads.py), so its simulators get
# KV / DEMO_SCALE (as `make demo` does).
KV_SCALE    ?= $(if $(filter demo,$(WORKLOAD)),$(shell sed -n 's/^DEMO_SCALE = //p' loadtest/workloads.py),1)
# on: the cluster's edge (API keys, rate limits) with throw-away keys; off: open listeners
EDGE_SECURITY ?= on
# Precise prefix routing on the local stack (the simulators' KV-cache events); PRECISE=off: the
# picker's approximate index only.
PRECISE     ?= on

export PYTHONPATH := $(CURDIR):$(CURDIR)/picker/src
# With APT_ALL=1 (`make test`), the targets that install a Debian package wait for debian-packages.
APT_FIRST   := $(if $(APT_ALL),| debian-packages)

.PHONY: help setup tools lock crds tiny-model vllm check validate test demo up observe down loadtest compare sweep bench bench-picker bench-picker-scale

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp: requirements.txt picker/pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e picker
	touch $@

# The picker's compiled ext_proc transport (Rust: picker/Cargo.toml, picker/native/), built in place
# next to the Python package so every checkout runs its own (crates from crates.io, Cargo.lock pins
# them; cold: see picker/README.md "Protocol"). One cargo target directory for every checkout.
CARGO_TARGET := $(CURDIR)/.cache/cargo-target
export CARGO_TARGET_DIR := $(CARGO_TARGET)
EXTPROC     := picker/src/picker/_extproc.abi3.so
$(EXTPROC): picker/Cargo.toml picker/Cargo.lock $(wildcard picker/native/*.rs)
	cd picker && cargo build --release --locked --features extension-module
	cp $(CARGO_TARGET)/release/lib_extproc.so $@

setup: $(VENV)/.stamp $(EXTPROC) tools promtool ## build the virtualenv, the picker's compiled transport and the pinned tools into the working tree

$(KUBECONFORM):
	mkdir -p $(TOOLS)
	GOBIN=$(CURDIR)/$(TOOLS) GOFLAGS=-mod=mod go install github.com/yannh/kubeconform/cmd/kubeconform@$(KUBECONFORM_VERSION)

# Envoy Gateway and egctl (its offline translator), the version the Argo CD app installs
# (validation/pins.py reads the same line; tests/policy/test_pins.py checks both agree).
# A cold build takes several minutes; Go's module and build caches live outside the repo.
EG_VERSION  := $(shell sed -n 's/^ *targetRevision: *//p' argocd/apps/envoy-gateway.yaml)
ENVOY_GATEWAY := $(TOOLS)/envoy-gateway
EGCTL       := $(TOOLS)/egctl

$(ENVOY_GATEWAY) $(EGCTL) &: argocd/apps/envoy-gateway.yaml
	mkdir -p $(TOOLS)
	GOBIN=$(CURDIR)/$(TOOLS) GOFLAGS=-mod=mod go install github.com/envoyproxy/gateway/cmd/envoy-gateway@$(EG_VERSION) \
		github.com/envoyproxy/gateway/cmd/egctl@$(EG_VERSION)
	touch $(ENVOY_GATEWAY) $(EGCTL)

# The Envoy rate limit service for the local stack's token budgets (local/ratelimit.py pins it;
# ~2 min cold on 2 cores, mostly module downloads). `go install` names the binary service_cmd.
RATELIMIT_VERSION := $(shell sed -n 's/^RATELIMIT_VERSION = "\(.*\)"/\1/p' local/ratelimit.py)
RATELIMIT := $(TOOLS)/ratelimit
$(RATELIMIT): local/ratelimit.py
	mkdir -p $(TOOLS) .cache/ratelimit-bin
	GOBIN=$(CURDIR)/.cache/ratelimit-bin GOFLAGS=-mod=mod nice -n 10 go install github.com/envoyproxy/ratelimit/src/service_cmd@$(RATELIMIT_VERSION)
	mv .cache/ratelimit-bin/service_cmd $@

tools: $(KUBECONFORM) $(ENVOY_GATEWAY) $(EGCTL) $(RATELIMIT) $(TOOLS)/picker-loadclient apiserver-tools redis-server ## build the pinned tools into .tools/bin: kubeconform, Envoy Gateway + egctl, the Envoy rate limit service, the picker benchmark's load client, kube-apiserver (+ etcd); Debian's redis-server

# A real API server for tests/apiserver: kube-apiserver v1.34.2 built from the Go module proxy by the
# wrapper module in tools/kube-apiserver (~5 min on 2 cores the first time), etcd from Debian.
KUBE_APISERVER := $(TOOLS)/kube-apiserver
KUBE_VERSION   := v1.34.2
KUBE_LDFLAGS   := $(foreach v,gitVersion=$(KUBE_VERSION) gitMajor=1 gitMinor=34 gitTreeState=clean,-X k8s.io/component-base/version.$(v))
# kube-controller-manager (its HPA controller, for tests/apiserver/test_hpa.py) from the same wrapper
# module, in the same `go build`: most packages are shared, and one build compiles each once (two
# builds side by side compiled them twice: 18 min cold, load average ~20 on 2 cores).
KUBE_CONTROLLER_MANAGER := $(TOOLS)/kube-controller-manager
$(KUBE_APISERVER) $(KUBE_CONTROLLER_MANAGER) &: tools/kube-apiserver/go.mod tools/kube-apiserver/go.sum
	mkdir -p $(TOOLS) && cd tools/kube-apiserver && \
		go build -ldflags "$(KUBE_LDFLAGS)" -o $(CURDIR)/$(TOOLS)/ k8s.io/kubernetes/cmd/kube-apiserver \
			k8s.io/kubernetes/cmd/kube-controller-manager
	touch $(KUBE_APISERVER) $(KUBE_CONTROLLER_MANAGER)

# KEDA's operator and metrics API server, v2.20.2 (the newest release Go 1.26 builds), by the wrapper
# module in tools/keda (it copies KEDA's `replace` directives). Cold: ~5 min each on 2 cores.
KEDA_VERSION  := v2.20.2
KEDA_OPERATOR := $(TOOLS)/keda-operator
KEDA_ADAPTER  := $(TOOLS)/keda-adapter
$(KEDA_OPERATOR) $(KEDA_ADAPTER) &: tools/keda/go.mod tools/keda/go.sum
	mkdir -p $(TOOLS) && cd tools/keda && \
		go build -ldflags "-X github.com/kedacore/keda/v2/version.Version=$(KEDA_VERSION)" -o $(CURDIR)/$(KEDA_OPERATOR) github.com/kedacore/keda/v2/cmd/operator && \
		go build -ldflags "-X github.com/kedacore/keda/v2/version.Version=$(KEDA_VERSION)" -o $(CURDIR)/$(KEDA_ADAPTER) github.com/kedacore/keda/v2/cmd/adapter

.PHONY: apiserver-tools etcd test-apiserver autoscaling-tools test-autoscaling
apiserver-tools: $(KUBE_APISERVER) $(KUBE_CONTROLLER_MANAGER) etcd

etcd: $(APT_FIRST)
	@command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq -o DPkg::Lock::Timeout=600 etcd-server; }

# KEDA's two binaries and Prometheus for tests/autoscaling (`make test-autoscaling`: Prometheus ->
# KEDA -> HPA -> LeaderWorkerSet -> simulated groups -> the picker). Not part of `make test`: the
# KEDA build takes ~17 min on a cold Go cache; tests/apiserver/test_hpa.py, in `make test`, runs
# the HPA controller.
autoscaling-tools: apiserver-tools $(KEDA_OPERATOR) $(KEDA_ADAPTER) promtool

test-autoscaling: setup autoscaling-tools ## the whole autoscaling chain on loopback with the real KEDA, HPA controller and Prometheus (~3 min; builds KEDA first)
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q -s tests/autoscaling

# The picker's replica tests start a real Redis on a free loopback port (Debian's package).
.PHONY: redis-server
redis-server: $(APT_FIRST)
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

# Prometheus and promtool from Debian (bookworm: 2.42.0+ds-5+deb12u1), installed when missing.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

# Every Debian package the tests use, missing ones in one apt-get run before the targets that need
# them when `make test` builds its prerequisites side by side (APT_ALL=1, APT_FIRST above): several
# apt-gets at once would fight over dpkg's lock. Run alone, each of those targets installs its own.
DEBIAN_PACKAGES := etcd-server redis-server prometheus
.PHONY: debian-packages
debian-packages:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	browser=$$(test -x $(CHROMIUM) || echo chromium); \
	if [ -n "$$missing$$browser" ]; then $(SUDO) apt-get update -qq && \
		{ [ -z "$$missing" ] || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
			--no-install-recommends $$missing >/dev/null; } && \
		{ [ -z "$$browser" ] || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
			chromium >/dev/null; }; fi
.PHONY: promtool
promtool: $(APT_FIRST)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

tiny-model: $(VENV)/.stamp ## build the tiny model's tokenizer (deterministic, offline) into .cache/tiny-model
	$(PY) -m local.tinymodel tokenizer --out .cache/tiny-model

# Real vLLM (its CPU build) in its own virtualenv, every package pinned and installed without
# resolution (local/vllm_server/requirements.txt says why), and the tiny model it serves.
VLLM_VENV   := .venv-vllm
VLLM_LOCK   := local/vllm_server/requirements.txt
TINY_MODEL  := .cache/tiny-model
TINY_LORA   := .cache/tiny-model-lora

$(VLLM_VENV)/.stamp: $(VLLM_LOCK)
	rm -rf $(VLLM_VENV) && $(PYTHON_BOOT) -m venv $(VLLM_VENV)
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -r $(VLLM_LOCK)
	touch $@

$(TINY_MODEL)/model.safetensors: $(VLLM_VENV)/.stamp local/tinymodel/model.py local/tinymodel/tokenizer.py \
		loadtest/prompts.py local/sim/tokens.py
	$(VLLM_VENV)/bin/python -m local.tinymodel model --out $(TINY_MODEL)
	touch $@

$(TINY_LORA)/adapter_model.safetensors: $(TINY_MODEL)/model.safetensors local/tinymodel/lora.py
	$(VLLM_VENV)/bin/python -m local.tinymodel lora --out $(TINY_LORA) --model $(TINY_MODEL)
	touch $@

vllm: $(VLLM_VENV)/.stamp $(TINY_MODEL)/model.safetensors $(TINY_LORA)/adapter_model.safetensors ## real vLLM 0.32 (CPU build, ~5 GB) in .venv-vllm, the tiny model it serves in .cache/tiny-model and its LoRA adapter in .cache/tiny-model-lora (cold: ~4-6 min)

lock: ## re-resolve requirements.in into the pinned requirements.txt
	rm -rf .cache/lock-venv && $(PYTHON_BOOT) -m venv .cache/lock-venv
	.cache/lock-venv/bin/pip install --quiet -r requirements.in
	{ sed -n '1,2p' requirements.txt; .cache/lock-venv/bin/pip freeze; } > requirements.txt.new && mv requirements.txt.new requirements.txt

crds: $(VENV)/.stamp $(EXTRA_CRDS_DIR) ## download the pinned upstream CRDs into .cache/crds (for CRDS_DIR when ../shared/crds is absent)
	$(PY) -m validation.crds --dest .cache/crds

$(EXTRA_CRDS_DIR): validation/crds.py | $(VENV)/.stamp
	$(PY) -m validation.crds --go-modules --dest $(EXTRA_CRDS_DIR)
	touch $@

validate: setup $(EXTRA_CRDS_DIR) ## render every overlay and Argo CD app path; schemas + CRDs (defaults, CEL), kubeconform, workflows, Envoy Gateway's translation, cross-object rules; alert rules, dashboards; policy suite
	@test -d $(CRDS_DIR) || $(MAKE) --no-print-directory crds
	@$(MAKE) --no-print-directory -j2 --output-sync=target validate-manifests validate-policy

# The inner loop, for a change before `make test`: lint, the manifests, and every component's unit
# tests, in two lanes side by side; no server process starts (tests marked `server`, `e2e` or
# `soak` are left to `make test`).
UNIT_TESTS_A := picker/tests tests/policy
UNIT_TESTS_B := local/tests lab/tests loadtest/tests bench/tests monitoring/tests tests/docs
UNIT_ONLY    := -m "not server and not e2e and not soak"
.PHONY: check-lint check-units-a check-units-b check-units-native
# What `make check` runs on: the virtualenv, the picker's compiled transport, kubeconform, Envoy
# Gateway's egctl (validation translates the gateway objects), promtool; not the servers' tools.
CHECK_NEEDS := $(VENV)/.stamp $(EXTPROC) $(KUBECONFORM) $(EGCTL) promtool
check: $(CHECK_NEEDS) $(EXTRA_CRDS_DIR) ## the inner loop (<2 min warm): lint (ruff), manifests validated, every component's unit tests; starts no server
	@test -d $(CRDS_DIR) || $(MAKE) --no-print-directory crds
	@$(MAKE) --no-print-directory -j2 --output-sync=target check-units-a check-lint validate-manifests check-units-native check-units-b

check-lint:
	$(PY) -m ruff check .

check-units-a:
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q $(UNIT_ONLY) $(UNIT_TESTS_A)

check-units-b:
	$(PY) -m pytest -q $(UNIT_ONLY) $(UNIT_TESTS_B)

check-units-native:
	cd picker && cargo test --release --locked --no-default-features

# The two halves of `make validate`, run side by side (each keeps its own schema cache).
.PHONY: validate-manifests validate-policy
validate-manifests:
	$(PY) -m validation --crds-dir $(CRDS_DIR) --extra-crds-dir $(EXTRA_CRDS_DIR) --kubeconform $(KUBECONFORM)
	$(PY) -m monitoring.rules check
	$(PY) -m monitoring.dashboards --check

validate-policy:
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q tests/policy

test: ## make validate, then every test suite: unit, protocol, lab smoke, conformance to real vLLM, end-to-end on the local stack, real API server and HPA controller
	@# what the suites need, built side by side (Go builds, pip installs and apt overlap on a fresh machine)
	@$(MAKE) --no-print-directory -j3 APT_ALL=1 setup vllm $(CHROMIUM)
	@$(MAKE) --no-print-directory -j2 --output-sync=line test-stack-lane test-lane

# `make test` in two lanes side by side. The stack lane holds every test that starts the local data
# plane (one per machine: Envoy Gateway binds fixed ports) or real vLLM; those mostly wait (on
# Envoy, engines, timeouts), while the other lane computes: validation, the unit suites, the
# gateway translations, the API server.
.PHONY: test-stack-lane test-lane
# Each lane runs all of its suites even after one fails, so that one run reports every failure;
# it fails if any did.
test-stack-lane:
	@status=0; \
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q tests/e2e tests/conformance || status=1; \
	$(PY) -m pytest -q monitoring/tests || status=1; \
	exit $$status

test-lane:
	@status=0; \
	$(MAKE) --no-print-directory validate || status=1; \
	(cd picker && cargo test --release --locked --no-default-features) || status=1; \
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q picker/tests local/tests lab/tests loadtest/tests bench/tests tests/docs \
		tests/translation tests/lifecycle || status=1; \
	$(MAKE) --no-print-directory test-apiserver || status=1; \
	exit $$status

test-apiserver: setup ## server-side dry-run of every target + the picker's discovery and RBAC + the HPA on a real kube-apiserver (~3 min)
	CRDS_DIR=$(CRDS_DIR) $(PY) -m pytest -q tests/apiserver

# What the local stack runs (a newcomer's first `make demo` builds only these): the virtualenv, the
# picker's compiled transport and Envoy Gateway; `--token-budget` needs `make tools` too, PICKERS=2
# the API server and etcd for the picker replicas' Lease.
STACK_NEEDS := $(VENV)/.stamp $(EXTPROC) $(ENVOY_GATEWAY)

up: $(STACK_NEEDS) $(if $(filter vllm,$(ENGINE)),vllm) $(if $(filter-out 1,$(PICKERS)),$(KUBE_APISERVER) etcd) ## start the local stack in the background (simulators, or real vLLM with ENGINE=vllm; picker, PICKERS=2 for active-passive replicas; Envoy Gateway + Envoy on 18080/18081); `make down` stops it
	$(PY) -m local.stack up --name $(notdir $(RUN_DIR)) --engine $(ENGINE) --groups $(GROUPS) --speedup $(SPEEDUP) \
		--pickers $(PICKERS) \
		--kv-scale $(KV_SCALE) $(if $(filter off,$(EDGE_SECURITY)),--no-edge-security) \
		$(if $(filter off,$(PRECISE)),--no-precise-prefix)

OBSERVE_PORT ?= 9095
observe: setup ## Prometheus on 127.0.0.1:$(OBSERVE_PORT) scraping the stack of `make up` with the cluster's monitors and alerts (Ctrl-C stops it)
	$(PY) -m monitoring.local_prometheus --name $(notdir $(RUN_DIR)) --port $(OBSERVE_PORT)

down: ## stop the local stack started by `make up`
	@if [ -x $(PY) ]; then $(PY) -m local.stack down --name $(notdir $(RUN_DIR)); fi

DEMO_ARGS ?=
demo: $(STACK_NEEDS) $(if $(filter vllm,$(ENGINE)),vllm) ## start the stack, compare listener http vs llm-gw on the article workload scaled / 6 (speedup 5), print the table, stop it; ENGINE=vllm: completions and chat through both listeners to real vLLM (functional)
	$(PY) -m local.stack demo --name demo --engine $(ENGINE) --groups $(GROUPS) \
		$(if $(filter off,$(PRECISE)),--no-precise-prefix) $(DEMO_ARGS)

# Load tests (loadtest/): LT_HOST is the Gateway address (local stack by default, or a cluster's).
# LT_PORTS: listeners `http` and `llm-gw`; the local stack runs them at the cluster ports + 10000
# (local/dataplane.py LISTENER_PORT_OFFSET); against a cluster use LT_PORTS="8080 8081".
LT_HOST      ?= 127.0.0.1
LT_PORTS     ?= $(if $(filter 127.0.0.1 localhost,$(LT_HOST)),18080 18081,8080 8081)
WORKLOAD     ?= demo
SEED         ?= 0
USERS        ?= 30
COMPARE_ARGS ?=
SWEEP_ARGS   ?=
LOCUST_ARGS  ?=
# `make loadtest` passes a flag only where no LOCUST_* variable and no ./locust.conf sets it
# (locust: flags > env > locust.conf), and WORKLOAD/SEED only when given to make.
LOCUST_CONF  := $(wildcard locust.conf)
lt_flag = $(if $(or $($(1)),$(LOCUST_CONF)),,$(2))
lt_make = $(if $(filter command line,$(origin $(1))),$(2))

loadtest: setup ## locust web UI on http://127.0.0.1:8089: A/B of LT_PORTS on LT_HOST (`make up` first); LOCUST_ARGS="--autostart -t 5m ..."
	$(VENV)/bin/locust -f loadtest/locustfile.py --web-host 127.0.0.1 \
		$(call lt_flag,LOCUST_HOST,--host http://$(LT_HOST)) $(call lt_flag,LOCUST_PORTS,--ports "$(LT_PORTS)") \
		$(call lt_flag,LOCUST_USERS,-u $(USERS) -r $(USERS)) \
		$(call lt_make,WORKLOAD,--workload $(WORKLOAD)) $(call lt_make,SEED,--seed $(SEED)) $(LOCUST_ARGS)

compare: setup ## headless: same workload on each of LT_PORTS in turn -> results/compare-<time>/ (report.md, JSONs, PNGs); COMPARE_ARGS=...
	$(PY) -m loadtest compare --host $(LT_HOST) --ports $(LT_PORTS) --workload $(WORKLOAD) --seed $(SEED) \
		--out results/compare-$$(date +%Y%m%d-%H%M%S) $(COMPARE_ARGS)

sweep: setup ## headless: each of LT_PORTS at several request rates -> results/sweep-<time>/ (TTFT and goodput vs rate); SWEEP_ARGS=...
	$(PY) -m loadtest sweep --host $(LT_HOST) --ports $(LT_PORTS) --workload $(WORKLOAD) --seed $(SEED) \
		--out results/sweep-$$(date +%Y%m%d-%H%M%S) $(SWEEP_ARGS)

$(CHROMIUM): $(APT_FIRST)
	test -x $@ || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 chromium >/dev/null; }

bench: setup vllm ## every benchmark (validation, picker, lab, lab matrix, HTTP vs lab crosscheck, make demo, picker scale; 30-40 min + the matrix) -> BENCHMARKS.md
	$(PY) -m bench

bench-picker: setup $(TOOLS)/picker-loadclient ## benchmark the picker (~30 min): decisions/s, latency and CPU (3/16/64 endpoints, both ext_proc servers), a perf profile, one pod, long prompts, scrape CPU
	mkdir -p results && $(PY) -m bench.picker --json results/bench-picker.json

bench-picker-scale: setup $(TOOLS)/picker-loadclient ## benchmark the picker at scale (~10 min): 16-1,024 endpoints, scrape load, worker processes
	mkdir -p results && $(PY) -m bench.picker.scale --json results/bench-picker-scale.json

# The benchmark's load generator (Go: it must not eat the server's CPU); go.sum pins its modules.
$(TOOLS)/picker-loadclient: bench/picker/loadclient/main.go bench/picker/loadclient/go.mod bench/picker/loadclient/go.sum
	mkdir -p $(TOOLS) && cd bench/picker/loadclient && go build -o $(CURDIR)/$(TOOLS)/picker-loadclient .

# Routing lab (lab/): virtual time, 3 simulated A10 groups; results/lab-<workload>/summary.{json,md} + PNGs.
LAB_SEEDS    ?= 0 1 2 3 4
LAB_POLICIES ?= --policy least-request --policy picker --policy picker-upstream
LAB_OUT      ?= results
.PHONY: lab
lab: setup ## routing lab: article + shared-prefix workloads, least request vs picker default vs upstream-default, 5 seeds, plots -> results/lab-<workload>/
	for w in article shared-prefix; do \
		$(PY) -m lab run --workload $$w $(LAB_POLICIES) --seeds $(LAB_SEEDS) --out $(LAB_OUT)/lab-$$w --plots || exit 1; \
	done

.PHONY: lab-matrix
lab-matrix: setup ## routing lab scenario matrix (18 scenarios x 5 policies incl. the oracle x 5 seeds; its time: BENCHMARKS.md) -> $(LAB_OUT)/lab-matrix/matrix.json
	$(PY) -m lab matrix --out $(LAB_OUT)/lab-matrix --seeds $(LAB_SEEDS)
