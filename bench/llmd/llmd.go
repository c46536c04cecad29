// Package llmd runs the public llm-d inference simulator
// (github.com/llm-d/llm-d-inference-sim, Apache-2.0) as kvbench's second
// engine: an engine nobody here wrote, with vLLM's API and metrics, its own
// scheduler, latency model and an evicting prefix cache. It owns finding
// the simulator's binary (a path, or the archive under ../shared/engines
// decompressed into the module's bin/), the command line of one pod from
// Settings, and the processes of a fleet on loopback ports. Which settings
// stand for an engine profile is bench/scenario's.
package llmd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/kvroute/kvroute/bench/proc"
)

// ErrNoBinary is returned by Binary when neither the given path nor the
// shared archive exists (a user's clone has no ../shared).
var ErrNoBinary = errors.New("llmd: llm-d inference simulator not found")

// ErrStart is wrapped by errors starting a pod.
var ErrStart = errors.New("llmd: pod did not start")

// BinaryName is the simulator's file name under the module's bin/.
const BinaryName = "llm-d-inference-sim"

// archive is the simulator's archive under shared/engines.
const archive = BinaryName + ".gz"

// EnvBinary names the environment variable that, when set, gives the
// simulator's path (as Binary's path argument would).
const EnvBinary = "KVBENCH_LLMD"

// Binary returns the path of an executable simulator: path when not
// empty (it must exist), else $KVBENCH_LLMD, else the module's
// bin/llm-d-inference-sim, decompressed there from
// <ancestor>/shared/engines/llm-d-inference-sim.gz (the first ancestor of
// the working directory that has it) when missing or older than the
// archive (proc.Gunzip). It returns ErrNoBinary when there is none. Safe
// to call from several processes at once.
func Binary(path string) (string, error) {
	if path == "" {
		path = os.Getenv(EnvBinary)
	}
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("%w: %v", ErrNoBinary, err)
		}
		return path, nil
	}
	bin, err := proc.Gunzip(archive, BinaryName)
	if errors.Is(err, proc.ErrNotFound) {
		return "", fmt.Errorf("%w: %v (set --llmd-binary or %s)", ErrNoBinary, err, EnvBinary)
	}
	return bin, err
}

// Settings are one simulated pod's engine, in the simulator's terms. Times
// are wall time (the simulator has no time scale).
type Settings struct {
	// Model is the served model name (--model).
	Model string
	// LoRAs are the adapters it serves (--lora-modules), MaxLoRAs its
	// --max-loras (0: the simulator's default, 1).
	LoRAs    []string
	MaxLoRAs int
	// BlockSize is the KV block size in tokens (--block-size: 8, 16, 32,
	// 64 or 128) and KVBlocks the cache's capacity in blocks
	// (--kv-cache-size).
	BlockSize int
	KVBlocks  int
	// MaxNumSeqs bounds the requests running at once (--max-num-seqs);
	// more wait in the simulator's queue.
	MaxNumSeqs int
	// MaxWaiting bounds the requests waiting beyond MaxNumSeqs
	// (--max-waiting-queue-length); more are answered 429. 0: the
	// simulator's default (1,000).
	MaxWaiting int `json:",omitempty"`
	// MaxModelLen bounds prompt + output tokens (--max-model-len).
	MaxModelLen int
	// PrefillOverhead is a request's fixed time to first token and
	// PrefillPerToken the time per uncached prompt token
	// (--prefill-overhead, --prefill-time-per-token, with the per-token
	// latency calculator).
	PrefillOverhead time.Duration
	PrefillPerToken time.Duration
	// InterTokenLatency is the time per output token after the first
	// (--inter-token-latency) of a request running alone.
	InterTokenLatency time.Duration
	// TimeFactorUnderLoad (≥ 1; 0 means 1) stretches every running
	// request's prefill and inter-token times linearly with the running
	// count, to this factor at MaxNumSeqs (--time-factor-under-load).
	TimeFactorUnderLoad float64
	// Seed seeds the simulator's random draws (--seed).
	Seed uint64
	// ZMQEndpoint is where the simulator's KV events publisher dials
	// (--zmq-endpoint, "tcp://host:port"); "" is DefaultZMQEndpoint.
	ZMQEndpoint string `json:",omitempty"`
}

// DefaultZMQEndpoint is where a pod's KV events go unless
// Settings.ZMQEndpoint says otherwise: the simulator's default, where
// nobody need listen.
const DefaultZMQEndpoint = "tcp://127.0.0.1:5557"

// Args returns the simulator's command line for s listening on port:
// the dummy tokenizer (a word or punctuation piece per token, nothing to
// download), the prefix KV cache on (its events dial s.ZMQEndpoint, by
// default tcp://127.0.0.1:5557, where nobody need listen), the per-token
// latency calculator.
func (s Settings) Args(port int) []string {
	d := func(v time.Duration) string { return v.String() }
	zmq := s.ZMQEndpoint
	if zmq == "" {
		zmq = DefaultZMQEndpoint
	}
	args := []string{
		"--model", s.Model, "--force-dummy-tokenizer", "--port", strconv.Itoa(port),
		"--max-model-len", strconv.Itoa(s.MaxModelLen), "--max-num-seqs", strconv.Itoa(s.MaxNumSeqs),
		"--enable-kvcache", "--block-size", strconv.Itoa(s.BlockSize), "--kv-cache-size", strconv.Itoa(s.KVBlocks),
		"--latency-calculator", "per-token", "--prefill-overhead", d(s.PrefillOverhead),
		"--prefill-time-per-token", d(s.PrefillPerToken), "--inter-token-latency", d(s.InterTokenLatency),
		"--seed", strconv.FormatUint(s.Seed, 10), "--zmq-endpoint", zmq,
	}
	if s.MaxWaiting > 0 {
		args = append(args, "--max-waiting-queue-length", strconv.Itoa(s.MaxWaiting))
	}
	if s.TimeFactorUnderLoad > 1 {
		args = append(args, "--time-factor-under-load", strconv.FormatFloat(s.TimeFactorUnderLoad, 'f', 3, 64))
	}
	if len(s.LoRAs) > 0 {
		args = append(args, "--lora-modules")
		for _, l := range s.LoRAs {
			args = append(args, fmt.Sprintf(`{"name":%q,"path":"/lora/%s"}`, l, l))
		}
		if s.MaxLoRAs > 0 {
			args = append(args, "--max-loras", strconv.Itoa(s.MaxLoRAs))
		}
	}
	return args
}

// Fleet is a set of running simulator processes, one per pod, each on its
// own loopback port. Close stops them.
type Fleet struct {
	pods []*proc.Process
}

// readyTimeout bounds a pod's start: the simulator answers /health within
// a second of its start here; a loaded machine may take a few more.
const readyTimeout = 30 * time.Second

// Start starts one simulator process of bin per settings, on free loopback
// ports, and waits until each answers /health. The simulator listens on
// every interface (it has no host flag); traffic goes to 127.0.0.1 only.
// ctx bounds the start, not the processes' lives.
func Start(ctx context.Context, bin string, settings []Settings) (*Fleet, error) {
	f := &Fleet{}
	for _, s := range settings {
		p, err := startPod(bin, s)
		if err != nil {
			return nil, errors.Join(err, f.Close())
		}
		f.pods = append(f.pods, p)
	}
	for _, p := range f.pods {
		if err := p.WaitReady(ctx, "/health", readyTimeout); err != nil {
			return nil, errors.Join(fmt.Errorf("%w: %v", ErrStart, err), f.Close())
		}
	}
	return f, nil
}

func startPod(bin string, s Settings) (*proc.Process, error) {
	port, err := proc.FreePort()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, s.Args(port)...)
	// POD_IP names the pod in its KV events' topic (kv@<ip>:<port>@<model>).
	cmd.Env = append(os.Environ(), "POD_IP=127.0.0.1")
	p, err := proc.Start("http://127.0.0.1:"+strconv.Itoa(port), cmd)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrStart, err)
	}
	return p, nil
}

// URLs returns the pods' base URLs (http://127.0.0.1:port), in settings
// order.
func (f *Fleet) URLs() []string {
	urls := make([]string, len(f.pods))
	for i, p := range f.pods {
		urls[i] = p.URL
	}
	return urls
}

// Kill kills pod i at once (SIGKILL: its connections reset, as when its
// node dies) and waits for it.
func (f *Fleet) Kill(i int) error { return f.pods[i].Kill() }

// stopGrace is how long a pod may take to exit after SIGTERM before it is
// killed.
const stopGrace = 5 * time.Second

// Close stops every pod (SIGTERM, then SIGKILL after 5 s) and waits for
// them. Safe to call more than once.
func (f *Fleet) Close() error { return proc.StopAll(f.pods, stopGrace) }
