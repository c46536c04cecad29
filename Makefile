# kvroute — build, test, benchmark. `make help` lists the targets; the
# one-liner after each target's `##` is what it prints.
GO       ?= go
BIN      ?= bin
IMAGE    ?= kvroute:dev
PKGS     := ./...
# Stamped into the binary (kvroute --version, the first log line, kvroute_build_info).
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -X main.version=$(VERSION) -X main.revision=$(REVISION)

.PHONY: all help build test vet fmt-check bench run docker clean demo bench-e2e bench-pd bench-proxy fuzz soak

all: build ## the default: build

help: ## list the targets, a line each
	@awk 'BEGIN { FS = ":[^#]*## " } /^[a-zA-Z0-9_-]+:[^=]*## / { printf "  %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

build: ## bin/kvroute (version-stamped), bin/kvsim and bin/kvbench
	$(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/kvroute .
	$(GO) build -trimpath -o $(BIN)/kvsim ./bench/cmd/kvsim
	$(GO) build -trimpath -o $(BIN)/kvbench ./bench/cmd/kvbench

# The README's test command (and CI's, .ci/run).
test: vet fmt-check ## vet, gofmt check and the race-enabled test suite
	$(GO) test -race -timeout 20m $(PKGS)

vet: ## go vet every package
	$(GO) vet $(PKGS)

fmt-check: ## fail when a tracked Go file needs gofmt
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

bench: ## micro-benchmarks beside the code (hop latency, parsing, policies)
	$(GO) test -run '^$$' -bench . -benchtime 2s $(PKGS)

# Every native fuzz target in turn, FUZZTIME each (not part of test). A
# crasher is kept under the package's testdata/fuzz/FuzzName/ as a seed.
FUZZTIME ?= 30s
FUZZ_TARGETS := ./proxy:FuzzParse ./proxy:FuzzRender ./proxy:FuzzUsageScanner ./proxy:FuzzStreamTrack \
	./discovery:FuzzParseEngine ./discovery:FuzzDNSAnswer ./kvevents:FuzzDecodeBatch \
	./kvevents:FuzzZMTP ./prefix:FuzzHasher ./peers:FuzzDecode ./peers:FuzzDecodeState ./peers:FuzzDecodeLoad \
	./peers:FuzzDecodeLinks ./peers:FuzzDecodeSequences
fuzz: ## every native fuzz target in turn, FUZZTIME (30s) each
	@set -e; for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; name=$${t#*:}; echo "== $$name ($$pkg, $(FUZZTIME))"; \
	  $(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg; \
	done

run: build ## kvroute on :8000 (admin :9090) in front of four simulated pods
	./$(BIN)/kvsim --pods 4 --port 8100 & echo $$! > $(BIN)/kvsim.pid; \
	trap 'kill $$(cat $(BIN)/kvsim.pid)' EXIT INT TERM; \
	./$(BIN)/kvroute --listen :8000 --admin-listen :9090 --log-format console \
	  --backends http://127.0.0.1:8100,http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:8103

docker: ## the image kvroute:dev (IMAGE), version-stamped: static, distroless, non-root
	docker build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t $(IMAGE) .

clean: ## remove bin/ (BIN)
	rm -rf $(BIN)

# The README's first command: a short shared-prefix run (three rising-rate
# stages) on a simulated 8-pod fleet behind an in-process kvroute, for
# round-robin, least-request, prefix and SGLang's cache-aware policy (about
# two minutes on two cores); prints the results table and where the charts
# are (bench/results/demo/). The full eight-policy comparison is bench-e2e.
# See BENCHMARKS.md.
demo: build ## a short shared-prefix run of four policies on 8 simulated pods
	./$(BIN)/kvbench --scenario demo

# Every benchmark scenario (shared-prefix, multi-turn, random, hot-prefix,
# near-identical, lora, the Mooncake trace replay when TRACE exists, the
# pressure scenarios at 1x, 2x and 4x the fleet's KV, overhead) on h100-8b,
# results under bench/results/<scenario>/; then the policy matrix: shared-prefix,
# hot-prefix, random and the pressure scenarios on the h100-8b, slow-large,
# fast-small and mixed engine profiles (h100-8b's cells reused from the runs
# before), results under bench/results/<profile>/<scenario>/ and
# bench/results/matrix.md. Both on bench/sim and, where the workplace has it
# (ENGINES), on the llm-d inference simulator, whose results go under
# bench/results/llm-d/. Hours on two cores.
TRACE ?= ../shared/traces/conversation_trace.jsonl
ENGINES ?= kvsim$(if $(wildcard ../shared/engines/llm-d-inference-sim.gz),$(comma)llm-d)
comma := ,
bench-e2e: build ## every benchmark scenario and the engine-profile matrix (hours)
	./$(BIN)/kvbench --scenario all,matrix --engine $(ENGINES) $(if $(wildcard $(TRACE)),--trace $(TRACE))

# Prefill/decode disaggregation (issue #13): the same 8 simulated pods laid
# out aggregated (8 mixed) and disaggregated (4P+4D, 2P+6D, and 4P+4D with
# a prefill leg for every request) behind kvroute's prefix policy, on long
# prompts with short answers, short prompts with long answers, and
# shared-prefix (selective against always-PD). Results under
# bench/results/pd-*/. About 15 minutes on two cores.
bench-pd: build ## aggregated against disaggregated layouts of 8 simulated pods
	./$(BIN)/kvbench --scenario pd-long-prompt,pd-long-output,pd-selective

# The cost of one hop (issue #14): wrk against an instant loopback backend
# directly, through kvroute (default flags), nginx and HAProxy (keep-alive
# upstream, no buffering, access logs to files), alternating in rounds;
# 1 KiB completions and 128 KiB chats at 1, 32 and 256 connections and a
# 100-event stream; then kvroute's RSS with 9,800 SSE streams open through
# it, and with as many idle keep-alive connections (9,800: each stream
# takes two of kvroute's file descriptors, and the machine's limit is
# 20,000). Installs wrk, nginx and haproxy with apt-get when missing.
# Results in bench/results/proxy/. About 10 minutes.
bench-proxy: build ## one hop's cost against nginx, HAProxy and a bare proxy, memory per stream
	@command -v wrk >/dev/null && command -v nginx >/dev/null && command -v haproxy >/dev/null || \
		apt-get install -y wrk nginx-light haproxy
	$(GO) build -trimpath -o $(BIN)/kvhop ./bench/cmd/kvhop
	./$(BIN)/kvhop --kvroute $(BIN)/kvroute --kv-events --gossip --out bench/results/proxy
	./$(BIN)/kvhop --kvroute $(BIN)/kvroute --streams 9800 --out bench/results/proxy

# Tenants (issue #38): noisy neighbour and priority floods, kvroute's fair
# queue against its queue in arrival order, on bench/sim, the llm-d
# simulator (also with short waiting queues that answer 429) and
# llama.cpp's server where ../shared/engines has them. About 25 minutes.
bench-tenants: build ## overload shared by tenants: fair queue against FIFO, every engine
	$(GO) build -trimpath -o $(BIN)/kvtenants ./bench/cmd/kvtenants
	./$(BIN)/kvtenants --engine kvsim,llm-d,llamacpp --out bench/results/tenants-38

# Soak (issue #12): SOAK_DURATION of mixed traffic (shared-prefix,
# multi-turn, random; streaming or not; some abandoned by the client) with
# faults rotating over four simulated pods (5xx/429 storms, stalls, dropped
# streams, a pod killed and restarted) through $(BIN)/kvroute. Samples its
# RSS, open FDs, goroutines, in-flight requests and prefix index every 5 s;
# fails unless they stay flat after warm-up, no request is lost and SIGTERM
# stops kvroute cleanly. Results under bench/results/soak/ (soak.md,
# soak.png, soak.csv). Takes SOAK_DURATION + ~20 s.
SOAK_DURATION ?= 10m
soak: build ## SOAK_DURATION (10m) of mixed traffic and rotating faults; checks nothing grows
	$(GO) run ./bench/cmd/kvsoak --duration $(SOAK_DURATION) --kvroute $(BIN)/kvroute --out bench/results/soak
