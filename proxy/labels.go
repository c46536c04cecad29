package proxy

import (
	"cmp"
	"encoding/binary"
	"encoding/hex"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Tenants' metric labels, bounded: a tenant named in the budgets file by
// its name, the default tenant "default", the busiest MetricTenants
// others "t-" and 12 hex digits of their hash, the rest "other". The
// first tenants seen take the labels while some are free; from then on,
// every rankEvery, a tenant that has admitted more than twice as many
// requests as the least busy labelled one (counts halved at each ranking)
// takes that one's label, if that tenant has nothing queued or in flight:
// its series are deleted and it counts in "other" until it is among the
// busiest again. A router restarted beside a steady crowd of small callers
// so still names the caller that later floods it, instead of the first 32
// it saw, and the series exported stay bounded by the labels, whatever the
// churn.

// rankEvery is how often the busiest tenants are ranked.
const rankEvery = time.Minute

// tenantLabels holds the labels and what ranks the tenants.
type tenantLabels struct {
	max    int
	labels sync.Map // uint64 → string: the labelled tenants
	n      atomic.Int64
	// admitted counts each tenant's requests since the last ranking (at
	// most maxTenants tenants); ranked is when that was (Unix ns).
	admitted  sync.Map // uint64 → *atomic.Int64
	nAdmitted atomic.Int64
	ranked    atomic.Int64
	// mu serialises rankings; score is each tenant's decayed count.
	mu    sync.Mutex
	score map[uint64]float64
}

// hashLabel is tenant id's own label: "t-" and 12 hex digits of its hash.
func hashLabel(id uint64) string {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], id)
	return "t-" + hex.EncodeToString(b[:6])
}

// tenantLabel is tenant id's metric label (see above).
func (s *Server) tenantLabel(id uint64) string {
	if name := s.budgetName(id); name != "" {
		return name
	}
	if id == 0 {
		return "default"
	}
	t := &s.tenants
	if v, ok := t.labels.Load(id); ok {
		return v.(string)
	}
	if t.n.Load() >= int64(t.max) {
		return "other"
	}
	l := hashLabel(id)
	if v, loaded := t.labels.LoadOrStore(id, l); loaded {
		return v.(string)
	}
	t.n.Add(1)
	return l
}

// countAdmitted counts a request of tenant id that went to the fleet, for
// the ranking, and ranks the tenants (in the background) once rankEvery
// has passed.
func (s *Server) countAdmitted(id uint64) {
	t := &s.tenants
	if id != 0 && s.budgetName(id) == "" {
		v, ok := t.admitted.Load(id)
		if !ok && t.nAdmitted.Load() < maxTenants {
			var loaded bool
			if v, loaded = t.admitted.LoadOrStore(id, new(atomic.Int64)); !loaded {
				t.nAdmitted.Add(1)
			}
			ok = true
		}
		if ok {
			v.(*atomic.Int64).Add(1)
		}
	}
	now, last := time.Now().UnixNano(), t.ranked.Load()
	if last == 0 {
		t.ranked.CompareAndSwap(0, now)
	} else if now-last >= int64(rankEvery) && t.ranked.CompareAndSwap(last, now) {
		go s.rankTenants()
	}
}

// rankTenants folds the counts since the last ranking into the scores and
// gives labels to the busiest tenants without one (see above).
func (s *Server) rankTenants() {
	t := &s.tenants
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.score == nil {
		t.score = make(map[uint64]float64)
	}
	for id, sc := range t.score {
		if t.score[id] = sc / 2; sc < 1 {
			delete(t.score, id)
		}
	}
	t.admitted.Range(func(k, v any) bool {
		id := k.(uint64)
		if n := v.(*atomic.Int64).Swap(0); n > 0 {
			t.score[id] += float64(n)
		} else {
			t.admitted.Delete(id)
			t.nAdmitted.Add(-1)
		}
		return true
	})
	var in, out []uint64 // labelled and not, by score
	for id := range t.score {
		if _, ok := t.labels.Load(id); ok {
			in = append(in, id)
		} else {
			out = append(out, id)
		}
	}
	t.labels.Range(func(k, _ any) bool {
		if id := k.(uint64); t.score[id] == 0 {
			in = append(in, id)
		}
		return true
	})
	by := func(a, b uint64) int { return cmp.Compare(t.score[b], t.score[a]) }
	slices.SortFunc(in, by)
	slices.SortFunc(out, by)
	for _, c := range out {
		if t.n.Load() < int64(t.max) {
			if _, loaded := t.labels.LoadOrStore(c, hashLabel(c)); !loaded {
				t.n.Add(1)
			}
			continue
		}
		// The least busy labelled tenant with nothing queued or in flight.
		i := len(in) - 1
		for i >= 0 && !s.tenantIdle(in[i]) {
			i--
		}
		if i < 0 || t.score[c] <= 2*t.score[in[i]] {
			return
		}
		// Its new requests count in "other" from here; one that took its
		// label just before keeps it, and the label, to its end.
		t.labels.Delete(in[i])
		if !s.tenantIdle(in[i]) {
			t.labels.Store(in[i], hashLabel(in[i]))
			return
		}
		w := in[i]
		in = slices.Delete(in, i, i+1)
		s.opt.Metrics.DropTenant(hashLabel(w))
		t.labels.Store(c, hashLabel(c))
	}
}

// tenantIdle reports whether tenant id has no request queued or in flight.
func (s *Server) tenantIdle(id uint64) bool {
	q := &s.queue
	q.mu.Lock()
	waiting := q.tenants[id] != nil && q.tenants[id].waiting > 0
	q.mu.Unlock()
	if waiting {
		return false
	}
	r := &q.runs
	r.mu.Lock()
	defer r.mu.Unlock()
	for c := range numClasses {
		if f := r.m[flowOf(id, c)]; f != nil && f.running > 0 {
			return false
		}
	}
	return true
}
