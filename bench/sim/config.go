// Package sim is a simulated vLLM engine: it speaks vLLM's OpenAI-compatible
// wire protocol (completions, chat, SSE streaming, /metrics, /tokenize, and
// the prefill/decode handoff of vLLM's NixlConnector and of SGLang's
// bootstrap rooms) and behaves like one GPU-bound engine in time
// (continuous batching, a chained-hash prefix cache with LRU eviction, a
// memory-bandwidth decode model), by default Llama-3.1-8B on one H100 and
// otherwise one of the named engine profiles (Profiles). Optionally it
// publishes KV-cache events over ZeroMQ as vLLM does and keeps a CPU KV
// tier as vLLM's OffloadingConnector does (Config.KVEventsPort,
// Config.CPUBlocks). Tests, benchmarks and the demo run many cheap pods of
// it in one process; see New, StartFleet and bench/cmd/kvsim.
package sim

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// ErrConfig is wrapped by every error Config.Validate returns.
var ErrConfig = errors.New("sim: invalid config")

// ErrClosed is returned by Serve after Close.
var ErrClosed = errors.New("sim: pod closed")

// Role is what a pod does in prefill/decode disaggregation, under either
// protocol the simulator speaks (pd.go and bootstrap.go): vLLM's
// NixlConnector (docs.vllm.ai "NixlConnector Usage Guide" and vLLM's
// tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) and SGLang's
// bootstrap rooms (SGLang's PD router, sgl-model-gateway).
type Role string

const (
	// RoleMixed serves whole requests and honours both do_remote_decode
	// (acts as a prefill pod) and do_remote_prefill (acts as a decode pod),
	// like vLLM with kv_role "kv_both". It ignores the bootstrap fields, like
	// SGLang without --disaggregation-mode: both SGLang legs carry the same
	// body, so only the server's role tells them apart.
	RoleMixed Role = "mixed"
	// RolePrefill honours do_remote_decode: it prefills, holds the KV blocks
	// and returns a kv_transfer_params reference; and bootstrap_room: it
	// prefills and holds the KV blocks for the decode pod that pulls the
	// room from its bootstrap server. do_remote_prefill is ignored.
	RolePrefill Role = "prefill"
	// RoleDecode honours do_remote_prefill and bootstrap_room: it pulls the
	// KV blocks named by the reference or the room instead of computing the
	// prefill. do_remote_decode is ignored.
	RoleDecode Role = "decode"
)

// ParseRole converts a flag value to a Role.
func ParseRole(s string) (Role, error) {
	switch r := Role(s); r {
	case RoleMixed, RolePrefill, RoleDecode:
		return r, nil
	}
	return "", fmt.Errorf("%w: unknown role %q (want mixed, prefill or decode)", ErrConfig, s)
}

func (r Role) servesPrefill() bool { return r == RolePrefill || r == RoleMixed }
func (r Role) servesDecode() bool  { return r == RoleDecode || r == RoleMixed }

// Config describes one simulated pod. The zero value of every field means
// "use the default" (see DefaultConfig), so Config{} is a valid Llama-3.1-8B
// on one H100 at real-time speed. Durations in the cost model are modelled
// (GPU) time; TimeScale converts them to wall time. Fault durations are wall
// time. A Config is copied by New; later edits do not affect a running pod.
type Config struct {
	// Model is the served model name (the "model" field clients must send
	// and the model_name metric label).
	Model string
	// LoRAs are the names of LoRA adapters the pod has loaded on Model, as
	// vLLM's --lora-modules: requests may name one as their model, and
	// /v1/models lists them with Model as their parent. An adapter's
	// prefixes are cached apart from the base model's (vLLM keys its
	// prefix cache by LoRA).
	LoRAs []string
	// MaxLoRAs is vLLM's --max-loras: at most this many adapters have
	// requests in one batch; a request for another waits, skipped by the
	// scheduler, until one of them has none left running. Default 1 (vLLM's)
	// when LoRAs are loaded.
	MaxLoRAs int
	// Role selects the prefill/decode behaviour; default RoleMixed.
	Role Role
	// Seed makes ids, synthetic text, EOS draws and fault draws deterministic.
	// Pods of a fleet get Seed+i.
	Seed uint64
	// EngineID is the NixlConnector engine id put in kv_transfer_params;
	// default derived from Seed and the pod's start time (so a restarted pod
	// has a new one, as vLLM's engines do).
	EngineID string

	// TimeScale divides every modelled duration to get wall time: 10 runs ten
	// times faster than real time with the same ratios. Default 1.
	TimeScale float64

	// BlockSize is the KV block size in tokens (vLLM --block-size, default 16).
	BlockSize int
	// NumGPUBlocks is the KV capacity in blocks. Default 28125 blocks of 16 =
	// 450k tokens: an 80 GB H100 at gpu_memory_utilization 0.9 keeps ≈ 57 GB
	// after 16 GB of bf16 weights and activations, at 128 KiB per token
	// (32 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 bytes).
	NumGPUBlocks int
	// MaxModelLen bounds prompt+max_tokens per sequence (vLLM
	// --max-model-len); default 32768.
	MaxModelLen int
	// MaxNumBatchedTokens is the per-step token budget (vLLM
	// --max-num-batched-tokens); default 8192.
	MaxNumBatchedTokens int
	// MaxNumSeqs bounds the running batch (vLLM --max-num-seqs); default 256.
	MaxNumSeqs int
	// VocabSize bounds token ids (Llama 3: 128256).
	VocabSize int
	// DefaultMaxTokens is max_tokens for /v1/completions when the body has
	// none (vLLM: 16).
	DefaultMaxTokens int
	// DefaultChatMaxTokens is max_tokens for /v1/chat/completions when the
	// body has none; vLLM uses the rest of the context, the sim 256 (clamped
	// to the rest of the context).
	DefaultChatMaxTokens int
	// EOSProbability is the per-token probability of a seeded end-of-sequence
	// when ignore_eos is false; default 0: exactly max_tokens are generated.
	EOSProbability float64
	// StreamInterval batches streamed tokens like vLLM's --stream-interval:
	// the first token goes out alone, then one SSE delta per this many
	// tokens (the last may be shorter); default 1, one delta per token.
	StreamInterval int
	// MaxBodyBytes bounds request bodies; default 32 MiB.
	MaxBodyBytes int

	// StepOverhead is t0, the fixed cost of every engine step (launch,
	// scheduling, sampling); default 0.3 ms.
	StepOverhead time.Duration
	// WeightBytes is the weight bytes read per step; default 15.0e9 (8.03e9
	// bf16 parameters minus the 1.05 GB input embedding, of which a step
	// gathers only a few rows).
	WeightBytes float64
	// KVBytesPerToken is the KV cache size of one token; default 131072
	// (32 layers × 8 KV heads × 128 dims × K and V × 2 bytes).
	KVBytesPerToken float64
	// MemBandwidth is the effective HBM bandwidth in bytes/s; default 2.3e12
	// (≈ 69% of an H100 SXM's 3.35 TB/s).
	MemBandwidth float64
	// PrefillTokensPerSec is the prefill compute rate; default 20000
	// (16 GFLOP per token at ≈ 32% of 989 bf16 TFLOPS).
	PrefillTokensPerSec float64
	// PrefillStepOverhead is added to a step that computes a prompt chunk
	// (more than one token of some sequence); default 13 ms, so that a
	// prefill step costs ≈ 20 ms + tokens/20k including the ≈ 7 ms weight
	// pass (docs/engines.md, "The simulator", gives the cost model).
	PrefillStepOverhead time.Duration
	// KVTransferBandwidth is the NIXL pull rate in bytes/s; default 40e9.
	KVTransferBandwidth float64
	// KVTransferLatency is the fixed cost of one pull (handshake, descriptor
	// setup); default 1 ms.
	KVTransferLatency time.Duration
	// KVHoldTimeout is how long a prefill pod holds blocks for a decode pod
	// that does not pull them (vLLM VLLM_NIXL_ABORT_REQUEST_TIMEOUT); default
	// 480 s, modelled (divided by TimeScale).
	KVHoldTimeout time.Duration
	// SideChannelHost is the address the KV side channel listens on and
	// advertises as remote_host; default 127.0.0.1.
	SideChannelHost string
	// SideChannelPort is the port of the KV side channel, which is also the
	// SGLang bootstrap server (SGLang's default is 8998); default 0, a free
	// port picked at New (see Pod.SideChannelAddr). Pods that share a
	// SideChannelHost need distinct ports.
	SideChannelPort int
	// BootstrapWaitTimeout is how long the bootstrap server of a prefill
	// pod waits for a room that no prefill request has opened yet (the two
	// legs of the SGLang protocol race) before it answers 404; it is also
	// how long a closed room is remembered. Wall time (the legs' race is the
	// network's, not the GPU's); default 30 s.
	BootstrapWaitTimeout time.Duration
	// TPSize is reported as tp_size in kv_transfer_params; default 1.
	TPSize int

	// KVEventsPort is the port of the pod's KV-cache event publisher, like
	// vLLM's --kv-events-config '{"enable_kv_cache_events": true,
	// "publisher": "zmq", "endpoint": "tcp://*:5557"}': a ZeroMQ PUB socket
	// on KVEventsHost sending one msgpack batch of BlockStored,
	// BlockRemoved and AllBlocksCleared events per engine step that has
	// any (kvevents.go). 0 (the default) publishes nothing; -1 binds a free
	// port (see Pod.KVEventsAddr). StartFleet and Profile.Configs give pod
	// i of a fleet port+i, as kvsim gives pod i HTTP port+i.
	KVEventsPort int
	// KVEventsReplayPort is the port of the replay ROUTER socket (vLLM's
	// replay_endpoint), which sends a client the buffered batches from the
	// sequence number it asks for on, of the last 10,000 (vLLM's
	// buffer_steps). 0 (the default) is off, -1 a free port (see
	// Pod.KVEventsReplayAddr); it needs KVEventsPort. Pod i of a fleet
	// gets port+i.
	KVEventsReplayPort int
	// KVEventsHost is the address the KV event sockets bind; default
	// 127.0.0.1 (vLLM binds tcp://*).
	KVEventsHost string
	// KVEventsTopic is the first frame of every event message; default ""
	// like vLLM's. "{addr}" in it is replaced by the host:port the pod
	// serves HTTP on (its first listener) and "{model}" by Model, so
	// "kv@{addr}@{model}" is llm-d's kv@<pod-ip>:<port>@<model>.
	KVEventsTopic string
	// KVEventsArrayEncoding encodes batches and events as positional
	// msgpack arrays with the event's type first (vLLM's encoding before
	// mid-2026) instead of maps with a "type" key.
	KVEventsArrayEncoding bool

	// CPUBlocks is the capacity in blocks of a CPU KV tier with the
	// semantics of vLLM's OffloadingConnector (--kv-offloading-size, or
	// kv_connector_extra_config num_cpu_blocks): every block computed on
	// the GPU is also stored in CPU memory, LRU-evicted, and a prefix
	// that misses on the GPU is loaded back from the CPU at CPUBandwidth
	// instead of computed (cache.go, cpuTier). 0 (the default) is off.
	CPUBlocks int
	// CPUBandwidth is the GPU↔CPU KV copy rate of the CPU tier in
	// bytes/s; default 25e9, what pinned-memory copies reach over PCIe
	// Gen4 x16 (32 GB/s raw; Gen5 doubles it): ≈ 5.2 µs per token at 128
	// KiB per token, against 50 µs per token of prefill compute.
	CPUBandwidth float64

	// NoCachedTokens leaves usage.prompt_tokens_details.cached_tokens out
	// of answers, as a stock Ollama server does: the router then learns
	// what the engine had cached only from its times to first token.
	NoCachedTokens bool

	// Faults is the initial fault set; the admin API and SetFaults change it.
	Faults Faults

	// OnStep, if set, is called on the engine goroutine after every step
	// with that step's figures, before the step's answers are sent. It must
	// not block or call into the Pod; tests use it to observe batching
	// without sleeping.
	OnStep func(StepInfo)
}

// StepInfo describes one engine step. Times are modelled.
type StepInfo struct {
	Start, Duration time.Duration // since the pod started, modelled
	PrefillTokens   int           // tokens of prompt chunks (> 1 token of a sequence) computed
	DecodeSeqs      int           // sequences that computed exactly one token
	ContextTokens   int           // Σ KV tokens read by the scheduled sequences
	Running         int           // sequences in the batch after scheduling
	Waiting         int           // sequences queued after scheduling (incl. KV loads)
	UsedBlocks      int           // KV blocks referenced by sequences or holds
}

// DefaultConfig returns the defaults documented on Config's fields.
func DefaultConfig() Config {
	var c Config
	c.fill()
	return c
}

// fill replaces zero fields with defaults.
func (c *Config) fill() {
	setStr := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	setInt := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	setF := func(p *float64, v float64) {
		if *p == 0 {
			*p = v
		}
	}
	setD := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	setStr(&c.Model, "meta-llama/Llama-3.1-8B-Instruct")
	if c.Role == "" {
		c.Role = RoleMixed
	}
	setF(&c.TimeScale, 1)
	setInt(&c.BlockSize, 16)
	setInt(&c.NumGPUBlocks, 28125)
	setInt(&c.MaxModelLen, 32768)
	setInt(&c.MaxNumBatchedTokens, 8192)
	setInt(&c.MaxNumSeqs, 256)
	if len(c.LoRAs) > 0 {
		setInt(&c.MaxLoRAs, 1)
	}
	setInt(&c.VocabSize, 128256)
	setInt(&c.DefaultMaxTokens, 16)
	setInt(&c.DefaultChatMaxTokens, 256)
	setInt(&c.StreamInterval, 1)
	setInt(&c.MaxBodyBytes, 32<<20)
	setD(&c.StepOverhead, 300*time.Microsecond)
	setF(&c.WeightBytes, 15.0e9)
	setF(&c.KVBytesPerToken, 131072)
	setF(&c.MemBandwidth, 2.3e12)
	setF(&c.PrefillTokensPerSec, 20000)
	setD(&c.PrefillStepOverhead, 13*time.Millisecond)
	setF(&c.KVTransferBandwidth, 40e9)
	setD(&c.KVTransferLatency, time.Millisecond)
	setD(&c.KVHoldTimeout, 480*time.Second)
	setStr(&c.SideChannelHost, "127.0.0.1")
	setD(&c.BootstrapWaitTimeout, 30*time.Second)
	setInt(&c.TPSize, 1)
	setStr(&c.KVEventsHost, "127.0.0.1")
	setF(&c.CPUBandwidth, 25e9)
	if c.Faults.ErrorStatus == 0 {
		c.Faults.ErrorStatus = 500
	}
}

// Validate fills defaults and reports the first inconsistent field.
func (c *Config) Validate() error {
	c.fill()
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrConfig}, a...)...)
	}
	if _, err := ParseRole(string(c.Role)); err != nil {
		return err
	}
	switch {
	case c.TimeScale < 0 || math.IsNaN(c.TimeScale) || math.IsInf(c.TimeScale, 0):
		return bad("time scale %v must be positive", c.TimeScale)
	case c.BlockSize < 1:
		return bad("block size %d < 1", c.BlockSize)
	case c.NumGPUBlocks < 1:
		return bad("num GPU blocks %d < 1", c.NumGPUBlocks)
	case c.MaxModelLen < 2:
		return bad("max model len %d < 2", c.MaxModelLen)
	case c.MaxNumBatchedTokens < 1:
		return bad("max num batched tokens %d < 1", c.MaxNumBatchedTokens)
	case c.MaxNumSeqs < 1:
		return bad("max num seqs %d < 1", c.MaxNumSeqs)
	case c.MaxLoRAs < 0:
		return bad("max loras %d < 0", c.MaxLoRAs)
	case c.VocabSize < 2:
		return bad("vocab size %d < 2", c.VocabSize)
	case c.DefaultMaxTokens < 1 || c.DefaultChatMaxTokens < 1:
		return bad("default max tokens must be ≥ 1")
	case c.EOSProbability < 0 || c.EOSProbability > 1:
		return bad("EOS probability %v outside [0,1]", c.EOSProbability)
	case c.StreamInterval < 1:
		return bad("stream interval %d < 1", c.StreamInterval)
	case c.MaxBodyBytes < 1:
		return bad("max body bytes %d < 1", c.MaxBodyBytes)
	case c.StepOverhead < 0 || c.PrefillStepOverhead < 0 || c.KVTransferLatency < 0 || c.KVHoldTimeout < 0 ||
		c.BootstrapWaitTimeout < 0:
		return bad("durations must not be negative")
	case c.SideChannelPort < 0 || c.SideChannelPort > 65535:
		return bad("side channel port %d outside [0, 65535]", c.SideChannelPort)
	case c.WeightBytes < 0 || c.KVBytesPerToken < 0:
		return bad("byte sizes must not be negative")
	case c.MemBandwidth <= 0 || c.PrefillTokensPerSec <= 0 || c.KVTransferBandwidth <= 0 || c.CPUBandwidth <= 0:
		return bad("rates must be positive")
	case c.TPSize < 1:
		return bad("tp size %d < 1", c.TPSize)
	case c.KVEventsPort < -1 || c.KVEventsPort > 65535 || c.KVEventsReplayPort < -1 || c.KVEventsReplayPort > 65535:
		return bad("KV events ports %d and %d outside [-1, 65535]", c.KVEventsPort, c.KVEventsReplayPort)
	case c.KVEventsReplayPort != 0 && c.KVEventsPort == 0:
		return bad("KV events replay port %d without a KV events port", c.KVEventsReplayPort)
	case c.KVEventsReplayPort > 0 && c.KVEventsReplayPort == c.KVEventsPort:
		return bad("KV events port and replay port are both %d", c.KVEventsPort)
	case c.CPUBlocks < 0:
		return bad("CPU blocks %d < 0", c.CPUBlocks)
	}
	return c.Faults.validate()
}

// StepCost returns the modelled duration of one engine step that computes
// prefillTokens tokens of prompt chunks (uncached tokens only; 0 for a step
// where every sequence computes one token) while the scheduled sequences read contextTokens tokens of KV in
// total (each sequence's length after the step):
//
//	t = StepOverhead + (WeightBytes + contextTokens·KVBytesPerToken)/MemBandwidth
//	    + [prefillTokens > 0] · (PrefillStepOverhead + prefillTokens/PrefillTokensPerSec)
//
// With the defaults a decode step is 6.94 ms at batch 1 and 14.3 ms at batch
// 64 with 2,048-token contexts. c must have its defaults filled (Validate).
func (c *Config) StepCost(prefillTokens, contextTokens int) time.Duration {
	sec := (c.WeightBytes + float64(contextTokens)*c.KVBytesPerToken) / c.MemBandwidth
	d := c.StepOverhead + secs(sec)
	if prefillTokens > 0 {
		d += c.PrefillStepOverhead + secs(float64(prefillTokens)/c.PrefillTokensPerSec)
	}
	return d
}

// TransferCost returns the modelled time to pull tokens tokens of KV from a
// prefill pod.
func (c *Config) TransferCost(tokens int) time.Duration {
	return c.KVTransferLatency + secs(float64(tokens)*c.KVBytesPerToken/c.KVTransferBandwidth)
}

// CPUTransferCost returns the modelled time to copy tokens tokens of KV
// between the CPU tier and the GPU, either way.
func (c *Config) CPUTransferCost(tokens int) time.Duration {
	return secs(float64(tokens) * c.KVBytesPerToken / c.CPUBandwidth)
}

// forPod returns c as pod i of a fleet runs it: Seed+i, and the KV event
// ports +i when they are set (> 0), so that pods on one host do not clash.
func (c Config) forPod(i int) Config {
	c.Seed += uint64(i)
	if c.KVEventsPort > 0 {
		c.KVEventsPort += i
	}
	if c.KVEventsReplayPort > 0 {
		c.KVEventsReplayPort += i
	}
	return c
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
