package discovery

import (
	"compress/gzip"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The real engines of ../shared/engines (see their READMEs): llama.cpp's
// llama-server and Ollama, each with a tiny random-weight Llama. Tests
// decompress them into the module's bin/ (gitignored) and skip when the
// directory is absent.

// findUp returns dir/rel for the first of dir and its ancestors where it
// exists, "" if none (as bench/llmd finds the llm-d simulator).
func findUp(dir, rel string) string {
	for {
		p := filepath.Join(dir, rel)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// engineFiles returns shared/engines and the module's bin/, skipping the
// test when shared/engines is not above the working directory.
func engineFiles(t *testing.T) (shared, bin string) {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	shared = findUp(wd, filepath.Join("shared", "engines"))
	if shared == "" {
		t.Skipf("no shared/engines above %s: the real llama-server and Ollama are not at hand", wd)
	}
	mod := findUp(wd, "go.mod")
	if mod == "" {
		t.Fatalf("no go.mod above %s", wd)
	}
	bin = filepath.Join(filepath.Dir(mod), "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	return shared, bin
}

// gunzip decompresses gz to dst (mode perm) unless dst is at least as new
// as gz; it writes a temporary file and renames it, so that concurrent
// test binaries never run a half-written one.
func gunzip(t *testing.T, gz, dst string, perm os.FileMode) {
	t.Helper()
	src, err := os.Stat(gz)
	if err != nil {
		t.Skipf("%s: %v", gz, err)
	}
	if d, err := os.Stat(dst); err == nil && !d.ModTime().Before(src.ModTime()) {
		return
	}
	in, err := os.Open(gz)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	zr, err := gzip.NewReader(in)
	if err != nil {
		t.Fatal(err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".*")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, zr); err != nil {
		t.Fatal(err)
	}
	if err := errorsJoin(tmp.Chmod(perm), tmp.Close(), os.Rename(tmp.Name(), dst)); err != nil {
		t.Fatal(err)
	}
}

func errorsJoin(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// freePort returns a loopback port nobody listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startProcess runs cmd in its own process group until the test ends,
// then kills the group (Ollama's serve spawns a runner child). Its output
// goes to a file shown when the test fails.
func startProcess(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	out, err := os.Create(filepath.Join(t.TempDir(), "engine.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(out.Name())
			t.Logf("%s output (tail):\n%s", filepath.Base(cmd.Path), tail(b, 2000))
		}
		out.Close()
	})
}

func tail(b []byte, n int) []byte { return b[max(0, len(b)-n):] }

// startLlamaServer starts llama-server with the tiny model (with
// --metrics when metrics) and returns its base URL.
func startLlamaServer(t *testing.T, metrics bool) string {
	t.Helper()
	shared, bin := engineFiles(t)
	exe, model := filepath.Join(bin, "llama-server"), filepath.Join(bin, "tiny.gguf")
	gunzip(t, filepath.Join(shared, "llama.cpp", "llama-server.gz"), exe, 0o755)
	gunzip(t, filepath.Join(shared, "llama.cpp", "tiny.gguf.gz"), model, 0o644)
	port := freePort(t)
	args := []string{"-m", model, "--alias", "tiny", "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"-t", "1", "-c", "8192", "--cache-ram", "64"}
	if metrics {
		args = append(args, "--metrics")
	}
	startProcess(t, exec.Command(exe, args...))
	return "http://127.0.0.1:" + strconv.Itoa(port)
}

// startOllama starts `ollama serve` over the tiny model's store and
// returns its base URL.
func startOllama(t *testing.T) string {
	t.Helper()
	shared, bin := engineFiles(t)
	exe, store := filepath.Join(bin, "ollama"), filepath.Join(bin, "ollama-store")
	gunzip(t, filepath.Join(shared, "ollama", "ollama.gz"), exe, 0o755)
	if _, err := os.Stat(filepath.Join(store, "manifests")); err != nil {
		if err := os.MkdirAll(store, 0o755); err != nil {
			t.Fatal(err)
		}
		tar := exec.Command("tar", "xzf", filepath.Join(shared, "ollama", "tiny-model.tar.gz"), "-C", store)
		if out, err := tar.CombinedOutput(); err != nil {
			t.Fatalf("unpacking the Ollama model store: %v: %s", err, out)
		}
	}
	port := freePort(t)
	cmd := exec.Command(exe, "serve")
	cmd.Env = append(os.Environ(), "HOME="+bin, "OLLAMA_MODELS="+store, "OLLAMA_HOST=127.0.0.1:"+strconv.Itoa(port),
		"OLLAMA_KEEP_ALIVE=-1", "OLLAMA_FLASH_ATTENTION=0", "OLLAMA_NUM_PARALLEL=1")
	startProcess(t, cmd)
	return "http://127.0.0.1:" + strconv.Itoa(port)
}

// realOptions probes every 50 ms (the engines are real processes on a
// shared machine) and scrapes and reads models as often.
func realOptions() Options {
	return Options{
		Health: HealthConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, Jitter: 0.01},
		Scrape: ScrapeConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, StaleAfter: time.Minute},
		Models: ModelsConfig{Interval: 50 * time.Millisecond, Timeout: 2 * time.Second},
	}
}

// TestRealLlamaServer: a Fleet over the real llama-server, with and
// without --metrics, detects llama.cpp, keeps it up, reads its slots and
// context, serves any model name, and scrapes its load only when it
// exports metrics, without a failed scrape when it does not.
func TestRealLlamaServer(t *testing.T) {
	for _, metrics := range []bool{true, false} {
		t.Run("metrics="+strconv.FormatBool(metrics), func(t *testing.T) {
			url := startLlamaServer(t, metrics)
			f, rec, eps := staticFleet(t, realOptions(), url)
			e := eps[0]
			run(t, f)
			want := "absent"
			if metrics {
				want = "scraped"
			}
			rec.until(t, "llama.cpp detected, its props read, its metrics settled", func() bool {
				i := e.Info()
				return e.Dialect() == DialectLlamaCpp && i != nil && i.Slots > 0 && statusOf(f, e).Metrics == want
			})
			from := rec.mark()
			rec.wait(t, from, "probe-ok", e, 3)
			st := statusOf(f, e)
			if st.State != StateUp || st.Info.Slots != 4 || st.Info.ContextTokens != 8192 || st.Info.KVCapacityTokens != 8192 {
				t.Errorf("state %v, info %+v: want up, 4 slots, 8192 tokens", st.State, st.Info)
			}
			if !e.Serves("tiny") || !e.Serves("gpt-4o") {
				t.Error("llama-server serves any model name")
			}
			if n := rec.count(from, "scrape-fail", e) + rec.count(from, "probe-fail", e); n != 0 {
				t.Errorf("%d failed scrapes or probes once up, want none", n)
			}
			if s := e.Engine(); metrics != (s != nil) || s != nil && s.Engine != "llamacpp" {
				t.Errorf("engine stats %+v with metrics=%v", s, metrics)
			}
		})
	}
}

// TestRealOllama: a Fleet over a real Ollama server detects it, keeps it
// up although it has no /health, never fails a scrape, serves the spellings
// of its model Ollama accepts, and reads the loaded model's context.
func TestRealOllama(t *testing.T) {
	url := startOllama(t)
	f, rec, eps := staticFleet(t, realOptions(), url)
	e := eps[0]
	run(t, f)
	rec.until(t, "ollama detected, its models read", func() bool {
		return e.Dialect() == DialectOllama && e.Models() != nil
	})
	from := rec.mark()
	rec.wait(t, from, "probe-ok", e, 3)
	for m, want := range map[string]bool{"tiny": true, "TINY": true, "tiny:latest": true, "library/tiny": true, "nope": false} {
		if e.Serves(m) != want {
			t.Errorf("Serves(%q) = %v, want %v", m, !want, want)
		}
	}
	// The first request loads the model; /api/ps then states its context.
	resp, err := http.Post(url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"TINY","prompt":"hello","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion for TINY: %s", resp.Status)
	}
	rec.until(t, "the loaded model's context read", func() bool {
		i := e.Info()
		return i != nil && i.ContextTokens > 0
	})
	st := statusOf(f, e)
	if st.State != StateUp || st.Metrics != "absent" || st.Info.ContextTokens != 4096 || st.Info.Version != "0.24.0" {
		t.Errorf("status %+v, info %+v: want up, no metrics, context 4096, version 0.24.0", st, st.Info)
	}
	if n := rec.count(from, "scrape-fail", e) + rec.count(from, "probe-fail", e); n != 0 {
		t.Errorf("%d failed scrapes or probes once up, want none", n)
	}
}
