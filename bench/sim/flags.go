package sim

import (
	"time"

	"github.com/spf13/pflag"
)

// BindFlags registers one flag per Config field on fs, with c's current
// values (fill them with DefaultConfig first) as defaults. Role is bound as
// a string by the caller (see ParseRole); OnStep has no flag. The KV event
// ports are pod 0's: a fleet adds i for pod i (Profile.Configs).
func (c *Config) BindFlags(fs *pflag.FlagSet) {
	fs.StringVar(&c.Model, "model", c.Model, "served model name")
	fs.StringSliceVar(&c.LoRAs, "lora-modules", c.LoRAs, "names of LoRA adapters loaded on the model (requests may name them; /v1/models lists them)")
	fs.IntVar(&c.MaxLoRAs, "max-loras", c.MaxLoRAs, "adapters with requests in one batch, as vLLM's --max-loras (default 1 with --lora-modules); vllm:lora_requests_info shows the running and waiting ones")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "seed for ids, synthetic text, EOS and fault draws (pod i uses seed+i)")
	fs.StringVar(&c.EngineID, "engine-id", c.EngineID, "NixlConnector engine id (default: derived from seed and start time)")
	fs.Float64Var(&c.TimeScale, "time-scale", c.TimeScale, "run this many times faster than modelled real time")

	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "KV block size in tokens")
	fs.IntVar(&c.NumGPUBlocks, "num-gpu-blocks", c.NumGPUBlocks, "KV capacity in blocks")
	fs.IntVar(&c.MaxModelLen, "max-model-len", c.MaxModelLen, "max prompt+completion tokens per sequence")
	fs.IntVar(&c.MaxNumBatchedTokens, "max-num-batched-tokens", c.MaxNumBatchedTokens, "token budget per engine step")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "max sequences in the running batch")
	fs.IntVar(&c.VocabSize, "vocab-size", c.VocabSize, "vocabulary size (token ids must be below it)")
	fs.IntVar(&c.DefaultMaxTokens, "default-max-tokens", c.DefaultMaxTokens, "max_tokens of /v1/completions when absent")
	fs.IntVar(&c.DefaultChatMaxTokens, "default-chat-max-tokens", c.DefaultChatMaxTokens, "max_tokens of /v1/chat/completions when absent")
	fs.Float64Var(&c.EOSProbability, "eos-probability", c.EOSProbability, "per-token seeded EOS probability unless ignore_eos (0: always max_tokens)")
	fs.IntVar(&c.StreamInterval, "stream-interval", c.StreamInterval, "tokens per streamed delta")
	fs.IntVar(&c.MaxBodyBytes, "max-body-bytes", c.MaxBodyBytes, "max request body size")

	fs.DurationVar(&c.StepOverhead, "step-overhead", c.StepOverhead, "modelled fixed cost of every engine step (t0)")
	fs.Float64Var(&c.WeightBytes, "weight-bytes", c.WeightBytes, "weight bytes read per step")
	fs.Float64Var(&c.KVBytesPerToken, "kv-bytes-per-token", c.KVBytesPerToken, "KV cache bytes per token")
	fs.Float64Var(&c.MemBandwidth, "mem-bandwidth", c.MemBandwidth, "effective HBM bandwidth, bytes/s")
	fs.Float64Var(&c.PrefillTokensPerSec, "prefill-tokens-per-sec", c.PrefillTokensPerSec, "prefill compute rate, tokens/s")
	fs.DurationVar(&c.PrefillStepOverhead, "prefill-step-overhead", c.PrefillStepOverhead, "modelled extra cost of a step that computes prompt chunks")
	fs.Float64Var(&c.KVTransferBandwidth, "kv-transfer-bandwidth", c.KVTransferBandwidth, "prefill→decode KV pull rate, bytes/s")
	fs.DurationVar(&c.KVTransferLatency, "kv-transfer-latency", c.KVTransferLatency, "modelled fixed cost of one KV pull")
	fs.DurationVar(&c.KVHoldTimeout, "kv-hold-timeout", c.KVHoldTimeout, "modelled time a prefill pod holds unpulled KV")
	fs.StringVar(&c.SideChannelHost, "side-channel-host", c.SideChannelHost, "address of the KV side channel (remote_host)")
	fs.IntVar(&c.SideChannelPort, "side-channel-port", c.SideChannelPort, "port of the KV side channel and SGLang bootstrap server (SGLang: 8998; 0: a free port)")
	fs.DurationVar(&c.BootstrapWaitTimeout, "bootstrap-wait-timeout", c.BootstrapWaitTimeout, "how long a prefill pod's bootstrap server waits for an unknown room (wall time)")
	fs.IntVar(&c.TPSize, "tp-size", c.TPSize, "tp_size reported in kv_transfer_params")

	fs.IntVar(&c.KVEventsPort, "kv-events-port", c.KVEventsPort, "port of a ZeroMQ PUB socket publishing KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) as vLLM's --kv-events-config (vLLM's endpoint: tcp://*:5557); pod i of a fleet binds port+i (0: off, -1: a free port)")
	fs.IntVar(&c.KVEventsReplayPort, "kv-events-replay-port", c.KVEventsReplayPort, "port of a ZeroMQ ROUTER socket replaying the last 10,000 event batches from a requested sequence number, as vLLM's replay_endpoint; pod i binds port+i (0: off, -1: a free port)")
	fs.StringVar(&c.KVEventsHost, "kv-events-host", c.KVEventsHost, "address the KV event sockets bind")
	fs.StringVar(&c.KVEventsTopic, "kv-events-topic", c.KVEventsTopic, `topic frame of every KV event message (vLLM's default: ""); {addr} becomes the pod's HTTP host:port and {model} its model, so "kv@{addr}@{model}" is llm-d's kv@<ip>:<port>@<model>`)
	fs.BoolVar(&c.KVEventsArrayEncoding, "kv-events-array-encoding", c.KVEventsArrayEncoding, "encode KV event batches as positional msgpack arrays, type tag first (vLLM before mid-2026), instead of maps with a \"type\" key")
	fs.IntVar(&c.CPUBlocks, "cpu-blocks", c.CPUBlocks, "blocks of a CPU KV tier as vLLM's OffloadingConnector (--kv-offloading-size): computed blocks are copied to CPU memory (LRU) and a GPU prefix miss loads them back at --cpu-bandwidth instead of recomputing (0: off)")
	fs.Float64Var(&c.CPUBandwidth, "cpu-bandwidth", c.CPUBandwidth, "GPU↔CPU KV copy rate of the CPU tier, bytes/s")

	fs.Float64Var(&c.Faults.ErrorRate, "fault-error-rate", c.Faults.ErrorRate, "fraction of inference requests failed with --fault-error-status")
	fs.IntVar(&c.Faults.ErrorStatus, "fault-error-status", c.Faults.ErrorStatus, "status of injected failures")
	fs.DurationVar((*time.Duration)(&c.Faults.StallFirstByte), "fault-stall-first-byte", time.Duration(c.Faults.StallFirstByte), "delay every inference request before its first byte (wall time)")
	fs.BoolVar(&c.Faults.StallUntilRelease, "fault-stall-until-release", c.Faults.StallUntilRelease, "hold inference requests until POST /sim/release")
	fs.IntVar(&c.Faults.DropAfterTokens, "fault-drop-after-tokens", c.Faults.DropAfterTokens, "cut streaming connections after this many tokens (0: off)")
	fs.DurationVar((*time.Duration)(&c.Faults.StartupDelay), "fault-startup-delay", time.Duration(c.Faults.StartupDelay), "answer /health 503 for this long after start (wall time)")
	fs.BoolVar(&c.Faults.HealthFail, "fault-health-fail", c.Faults.HealthFail, "answer /health 503")
}
