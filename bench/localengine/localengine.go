// Package localengine runs real local model servers as kvbench engines:
// stock Ollama (v0.24) and llama.cpp's llama-server, each with the tiny
// random-weight Llama of the workplace's shared/engines, real prefill and
// decode compute on CPU. It owns unpacking their binaries and model into
// the module's bin/ (bench/proc), the command line and environment of one
// server from Settings, and a fleet of servers on loopback ports, started
// ready and warm. Which scenarios run on them is bench/scenario's.
package localengine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute/bench/proc"
)

// ErrNoBinary is wrapped when an engine's binary or model is not in an
// ancestor's shared/engines (a user's clone has no ../shared).
var ErrNoBinary = errors.New("localengine: engine not found")

// ErrConfig is wrapped by invalid settings.
var ErrConfig = errors.New("localengine: invalid settings")

// The engines.
const (
	// Ollama is stock Ollama: `ollama serve` per port, which spawns its
	// llama.cpp runner as a child process on the model's first request.
	Ollama = "ollama"
	// LlamaCpp is llama.cpp's own server, one process per port.
	LlamaCpp = "llamacpp"
)

// Engines lists the engines in documentation order.
func Engines() []string { return []string{Ollama, LlamaCpp} }

// Model is the served model's name; requests name it.
const Model = "tiny"

// llamaCtx is llama-server's context (-c): the model's, 8,192 tokens,
// shared by its slots (an explicit -np splits it evenly).
const llamaCtx = 8192

// Settings are one fleet's engine and its flags. The zero value of each
// field is the engine's own default.
type Settings struct {
	// Engine is Ollama or LlamaCpp.
	Engine string `json:"engine"`
	// NumParallel is Ollama's OLLAMA_NUM_PARALLEL: sequences decoded at
	// once and cache slots (0: Ollama's default, 1).
	NumParallel int `json:"num_parallel,omitempty"`
	// Slots is llama-server's -np (0: its default, auto: 4 slots over a
	// unified KV).
	Slots int `json:"slots,omitempty"`
	// CacheRAMMiB is llama-server's --cache-ram, its host prompt cache in
	// MiB (about 2 KiB a token of this model); nil: its default, 8,192.
	CacheRAMMiB *int `json:"cache_ram_mib,omitempty"`
	// Metrics turns llama-server's /metrics on (--metrics).
	Metrics bool `json:"metrics,omitempty"`
}

// Validate reports the first problem of s.
func (s Settings) Validate() error {
	switch {
	case !slices.Contains(Engines(), s.Engine):
		return fmt.Errorf("%w: engine %q (known: %v)", ErrConfig, s.Engine, Engines())
	case s.NumParallel < 0 || s.Slots < 0:
		return fmt.Errorf("%w: negative parallelism", ErrConfig)
	case s.CacheRAMMiB != nil && *s.CacheRAMMiB < 0:
		return fmt.Errorf("%w: negative --cache-ram", ErrConfig)
	case s.Engine == Ollama && (s.Slots != 0 || s.CacheRAMMiB != nil || s.Metrics):
		return fmt.Errorf("%w: -np, --cache-ram and --metrics are llama-server's", ErrConfig)
	case s.Engine == LlamaCpp && s.NumParallel != 0:
		return fmt.Errorf("%w: OLLAMA_NUM_PARALLEL is Ollama's", ErrConfig)
	}
	return nil
}

// String describes s as its command line would: "llama-server -np 1
// --cache-ram 8 --metrics", "ollama serve, OLLAMA_NUM_PARALLEL=4".
func (s Settings) String() string {
	if s.Engine == Ollama {
		return "ollama serve, OLLAMA_NUM_PARALLEL=" + strconv.Itoa(max(1, s.NumParallel))
	}
	return strings.Join(append([]string{"llama-server"}, s.flags()...), " ")
}

// Tag names s in a directory name: the engine, then each flag off its
// default ("ollama", "ollama-parallel-4", "llamacpp-np-1-cache-ram-8-metrics").
func (s Settings) Tag() string {
	t := s.Engine
	if s.NumParallel > 0 {
		t += "-parallel-" + strconv.Itoa(s.NumParallel)
	}
	if s.Slots > 0 {
		t += "-np-" + strconv.Itoa(s.Slots)
	}
	if s.CacheRAMMiB != nil {
		t += "-cache-ram-" + strconv.Itoa(*s.CacheRAMMiB)
	}
	if s.Metrics {
		t += "-metrics"
	}
	return t
}

// flags are llama-server's flags for s beyond the fixed ones.
func (s Settings) flags() []string {
	var out []string
	if s.Slots > 0 {
		out = append(out, "-np", strconv.Itoa(s.Slots))
	}
	if s.CacheRAMMiB != nil {
		out = append(out, "--cache-ram", strconv.Itoa(*s.CacheRAMMiB))
	}
	if s.Metrics {
		out = append(out, "--metrics")
	}
	return out
}

// Files are an engine's unpacked binary and model.
type Files struct {
	// Binary is the server's executable.
	Binary string
	// Models is Ollama's model store (a directory) or llama-server's
	// GGUF file.
	Models string
}

// Find returns engine's files under the module's bin/, unpacked there
// from <ancestor>/shared/engines when missing or stale: bin/ollama and
// bin/ollama-store, or bin/llama-server and bin/tiny.gguf. It returns an
// error wrapping ErrNoBinary when shared/engines lacks them. Safe to call
// from several processes at once.
func Find(engine string) (Files, error) {
	var f Files
	var err, err2 error
	switch engine {
	case Ollama:
		f.Binary, err = proc.Gunzip("ollama/ollama.gz", "ollama")
		f.Models, err2 = proc.Untar("ollama/tiny-model.tar.gz", "ollama-store")
	case LlamaCpp:
		f.Binary, err = proc.Gunzip("llama.cpp/llama-server.gz", "llama-server")
		f.Models, err2 = proc.Gunzip("llama.cpp/tiny.gguf.gz", "tiny.gguf")
	default:
		return f, fmt.Errorf("%w: engine %q", ErrConfig, engine)
	}
	if err = errors.Join(err, err2); errors.Is(err, proc.ErrNotFound) {
		return f, fmt.Errorf("%w: %v", ErrNoBinary, err)
	}
	return f, err
}

// command returns the command of one server of s on port, its private
// directory dir holding an Ollama server's HOME.
func (s Settings) command(f Files, port int, dir string) *exec.Cmd {
	if s.Engine == Ollama {
		cmd := exec.Command(f.Binary, "serve")
		cmd.Env = append(os.Environ(), "HOME="+dir, "OLLAMA_MODELS="+f.Models,
			"OLLAMA_HOST=127.0.0.1:"+strconv.Itoa(port), "OLLAMA_KEEP_ALIVE=-1", "OLLAMA_FLASH_ATTENTION=0",
			"OLLAMA_NUM_PARALLEL="+strconv.Itoa(max(1, s.NumParallel)))
		return cmd
	}
	args := append([]string{"-m", f.Models, "--alias", Model, "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"-t", "1", "-c", strconv.Itoa(llamaCtx)}, s.flags()...)
	return exec.Command(f.Binary, args...)
}

// Fleet is a set of running servers of one engine, each on its own
// loopback port, ready and warm. Close stops them.
type Fleet struct {
	// Settings are the servers' engine and flags.
	Settings Settings
	procs    []*proc.Process
	dir      string // the servers' private directories
}

// readyTimeout bounds one server's start and warm-up: llama-server is
// ready in about 0.1 s and Ollama in under a second, its model loaded by
// the first request in about one more, here; a loaded machine takes
// longer.
const readyTimeout = 60 * time.Second

// stopGrace is how long a server may take to exit after SIGTERM before
// its process group is killed.
const stopGrace = 5 * time.Second

// Start starts n servers of s, each in its own process group on a free
// loopback port, waits until each is ready (llama-server: GET /health 200;
// Ollama: GET /api/version 200) and warms each with one small completion
// (Ollama loads the model on its first request). ctx bounds the start, not
// the servers' lives.
func Start(ctx context.Context, s Settings, n int) (*Fleet, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	files, err := Find(s.Engine)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvbench-"+s.Engine+"-*")
	if err != nil {
		return nil, err
	}
	f := &Fleet{Settings: s, dir: dir}
	for i := range n {
		p, err := f.startOne(files, i)
		if err != nil {
			return nil, errors.Join(err, f.Close())
		}
		f.procs = append(f.procs, p)
	}
	ready := "/health"
	if s.Engine == Ollama {
		ready = "/api/version"
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, p := range f.procs {
		wg.Go(func() {
			if errs[i] = p.WaitReady(ctx, ready, readyTimeout); errs[i] == nil {
				errs[i] = warm(ctx, p)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, errors.Join(err, f.Close())
	}
	return f, nil
}

// startOne starts server i.
func (f *Fleet) startOne(files Files, i int) (*proc.Process, error) {
	port, err := proc.FreePort()
	if err != nil {
		return nil, err
	}
	home := filepath.Join(f.dir, strconv.Itoa(i))
	if err := os.MkdirAll(home, 0o755); err != nil {
		return nil, err
	}
	return proc.Start("http://127.0.0.1:"+strconv.Itoa(port), f.Settings.command(files, port, home))
}

// warmBody is the warm-up request: a few tokens, nothing a scenario's
// prompts share.
const warmBody = `{"model":"` + Model + `","prompt":"hello","max_tokens":4}`

// warm sends p one small completion and waits for its answer.
func warm(ctx context.Context, p *proc.Process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/v1/completions", strings.NewReader(warmBody))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %s warm-up: %v: %s", proc.ErrStart, p.URL, err, p.Output())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: %s warm-up: status %d: %s", proc.ErrStart, p.URL, resp.StatusCode, b)
	}
	return nil
}

// URLs returns the servers' base URLs (http://127.0.0.1:port), in start
// order.
func (f *Fleet) URLs() []string {
	urls := make([]string, len(f.procs))
	for i, p := range f.procs {
		urls[i] = p.URL
	}
	return urls
}

// Close stops every server's process group (SIGTERM, SIGKILL after 5 s),
// waits for them and removes their directories. Safe to call more than
// once.
func (f *Fleet) Close() error {
	err := proc.StopAll(f.procs, stopGrace)
	return errors.Join(err, os.RemoveAll(f.dir))
}
