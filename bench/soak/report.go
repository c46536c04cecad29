package soak

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// RequestSummary counts the requests of a run by outcome.
type RequestSummary struct {
	Sent       int
	OK         int
	Failed     int            // clear errors: status or SSE error event
	Statuses   map[int]int    // clear error statuses
	Abandoned  int            // by the client on purpose (and interrupted)
	Cut        int            // truncated because the pod cut the stream
	CutBy      map[string]int // by cut reason
	Lost       int            // the rest of the truncated, refused, timed-out, malformed
	LostBy     map[string]int // by outcome
	LostIDs    []string       // the first few
	Skipped    int
	OKShare    float64        // OK ÷ (sent − abandoned)
	PodCuts    map[string]int // cuts the pods' connections saw, by reason
	ByKind     map[string]*KindCount
	StreamSent int
}

// KindCount is one traffic kind's outcomes.
type KindCount struct{ Sent, OK, Failed, Abandoned, Cut, Lost int }

// maxLostIDs bounds the ids listed.
const maxLostIDs = 20

func summarize(recs []Record, podCuts map[string]int) RequestSummary {
	s := RequestSummary{Statuses: map[int]int{}, CutBy: map[string]int{}, LostBy: map[string]int{}, PodCuts: podCuts,
		ByKind: map[string]*KindCount{}}
	for _, r := range recs {
		k := s.ByKind[r.Kind]
		if k == nil {
			k = &KindCount{}
			s.ByKind[r.Kind] = k
		}
		s.Sent++
		k.Sent++
		if r.Stream {
			s.StreamSent++
		}
		switch {
		case r.Outcome == OutcomeOK:
			s.OK++
			k.OK++
		case r.Outcome == OutcomeStatus || r.Outcome == OutcomeStreamError:
			s.Failed++
			k.Failed++
			s.Statuses[r.Status]++
		case r.Outcome == OutcomeAbandoned || r.Outcome == OutcomeInterrupted:
			s.Abandoned++
			k.Abandoned++
		case r.Cut != "":
			s.Cut++
			k.Cut++
			s.CutBy[r.Cut]++
		default:
			s.Lost++
			k.Lost++
			s.LostBy[r.Outcome]++
			if len(s.LostIDs) < maxLostIDs {
				s.LostIDs = append(s.LostIDs, r.ID)
			}
		}
	}
	if n := s.Sent - s.Abandoned; n > 0 {
		s.OKShare = float64(s.OK) / float64(n)
	}
	return s
}

// LogSummary is what kvroute's log says.
type LogSummary struct {
	Lines, Warn, Error int
	Panics             int
	DrainIncomplete    bool
	BodyFailures       int // "upstream body failed": a stream cut by its endpoint
	ClientClosed       int // "client closed the connection"
	// Own maps the request id of each error kvroute answered itself
	// ("request failed") to its error.
	Own map[string]string
}

// podURL hides the pods' ports, so errors group across pods.
var podURL = regexp.MustCompile(`(https?://)?127\.0\.0\.1:\d+`)

func analyzeLog(path string) LogSummary {
	var s LogSummary
	f, err := os.Open(path)
	if err != nil {
		return s
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		l := sc.Bytes()
		s.Lines++
		switch {
		case bytes.Contains(l, []byte(`"level":"warn"`)):
			s.Warn++
		case bytes.Contains(l, []byte(`"level":"error"`)):
			s.Error++
		}
		if bytes.Contains(l, []byte("panic")) {
			s.Panics++
		}
		if bytes.Contains(l, []byte("drain incomplete")) {
			s.DrainIncomplete = true
		}
		if bytes.Contains(l, []byte("upstream body failed")) {
			s.BodyFailures++
		}
		if bytes.Contains(l, []byte("client closed the connection")) {
			s.ClientClosed++
		}
		if bytes.Contains(l, []byte(`"msg":"request failed"`)) {
			var e struct {
				ID    string `json:"request_id"`
				Error string `json:"error"`
			}
			if json.Unmarshal(l, &e) == nil && e.ID != "" {
				if s.Own == nil {
					s.Own = map[string]string{}
				}
				s.Own[e.ID] = podURL.ReplaceAllString(e.Error, "<pod>")
			}
		}
	}
	return s
}

// FailureGroup is the clear failures of one status and source.
type FailureGroup struct {
	Status int
	Source string // "pod" (passed on) or kvroute's own error
	Count  int
	// Reached counts the group's requests some pod read.
	Reached int
	IDs     []string // the first few
}

// failureGroups groups the clear failures by status and source, kvroute's
// own answers told from the pods' by its log.
func failureGroups(recs []Record, own map[string]string) []FailureGroup {
	idx := map[string]int{}
	var out []FailureGroup
	for _, r := range recs {
		if r.Outcome != OutcomeStatus && r.Outcome != OutcomeStreamError {
			continue
		}
		src := "passed on from the pod"
		if e, ok := own[r.ID]; ok {
			src = "kvroute: " + e
		} else if r.Outcome == OutcomeStreamError {
			src = "SSE error event"
		}
		key := strconv.Itoa(r.Status) + " " + src
		i, ok := idx[key]
		if !ok {
			i = len(out)
			idx[key] = i
			out = append(out, FailureGroup{Status: r.Status, Source: src})
		}
		out[i].Count++
		if r.Reached > 0 {
			out[i].Reached++
		}
		if len(out[i].IDs) < 5 {
			out[i].IDs = append(out[i].IDs, r.ID)
		}
	}
	slices.SortFunc(out, func(a, b FailureGroup) int { return b.Count - a.Count })
	return out
}

// write writes the CSV files, the chart and the Markdown report.
func (res *Result) write() error {
	out := res.Config.Out
	create := func(name string, fill func(io.Writer) error) error {
		path := filepath.Join(out, name)
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		if err := fill(f); err != nil {
			f.Close()
			return err
		}
		res.Files = append(res.Files, path)
		return f.Close()
	}
	if err := create(FileCSV, func(w io.Writer) error { return WriteCSV(w, res.Samples) }); err != nil {
		return err
	}
	if err := create(FileFaults, func(w io.Writer) error { return writeFaults(w, res.Faults, res.PodURLs) }); err != nil {
		return err
	}
	if err := create(FileRequests, func(w io.Writer) error { return writeRequests(w, res.Records) }); err != nil {
		return err
	}
	chart := filepath.Join(out, FileChart)
	if err := WriteChart(chart, res.Samples, res.Checks, res.WarmupEnd, res.Faults); err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	res.Files = append(res.Files, chart)
	res.Files = append(res.Files, filepath.Join(out, FileLog))
	return create(FileReport, res.markdown)
}

// Verdict is the one-line verdict.
func (res *Result) Verdict() string {
	if res.Flat {
		return "FLAT"
	}
	return "NOT FLAT"
}

// WriteSummary prints the table and the problems for a terminal.
func (res *Result) WriteSummary(w io.Writer) {
	WriteTable(w, res.Checks)
	rq := res.Requests
	fmt.Fprintf(w, "\nrequests: %d sent, %d ok, %d failed clearly %v, %d abandoned by the client, %d cut by their pod %v, %d lost %v, %d skipped\n",
		rq.Sent, rq.OK, rq.Failed, statusList(rq.Statuses), rq.Abandoned, rq.Cut, reasonList(rq.CutBy), rq.Lost, reasonList(rq.LostBy), rq.Skipped)
	for _, g := range failureGroups(res.Records, res.Log.Own) {
		fmt.Fprintf(w, "  %d × %d, %s; %d reached a pod (%s)\n", g.Count, g.Status, g.Source, g.Reached, strings.Join(g.IDs, ", "))
	}
	sd := res.Shutdown
	fmt.Fprintf(w, "shutdown: in-flight 0 after %.1f s; SIGTERM → exit %d after %.0f ms\n", sd.DrainSeconds, sd.ExitCode, 1e3*sd.ExitSeconds)
	fmt.Fprintf(w, "kvsoak's own CPU (pods and client): %.2f cores\n", res.SelfCores)
	for _, n := range res.Notes {
		fmt.Fprintln(w, "note:", n)
	}
	for _, p := range res.Problems {
		fmt.Fprintln(w, "PROBLEM:", p)
	}
	fmt.Fprintf(w, "verdict: %s\n", res.Verdict())
}

func statusList(m map[int]int) string {
	keys := slices.Sorted(maps.Keys(m))
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d×%d", m[k], k))
	}
	return "[" + strings.Join(parts, " ") + "]"
}

func reasonList(m map[string]int) string {
	keys := slices.Sorted(maps.Keys(m))
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func (res *Result) markdown(w io.Writer) error {
	cfg := res.Config
	p := func(format string, a ...any) { fmt.Fprintf(w, format+"\n", a...) }
	p("# kvroute soak: %s", res.Verdict())
	p("")
	p("%s; %s of load at %g requests/s (Poisson) through `%s` in front of %d simulated pods (h100-8b, %d KV blocks each); samples every %s; warm-up %.0f s (%.0f%%); faults %s.",
		res.Started.Format(time.RFC3339), cfg.Duration, cfg.Rate, cfg.KVRoute, cfg.Pods, cfg.KVBlocks, cfg.Interval,
		res.WarmupEnd, 100*cfg.Warmup, faultWords(cfg))
	p("")
	p("Mix: %.0f%% shared-prefix, %.0f%% multi-turn turns, %.0f%% random; %.0f%% streaming; %.0f%% abandoned by the client after %s–%s. kvsoak itself (pods included) used %.2f cores.",
		100*cfg.Mix.Shared, 100*cfg.Mix.Multi, 100*(1-cfg.Mix.Shared-cfg.Mix.Multi), 100*cfg.Mix.Stream, 100*cfg.Mix.Abandon,
		cfg.Mix.AbandonMin, cfg.Mix.AbandonMax, res.SelfCores)
	p("")
	p("## Series")
	p("")
	p("Fit: least squares over the samples after warm-up while the load ran; *after drain* is the last sample, once the load stopped, kvroute's in-flight gauge returned to 0 and %s passed.", cfg.Settle)
	p("")
	markdownTable(w, res.Checks)
	p("")
	p("![soak](%s)", FileChart)
	p("")
	p("## Requests")
	p("")
	rq := res.Requests
	p("| kind | sent | ok | failed (clear) | abandoned | cut by pod | lost |")
	p("|---|--:|--:|--:|--:|--:|--:|")
	for _, k := range slices.Sorted(maps.Keys(rq.ByKind)) {
		c := rq.ByKind[k]
		p("| %s | %d | %d | %d | %d | %d | %d |", k, c.Sent, c.OK, c.Failed, c.Abandoned, c.Cut, c.Lost)
	}
	p("| **all** | %d | %d | %d | %d | %d | %d |", rq.Sent, rq.OK, rq.Failed, rq.Abandoned, rq.Cut, rq.Lost)
	p("")
	p("- %d streaming, %d not; %.1f%% of the requests that ran to an end succeeded.", rq.StreamSent, rq.Sent-rq.StreamSent, 100*rq.OKShare)
	p("- Clear failures by status: %s.", statusList(rq.Statuses))
	for _, g := range failureGroups(res.Records, res.Log.Own) {
		p("  - %d × %d, %s; %d reached a pod (%s)", g.Count, g.Status, g.Source, g.Reached, strings.Join(g.IDs, ", "))
	}
	p("- Cut by their pod %s; the pods' connections saw %s (ids matched by X-Request-Id).", reasonList(rq.CutBy), reasonList(rq.PodCuts))
	p("- **Lost: %d** %s%s.", rq.Lost, reasonList(rq.LostBy), idList(rq.LostIDs))
	if rq.Skipped > 0 {
		p("- %d arrivals skipped at the client's cap of %d in flight.", rq.Skipped, cfg.MaxInFlight)
	}
	p("")
	p("## Shutdown")
	p("")
	sd := res.Shutdown
	p("- Client drained: %v; kvroute's in-flight gauge 0 after %.1f s: %v.", sd.ClientDrained, sd.DrainSeconds, sd.RouterDrained)
	p("- SIGTERM → exit code %d after %.0f ms (drain timeout %s)%s.", sd.ExitCode, 1e3*sd.ExitSeconds, cfg.DrainTimeout, errSuffix(sd.Err))
	lg := res.Log
	p("- kvroute log (`%s`): %d lines, %d warnings (%d \"upstream body failed\", %d \"request failed\"), %d errors, %d client disconnects, %d panics, drain incomplete: %v.",
		FileLog, lg.Lines, lg.Warn, lg.BodyFailures, len(lg.Own), lg.Error, lg.ClientClosed, lg.Panics, lg.DrainIncomplete)
	if len(res.Faults) > 0 {
		p("")
		p("## Faults")
		p("")
		on := map[string]int{}
		for _, e := range res.Faults {
			if e.On {
				on[e.Fault]++
			}
		}
		var parts []string
		for _, n := range FaultNames() {
			parts = append(parts, fmt.Sprintf("%s ×%d", n, on[n]))
		}
		p("%s; each on one pod for %s, then %s of calm (`%s`). Mid-stream stalls held %d pod writes.",
			strings.Join(parts, ", "), FaultPeriod(cfg.Duration), FaultPeriod(cfg.Duration), FileFaults, res.StalledWrites)
	}
	if len(res.Router) > 0 {
		p("")
		p("kvroute's counters at the end: %s.", counterList(res.Router))
	}
	if len(res.Notes)+len(res.Problems) > 0 {
		p("")
		p("## Findings")
		p("")
		for _, x := range res.Problems {
			p("- **Problem:** %s", x)
		}
		for _, x := range res.Notes {
			p("- Note: %s", x)
		}
	}
	p("")
	p("Files: `%s` (samples), `%s` (one row per request), `%s`, `%s`, kvroute's goroutines idle before the load (`%s`) and after the drain (`%s`).",
		FileCSV, FileRequests, FileFaults, FileLog, FileGoroutinesIdle, FileGoroutinesFinal)
	return nil
}

func counterList(m map[string]float64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("`%s` %.0f", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func faultWords(cfg Config) string {
	if !cfg.Faults {
		return "off"
	}
	return "rotating every " + FaultPeriod(cfg.Duration).String()
}

func idList(ids []string) string {
	if len(ids) == 0 {
		return ""
	}
	return ": " + strings.Join(ids, ", ")
}

func errSuffix(e string) string {
	if e == "" {
		return ""
	}
	return ": " + e
}
