# kvroute — build, test, benchmark.
GO       ?= go
BIN      ?= bin
IMAGE    ?= kvroute:dev
PKGS     := ./...

.PHONY: all build test vet fmt-check bench run docker clean sim

all: build

build:
	$(GO) build -trimpath -o $(BIN)/kvroute .
	$(GO) build -trimpath -o $(BIN)/kvsim ./bench/cmd/kvsim

# The README's test command: vet, formatting, and the race-enabled suite.
test: vet fmt-check
	$(GO) test -race -timeout 20m $(PKGS)

vet:
	$(GO) vet $(PKGS)

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# Micro-benchmarks beside the code (hop latency, parsing, policies).
bench:
	$(GO) test -run '^$$' -bench . -benchtime 2s $(PKGS)

# Run kvroute against four local simulated pods.
run: build
	./$(BIN)/kvsim --pods 4 --port 8100 & echo $$! > $(BIN)/kvsim.pid; \
	trap 'kill $$(cat $(BIN)/kvsim.pid)' EXIT INT TERM; \
	./$(BIN)/kvroute --listen :8000 --admin-listen :9090 --log-format console \
	  --backends http://127.0.0.1:8100,http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:8103

docker:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(BIN)
