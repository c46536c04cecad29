package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The CPU measurement runs the fleet in a child process (this test binary,
// re-executed with cpuChildEnv set) so that /proc/<pid>/stat counts the
// simulator alone, not the load generator.
//
//	KVSIM_CPU=1 go test -run TestCPUFleetStreams -v ./bench/sim/
//
// Knobs (environment): KVSIM_CPU_PODS (8), KVSIM_CPU_STREAMS per pod (256),
// KVSIM_CPU_SECONDS measured (10), KVSIM_CPU_SCALE time scale (1),
// KVSIM_CPU_INTERVAL stream interval (1), KVSIM_CPU_MAX_TOKENS (256).
const cpuChildEnv = "KVSIM_CPU_CHILD"

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
		return v
	}
	return def
}

// cpuChild serves the fleet, prints its URLs and exits when stdin closes.
// KVSIM_CPU_PROFILE=file writes a CPU profile of the child.
func cpuChild() {
	if path := os.Getenv("KVSIM_CPU_PROFILE"); path != "" {
		out, err := os.Create(path)
		if err == nil && pprof.StartCPUProfile(out) == nil {
			defer pprof.StopCPUProfile()
		}
	}
	f, err := StartFleet(envInt("KVSIM_CPU_PODS", 8), Config{
		TimeScale:      envFloat("KVSIM_CPU_SCALE", 1),
		StreamInterval: envInt("KVSIM_CPU_INTERVAL", 1),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, u := range f.URLs() {
		fmt.Println(u)
	}
	io.Copy(io.Discard, os.Stdin)
	f.Close()
}

// procCPU returns the user+system CPU time of a process.
func procCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the parenthesised command name; utime and stime are
	// fields 14 and 15 (1-based), in clock ticks of 1/100 s.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

func TestCPUFleetStreams(t *testing.T) {
	if os.Getenv("KVSIM_CPU") == "" {
		t.Skip("set KVSIM_CPU=1 to measure the simulator's CPU at 8 pods × 256 streams")
	}
	pods, streams := envInt("KVSIM_CPU_PODS", 8), envInt("KVSIM_CPU_STREAMS", 256)
	measure := time.Duration(envInt("KVSIM_CPU_SECONDS", 10)) * time.Second
	maxTokens := envInt("KVSIM_CPU_MAX_TOKENS", 256)

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), cpuChildEnv+"=1")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		cmd.Wait()
	}()
	sc := bufio.NewScanner(stdout)
	var urls []string
	for len(urls) < pods && sc.Scan() {
		urls = append(urls, sc.Text())
	}
	if len(urls) != pods {
		t.Fatalf("child printed %d URLs", len(urls))
	}

	ids, _ := json.Marshal(tokenPrompt(1, 128))
	body := fmt.Sprintf(`{"prompt":%s,"max_tokens":%d,"ignore_eos":true,"stream":true}`, ids, maxTokens)
	var stop atomic.Bool
	var completed atomic.Int64
	var wg sync.WaitGroup
	for _, u := range urls {
		addr := strings.TrimPrefix(u, "http://")
		req := []byte(fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", addr, len(body), body))
		for range streams {
			wg.Go(func() {
				conn, err := net.Dial("tcp", addr)
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close()
				buf := make([]byte, 64<<10)
				end := []byte("\r\n0\r\n\r\n")
				for !stop.Load() {
					if _, err := conn.Write(req); err != nil {
						t.Error(err)
						return
					}
					var tail []byte
					for {
						n, err := conn.Read(buf)
						if err != nil {
							if !stop.Load() {
								t.Error(err)
							}
							return
						}
						tail = append(tail, buf[:n]...)
						if len(tail) > 16 {
							tail = tail[len(tail)-16:]
						}
						if bytes.HasSuffix(tail, end) {
							break
						}
					}
					completed.Add(1)
				}
			})
		}
	}
	c := &http.Client{}
	genTokens := func() float64 {
		var sum float64
		for _, u := range urls {
			sum += metricValue(t, scrape(t, c, u), "vllm:generation_tokens_total")
		}
		return sum
	}
	warm := 3 * time.Second
	time.Sleep(warm) // let every stream reach steady state
	cpu0, tok0, t0 := procCPU(t, cmd.Process.Pid), genTokens(), time.Now()
	time.Sleep(measure)
	cpu1, tok1, t1 := procCPU(t, cmd.Process.Pid), genTokens(), time.Now()
	stop.Store(true)
	stdin.Close() // the child closes the pods, which cuts the streams
	wg.Wait()

	wall := t1.Sub(t0)
	cpu := cpu1 - cpu0
	tokens := tok1 - tok0
	t.Logf("%d pods × %d streams, max_tokens %d, time scale %v, stream interval %d",
		pods, streams, maxTokens, envFloat("KVSIM_CPU_SCALE", 1), envInt("KVSIM_CPU_INTERVAL", 1))
	t.Logf("simulator CPU %.2fs over %.1fs wall = %.2f cores; %.0f tokens/s streamed; %.2f µs CPU per token; %d responses completed",
		cpu.Seconds(), wall.Seconds(), cpu.Seconds()/wall.Seconds(), tokens/wall.Seconds(),
		float64(cpu.Microseconds())/tokens, completed.Load())
}
