// Package proc runs engines nobody here wrote as local processes for
// kvbench: it finds their binaries and data in the workplace's
// shared/engines (an ancestor of the working directory holds shared/),
// unpacks them into the module's bin/ (gitignored) safely for several
// processes at once, and owns one server's process group on a loopback
// port: its start, its readiness and its stop. Which command line a server
// gets is the engine's package's (bench/llmd, bench/localengine).
package proc

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrNotFound is wrapped when an engine's archive is under no ancestor's
// shared/engines (a user's clone has no ../shared).
var ErrNotFound = errors.New("proc: not found under shared/engines")

// ErrStart is wrapped by errors starting a server or waiting for it.
var ErrStart = errors.New("proc: server did not start")

// Shared is where the workplace keeps the engines, relative to an
// ancestor of the working directory.
var Shared = filepath.Join("shared", "engines")

// Archive returns the path of rel (e.g. "llama.cpp/llama-server.gz") under
// the first ancestor of the working directory that has shared/engines/rel,
// or an error wrapping ErrNotFound.
func Archive(rel string) (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	p := findUp(wd, filepath.Join(Shared, rel))
	if p == "" {
		return "", fmt.Errorf("%w: no %s above %s", ErrNotFound, filepath.Join(Shared, rel), wd)
	}
	return p, nil
}

// BinDir returns the module's bin/ (beside the go.mod above the working
// directory), where unpacked engines go; it is not created.
func BinDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	root := findUp(wd, "go.mod")
	if root == "" {
		return "", fmt.Errorf("%w: no go.mod above %s to put bin/ beside", ErrNotFound, wd)
	}
	return filepath.Join(filepath.Dir(root), "bin"), nil
}

// Gunzip returns bin/name, decompressed there from shared/engines/rel
// (see Archive) when missing or older than the archive, executable. Safe
// to call from several processes at once: the file is written to a
// temporary file and renamed.
func Gunzip(rel, name string) (string, error) {
	gz, err := Archive(rel)
	if err != nil {
		return "", err
	}
	bin, err := BinDir()
	if err != nil {
		return "", err
	}
	dst := filepath.Join(bin, name)
	if fresh(dst, gz) {
		return dst, nil
	}
	return dst, decompress(gz, dst)
}

// Untar returns bin/dir, the tar.gz shared/engines/rel (see Archive)
// extracted there when missing or older than the archive. Safe to call
// from several processes at once: it is extracted into a temporary
// directory and renamed; when another process renamed its own first, that
// one is kept.
func Untar(rel, dir string) (string, error) {
	tgz, err := Archive(rel)
	if err != nil {
		return "", err
	}
	bin, err := BinDir()
	if err != nil {
		return "", err
	}
	dst := filepath.Join(bin, dir)
	if fresh(dst, tgz) {
		return dst, nil
	}
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(bin, dir+".*")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp) // empty after a successful rename
	if err := extract(tgz, tmp); err != nil {
		return "", fmt.Errorf("proc: extract %s: %w", tgz, err)
	}
	_ = os.RemoveAll(dst) // stale
	if err := os.Rename(tmp, dst); err != nil && !fresh(dst, tgz) {
		return "", fmt.Errorf("proc: extract %s: %w", tgz, err)
	}
	return dst, nil
}

// extract writes the regular files and directories of the tar.gz src
// under dir, refusing paths that leave it.
func extract(src, dir string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return err
	}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		p := filepath.Join(dir, h.Name)
		if !strings.HasPrefix(p, filepath.Clean(dir)+string(os.PathSeparator)) {
			return fmt.Errorf("%s leaves the directory", h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			err = writeFile(p, tr, os.FileMode(h.Mode).Perm()|0o600)
		}
		if err != nil {
			return err
		}
	}
}

// writeFile writes r to path (its directory created) with mode perm.
func writeFile(path string, r io.Reader, perm os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, r)
	return errors.Join(err, out.Close())
}

// findUp returns dir/rel for the first of dir and its ancestors where it
// exists, "" if none.
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

// fresh reports whether dst exists and is not older than src.
func fresh(dst, src string) bool {
	d, err := os.Stat(dst)
	if err != nil {
		return false
	}
	s, err := os.Stat(src)
	return err == nil && !d.ModTime().Before(s.ModTime())
}

// decompress writes the gunzipped src to dst, executable, through a
// temporary file in dst's directory.
func decompress(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	zr, err := gzip.NewReader(in)
	if err != nil {
		return fmt.Errorf("proc: %s: %w", src, err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".*")
	if err != nil {
		return err
	}
	_, err = io.Copy(tmp, zr)
	err = errors.Join(err, tmp.Chmod(0o755), tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), dst)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("proc: decompress %s: %w", src, err)
	}
	return nil
}

// FreePort returns a loopback port whose TCP and UDP twins were both free
// a moment ago, chosen at random below Linux's ephemeral range (32768 and
// up): a port the kernel handed out and took back can go to the next
// outgoing connection of any process before the server binds it, which
// once failed a test run with "address already in use". Memberlist binds
// both TCP and UDP on its port. Nor does it hand out a port it handed out
// lately: a caller may take several before it binds any (a replica set's
// gossip addresses), and a port free again after its check can come up
// again (eight replicas' gossip got one port twice, and the run failed
// with "address already in use").
func FreePort() (int, error) {
	given.Lock()
	defer given.Unlock()
	for range 200 {
		port := 20000 + rand.IntN(12000)
		if slices.Contains(given.ports[:], port) {
			continue
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		pc, err := net.ListenPacket("udp", addr)
		ln.Close()
		if err != nil {
			continue
		}
		pc.Close()
		given.ports[given.next%len(given.ports)] = port
		given.next++
		return port, nil
	}
	return 0, errors.New("proc: no free loopback port in 20000–32000")
}

// given are the ports FreePort handed out last.
var given struct {
	sync.Mutex
	ports [1024]int
	next  int
}

// FreeLoopback is FreePort as a host:port address on 127.0.0.1.
func FreeLoopback() (string, error) {
	port, err := FreePort()
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), nil
}

// Process is one running server: a process started in a process group of
// its own (with the children it spawns, such as Ollama's runner), its
// output's tail kept for error messages. Its methods are safe for
// concurrent use; Stop and Kill may be called more than once.
type Process struct {
	// URL is the server's base URL (http://127.0.0.1:port).
	URL  string
	cmd  *exec.Cmd
	out  *tail
	done chan struct{}
	err  error // Wait's, set before done closes
}

// Start starts cmd (its Stdout, Stderr and SysProcAttr are set here) as
// the server at url, in a new process group.
func Start(url string, cmd *exec.Cmd) (*Process, error) {
	out := &tail{max: 4 << 10}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrStart, cmd.Path, err)
	}
	p := &Process{URL: url, cmd: cmd, out: out, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

// WaitReady polls GET URL+path every 20 ms until it answers 200, the
// process exits or timeout (or ctx) ends.
func (p *Process) WaitReady(ctx context.Context, path string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc := &http.Client{Timeout: time.Second}
	defer hc.CloseIdleConnections()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+path, nil)
		if resp, err := hc.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.done:
			return fmt.Errorf("%w: %s exited (%v): %s", ErrStart, p.URL, p.err, p.out.String())
		case <-ctx.Done():
			return fmt.Errorf("%w: %s not ready on %s: %v: %s", ErrStart, p.URL, path, ctx.Err(), p.out.String())
		case <-t.C:
		}
	}
}

// Pid returns the process's id, also its process group's.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Output returns the last 4 KiB of the process's output.
func (p *Process) Output() string { return p.out.String() }

// Kill kills the process group at once (SIGKILL: connections reset, as
// when a node dies) and waits for the process.
func (p *Process) Kill() error {
	err := syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
	if errors.Is(err, syscall.ESRCH) {
		err = nil
	}
	return err
}

// Stop sends SIGTERM to the process group, and SIGKILL after grace, and
// waits for the process; it reports a kill.
func (p *Process) Stop(grace time.Duration) error {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
		// Children that outlived their parent go with the group.
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		return nil
	case <-time.After(grace):
		_ = p.Kill()
		return fmt.Errorf("proc: %s killed after %s", p.URL, grace)
	}
}

// Lingering reports whether a process of p's group is still alive after
// wait, polled every 10 ms: after Stop or Kill none should be (an orphan
// killed with its group is reaped by init a moment later, a zombie till
// then, which does not count). Linux only (/proc); elsewhere it reports
// false once the process group is empty.
func (p *Process) Lingering(wait time.Duration) bool {
	pgid := p.Pid()
	for deadline := time.Now().Add(wait); ; time.Sleep(10 * time.Millisecond) {
		if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) || onlyZombies(pgid) {
			return false
		}
		if time.Now().After(deadline) {
			return true
		}
	}
}

// onlyZombies reports whether every process of group pgid in /proc is a
// zombie (dead, waiting for its parent to reap it).
func onlyZombies(pgid int) bool {
	ds, err := os.ReadDir("/proc")
	if err != nil {
		return false
	}
	for _, d := range ds {
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...: comm may hold spaces.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 2 && f[2] == strconv.Itoa(pgid) && f[0] != "Z" {
			return false
		}
	}
	return true
}

// StopAll stops every process at once (see Stop) and waits for them all.
func StopAll(ps []*Process, grace time.Duration) error {
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() { errs[i] = p.Stop(grace) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// tail keeps the last max bytes written to it (a process's output, for
// error messages). Safe for concurrent use.
type tail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = t.b[over:]
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(bytes.TrimSpace(t.b))
}

// WholeBody wraps h, a reverse proxy in front of loopback servers, so that
// it passes each request on with its body read whole first: Go's HTTP/1
// server closes an inbound body once the answer's headers are written, and
// a transport still reading it then drops its connection upstream in the
// middle of the answer (golang/go#40747; a truncated stream in
// TestRollingUpdate). A body that cannot be read gets 400.
func WholeBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		h.ServeHTTP(w, r)
	})
}
