package proxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Budgets (--tenant-budgets FILE): per-tenant limits from a small JSON
// file, optional. A tenant's budget may set
//   - weight: its share of the fleet in the fair queue (1 by default);
//   - max_concurrency: how many of its requests run at once through this
//     replica; beyond it, its requests wait in the queue (others do not);
//   - tokens_per_minute and requests_per_minute: token buckets that hold
//     a minute's worth; a request that finds one empty is answered 429
//     with the Retry-After that refills it. A request is charged its
//     prompt tokens plus the output it may ask for when it arrives, and
//     settled to the engine's usage report when it ends; one that never
//     reached an engine is refunded;
//   - max_class: the highest class its requests get (a request asking for
//     more is served at max_class).
//
// Tenants are named by the SHA-256 of their API key (or tenant header
// value), by their metric label (t- and 12 hex digits) or the access
// log's tenant hash, or "default" (requests without a key). A named
// tenant's metric label is its name. "others" is the budget of every
// tenant not named: each has a budget of its own of that size.
//
// The file is read at start (a bad file stops kvroute) and polled for
// changes; a changed file that does not parse is refused with a logged
// error and the old budgets stay. Budgets are per replica.

// BudgetFile is the budgets file's schema.
type BudgetFile struct {
	// Tenants are the named tenants' budgets, by name.
	Tenants map[string]TenantBudget `json:"tenants"`
	// Others is the budget of each tenant not named (none: no limits).
	Others *Budget `json:"others,omitempty"`
}

// Budget is one tenant's limits; zero means none.
type Budget struct {
	Weight            float64 `json:"weight,omitempty"`
	MaxConcurrency    int     `json:"max_concurrency,omitempty"`
	TokensPerMinute   float64 `json:"tokens_per_minute,omitempty"`
	RequestsPerMinute float64 `json:"requests_per_minute,omitempty"`
	MaxClass          string  `json:"max_class,omitempty"`
}

// TenantBudget is a named tenant's budget and how it is recognised: by
// KeySHA256 (hex SHA-256 of its API key or tenant header value) or by ID
// (its metric label "t-…", its access-log hash, or "default").
type TenantBudget struct {
	KeySHA256 string `json:"key_sha256,omitempty"`
	ID        string `json:"id,omitempty"`
	Budget
}

// budget is a compiled Budget.
type budget struct {
	name     string // the metric label of a named tenant; "" for others
	weight   float64
	maxConc  int64   // 0: none
	tpm, rpm float64 // per minute; 0: none
	maxClass class
	capped   bool // maxClass applies
}

// limits reports whether b limits anything that needs counting.
func (b *budget) limits() bool { return b.maxConc > 0 || b.tpm > 0 || b.rpm > 0 }

// Budgets are the compiled budgets file.
type Budgets struct {
	byID    map[uint64]*budget // by tenant hash
	byLabel map[uint64]*budget // by the hash's top 48 bits (a metric label)
	others  *budget
	named   int
}

// of returns tenant id's budget, nil when none applies.
func (b *Budgets) of(id uint64) *budget {
	if b == nil {
		return nil
	}
	if x := b.byID[id]; x != nil {
		return x
	}
	if x := b.byLabel[id>>16]; x != nil && id != 0 {
		return x
	}
	return b.others
}

// Tenants is the number of named tenants.
func (b *Budgets) Tenants() int { return b.named }

// maxBudgetsBytes bounds the budgets file.
const maxBudgetsBytes = 4 << 20

var budgetName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// ParseBudgets compiles a budgets file, with an error naming the tenant
// and field at fault.
func ParseBudgets(data []byte) (*Budgets, error) {
	if len(data) > maxBudgetsBytes {
		return nil, fmt.Errorf("budgets: the file is larger than %d MiB", maxBudgetsBytes>>20)
	}
	var f BudgetFile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("budgets: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("budgets: the file holds more than one JSON object")
	}
	b := &Budgets{byID: make(map[uint64]*budget), byLabel: make(map[uint64]*budget), named: len(f.Tenants)}
	if f.Others != nil {
		x, err := compileBudget("others", f.Others)
		if err != nil {
			return nil, err
		}
		x.name = ""
		b.others = x
	}
	names := make([]string, 0, len(f.Tenants))
	for name := range f.Tenants {
		names = append(names, name)
	}
	slices.Sort(names) // errors in a stable order
	for _, name := range names {
		t := f.Tenants[name]
		if !budgetName.MatchString(name) || name == "other" || strings.HasPrefix(name, "t-") {
			return nil, fmt.Errorf("budgets: tenant %q: a name is 1 to 64 letters, digits, '_', '.' or '-', not \"other\" and not starting \"t-\" (it is the tenant's metric label)", name)
		}
		x, err := compileBudget(name, &t.Budget)
		if err != nil {
			return nil, err
		}
		var id uint64
		var into map[uint64]*budget
		switch {
		case (t.KeySHA256 == "") == (t.ID == ""):
			return nil, fmt.Errorf("budgets: tenant %q: set exactly one of key_sha256 and id", name)
		case t.KeySHA256 != "":
			sum, err := hex.DecodeString(t.KeySHA256)
			if err != nil || len(sum) != sha256.Size {
				return nil, fmt.Errorf("budgets: tenant %q: key_sha256 must be 64 hex digits (sha256sum of the API key), got %q", name, t.KeySHA256)
			}
			id, into = binary.BigEndian.Uint64(sum[:8])|1, b.byID
		case t.ID == "default":
			id, into = 0, b.byID
		case strings.HasPrefix(t.ID, "t-"):
			v, err := strconv.ParseUint(t.ID[2:], 16, 64)
			if err != nil || len(t.ID) != 14 {
				return nil, fmt.Errorf("budgets: tenant %q: id %q: a metric label is t- and 12 hex digits", name, t.ID)
			}
			id, into = v, b.byLabel
		default:
			v, err := strconv.ParseUint(t.ID, 16, 64)
			if err != nil || v&1 == 0 {
				return nil, fmt.Errorf("budgets: tenant %q: id %q is neither \"default\", a metric label (t-…) nor an access log's tenant hash", name, t.ID)
			}
			id, into = v, b.byID
		}
		if into[id] != nil {
			return nil, fmt.Errorf("budgets: tenants %q and %q are the same tenant", into[id].name, name)
		}
		into[id] = x
	}
	return b, nil
}

func compileBudget(name string, in *Budget) (*budget, error) {
	x := &budget{name: name, weight: 1}
	bad := func(field string, v any, want string) error {
		return fmt.Errorf("budgets: tenant %q: %s %v: %s", name, field, v, want)
	}
	switch w := in.Weight; {
	case w == 0:
	case !(w > 0) || w > 1e6 || math.IsInf(w, 0):
		return nil, bad("weight", w, "must be above 0 and at most 1e6")
	default:
		x.weight = w
	}
	if in.MaxConcurrency < 0 {
		return nil, bad("max_concurrency", in.MaxConcurrency, "must be 0 (none) or more")
	}
	x.maxConc = int64(in.MaxConcurrency)
	for _, r := range []struct {
		field string
		v     float64
		to    *float64
	}{{"tokens_per_minute", in.TokensPerMinute, &x.tpm}, {"requests_per_minute", in.RequestsPerMinute, &x.rpm}} {
		if !(r.v >= 0) || math.IsInf(r.v, 0) {
			return nil, bad(r.field, r.v, "must be 0 (none) or more")
		}
		*r.to = r.v
	}
	if in.MaxClass != "" {
		c, ok := classOf([]byte(in.MaxClass))
		if !ok || in.MaxClass == "auto" || in.MaxClass == "scale" {
			return nil, bad("max_class", strconv.Quote(in.MaxClass), "must be priority, default or flex")
		}
		x.maxClass, x.capped = c, true
	}
	return x, nil
}

// LoadBudgets reads and compiles the budgets file at path, and returns its
// bytes too.
func LoadBudgets(path string) (*Budgets, []byte, error) {
	data, err := readCapped(path)
	if err != nil {
		return nil, nil, fmt.Errorf("budgets: %w", err)
	}
	b, err := ParseBudgets(data)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, data, nil
}

func readCapped(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, maxBudgetsBytes+1))
}

// tenantUse is a tenant's use of its budget: its requests charged and not
// ended (refs; an entry is forgotten only without them), those running
// (inflight), and its token buckets.
type tenantUse struct {
	refs, inflight int64
	tokens, reqs   float64
	tpm, rpm       float64 // the buckets' sizes when last filled
	at             time.Time
}

// fill refills u's buckets to now at b's rates.
func (u *tenantUse) fill(b *budget, now time.Time) {
	dt := now.Sub(u.at).Minutes()
	u.at = now
	u.tpm, u.rpm = b.tpm, b.rpm
	u.tokens = min(b.tpm, u.tokens+dt*b.tpm)
	u.reqs = min(b.rpm, u.reqs+dt*b.rpm)
}

// budgetState is the budgets in force and the tenants' use of them.
type budgetState struct {
	cur   atomic.Pointer[Budgets]
	mu    sync.Mutex
	use   map[uint64]*tenantUse
	swept time.Time
}

// budgetCharge is what a request was charged: its tenant's use (nil: no
// budget limits it), whether it holds one of its tenant's places
// (started), and the tokens charged.
type budgetCharge struct {
	use     *tenantUse
	started bool
	tokens  float64
}

// rateLimitError: a tenant's token or request budget is spent (429, with
// the Retry-After that refills it).
type rateLimitError struct {
	what  string
	limit float64
	retry time.Duration
}

func (e *rateLimitError) Error() string {
	return fmt.Sprintf("Rate limit reached: this API key's budget of %g %s per minute is spent; retry in %s.", e.limit, e.what, e.retry.Round(time.Second))
}

// retryAfterSeconds is e's wait as a Retry-After value: whole seconds,
// at least 1.
func (e *rateLimitError) retryAfterSeconds() int {
	return max(1, int(math.Ceil(e.retry.Seconds())))
}

// charge charges tenant id, whose budget is b, a request of tokens tokens,
// or reports the rate it exceeds.
func (bs *budgetState) charge(c *budgetCharge, id uint64, b *budget, tokens float64) error {
	now := time.Now()
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if bs.use == nil {
		bs.use = make(map[uint64]*tenantUse)
	}
	if now.Sub(bs.swept) > time.Minute {
		bs.sweep(now)
	}
	u := bs.use[id]
	if u == nil {
		u = &tenantUse{tokens: b.tpm, reqs: b.rpm, at: now}
		bs.use[id] = u
	}
	u.fill(b, now)
	// A request needs a whole one left; tokens, anything left, whatever
	// the request costs (one larger than a minute's budget is not refused
	// for good, and the debt it leaves is waited out).
	if b.rpm > 0 && u.reqs < 1 {
		return &rateLimitError{what: "requests", limit: b.rpm, retry: time.Duration((1 - u.reqs) / b.rpm * float64(time.Minute))}
	}
	if b.tpm > 0 && u.tokens <= 0 {
		return &rateLimitError{what: "tokens", limit: b.tpm, retry: time.Duration((1 - u.tokens) / b.tpm * float64(time.Minute))}
	}
	u.reqs--
	u.tokens -= tokens
	u.refs++
	*c = budgetCharge{use: u, tokens: tokens}
	return nil
}

// sweep forgets tenants with nothing charged and full buckets; bs.mu is
// held.
func (bs *budgetState) sweep(now time.Time) {
	bs.swept = now
	for id, u := range bs.use {
		if u.refs == 0 && u.tokens+now.Sub(u.at).Minutes()*u.tpm >= u.tpm && u.reqs+now.Sub(u.at).Minutes()*u.rpm >= u.rpm {
			delete(bs.use, id)
		}
	}
}

// tryStart takes one of tenant id's places for c's request, unless the
// tenant runs its max_concurrency already (false).
func (bs *budgetState) tryStart(c *budgetCharge, id uint64) bool {
	if c.use == nil || c.started {
		return true
	}
	b := bs.cur.Load().of(id)
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if b != nil && b.maxConc > 0 && c.use.inflight >= b.maxConc {
		return false
	}
	c.use.inflight++
	c.started = true
	return true
}

// unstart gives c's place back (its request goes back to wait).
func (bs *budgetState) unstart(c *budgetCharge) {
	if c.use == nil || !c.started {
		return
	}
	bs.mu.Lock()
	c.use.inflight--
	bs.mu.Unlock()
	c.started = false
}

// atMax reports whether tenant id runs its max_concurrency.
func (bs *budgetState) atMax(id uint64) bool {
	b := bs.cur.Load().of(id)
	if b == nil || b.maxConc == 0 {
		return false
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	u := bs.use[id]
	return u != nil && u.inflight >= b.maxConc
}

// settle ends c's request: its place back, and its tokens settled: all
// refunded when no engine answered it (reached false), else to spent
// when the engine reported its usage (spent ≥ 0).
func (bs *budgetState) settle(c *budgetCharge, reached bool, spent int) {
	u := c.use
	if u == nil {
		return
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if c.started {
		u.inflight--
	}
	u.refs--
	switch {
	case !reached:
		u.tokens = min(u.tpm, u.tokens+c.tokens)
		u.reqs = min(u.rpm, u.reqs+1)
	case spent >= 0:
		u.tokens = min(u.tpm, u.tokens+c.tokens-float64(spent))
	}
	*c = budgetCharge{}
}

// BudgetStatus is one tenant's use of its budget, for /debug/queue.
type BudgetStatus struct {
	Tenant         string `json:"tenant"`
	InFlight       int64  `json:"in_flight"`
	MaxConcurrency int64  `json:"max_concurrency,omitempty"`
	// TokensLeft and RequestsLeft are the buckets' levels now (negative:
	// a debt being waited out), with their sizes per minute.
	TokensLeft        float64 `json:"tokens_left,omitempty"`
	TokensPerMinute   float64 `json:"tokens_per_minute,omitempty"`
	RequestsLeft      float64 `json:"requests_left,omitempty"`
	RequestsPerMinute float64 `json:"requests_per_minute,omitempty"`
}

// budgetStatus lists the tenants whose budgets are in use, busiest first.
func (s *Server) budgetStatus() []BudgetStatus {
	bs := &s.budgets
	cur := bs.cur.Load()
	now := time.Now()
	type use struct {
		id uint64
		u  tenantUse
	}
	var uses []use
	bs.mu.Lock()
	for id, u := range bs.use {
		uses = append(uses, use{id, *u})
	}
	bs.mu.Unlock()
	var out []BudgetStatus
	for _, x := range uses {
		b := cur.of(x.id)
		if b == nil {
			continue
		}
		x.u.fill(b, now)
		st := BudgetStatus{Tenant: s.tenantLabel(x.id), InFlight: x.u.inflight, MaxConcurrency: b.maxConc}
		if b.tpm > 0 {
			st.TokensLeft, st.TokensPerMinute = math.Round(x.u.tokens), b.tpm
		}
		if b.rpm > 0 {
			st.RequestsLeft, st.RequestsPerMinute = math.Floor(x.u.reqs), b.rpm
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b BudgetStatus) int { return int(b.InFlight - a.InFlight) })
	return out
}

// SetBudgets puts b in force (nil: none). Requests charged under the old
// budgets settle against the same tenants' use.
func (s *Server) SetBudgets(b *Budgets) { s.budgets.cur.Store(b) }

// WatchBudgets polls the budgets file at path every interval until ctx is
// done and puts a changed file in force; one that does not load is logged
// and refused, and the budgets in force stay. last is the file's content
// in force.
func (s *Server) WatchBudgets(ctx context.Context, path string, interval time.Duration, last []byte) {
	t := time.NewTicker(interval)
	defer t.Stop()
	failed := ""
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		data, err := readCapped(path)
		if err == nil && bytes.Equal(data, last) {
			failed = ""
			continue
		}
		var b *Budgets
		if err == nil {
			b, err = ParseBudgets(data)
		}
		if err != nil {
			if msg := err.Error(); msg != failed { // once per failure
				failed = msg
				s.opt.Logger.Error("tenant budgets not reloaded; the budgets in force stay", zap.String("file", path), zap.Error(err))
				s.opt.Metrics.BudgetsReload(false)
			}
			continue
		}
		failed, last = "", data
		s.SetBudgets(b)
		s.opt.Metrics.BudgetsReload(true)
		s.opt.Logger.Info("tenant budgets reloaded", zap.String("file", path), zap.Int("tenants", b.named))
	}
}

// chargeBudget applies st's tenant's budget to its request, at arrival:
// its class capped at max_class, its weight, and its rates charged
// (an error when one is spent).
func (s *Server) chargeBudget(st *reqState) error {
	b := s.budgets.cur.Load().of(st.tenant)
	if b == nil {
		return nil
	}
	if b.capped && st.class.rank() > b.maxClass.rank() {
		st.class = b.maxClass
	}
	if !b.limits() {
		return nil
	}
	tokens := float64(st.req.PromptTokens + st.outputEstimate())
	return s.budgets.charge(&st.charge, st.tenant, b, tokens)
}

// weightOf is tenant id's share in the fair queue.
func (s *Server) weightOf(id uint64) float64 {
	if b := s.budgets.cur.Load().of(id); b != nil {
		return b.weight
	}
	return 1
}

// budgetName is tenant id's name in the budgets file, "" if none.
func (s *Server) budgetName(id uint64) string {
	if b := s.budgets.cur.Load().of(id); b != nil {
		return b.name
	}
	return ""
}
