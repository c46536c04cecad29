package prefix

// table is the index's reverse map from block hash to the endpoints holding
// it: open addressing with linear probing over a pointer-free slab of
// 32-byte slots, at most 3/4 full, deleting by backward shift so that no
// tombstones build up.
//
// It replaces a Go map for one access pattern: a new prompt looks up every
// one of its blocks and finds none, and the index under steady load evicts
// one hash for every hash it inserts. A Go map sits near 7/8 full counting
// tombstones, where a lookup of an absent key probes group after group;
// that was most of a new prompt's Pick (BenchmarkPick/new-prefix). Here an
// absent key costs a couple of adjacent slots. Block hashes are xxh3 output
// already, so their top bits place them; hash 0 is stored as 1.
//
// The first two owners of a hash live in its slot (most hashes have one);
// the rest in a map by hash, which only prefixes spilled to three or more
// endpoints use.
type table struct {
	slots []slot
	shift uint // 64 - log2(len(slots))
	n     int  // occupied slots
	more  map[uint64][]ref
}

type slot struct {
	key    uint64 // normalised block hash; 0: empty
	stamp  uint32 // second of the last Record touching the hash
	n      uint32 // owners: inline first, then more[key]
	inline [2]ref
}

const minTableSlots = 1 << 10

func newTable() table {
	return table{slots: make([]slot, minTableSlots), shift: 64 - 10, more: make(map[uint64][]ref)}
}

func norm(h uint64) uint64 {
	if h == 0 {
		return 1
	}
	return h
}

func (t *table) home(key uint64) int { return int(key >> t.shift) }

func (t *table) mask() int { return len(t.slots) - 1 }

// find returns the slot holding hash h, or -1.
func (t *table) find(h uint64) int {
	key, m := norm(h), t.mask()
	for i := t.home(key); ; i = (i + 1) & m {
		switch t.slots[i].key {
		case key:
			return i
		case 0:
			return -1
		}
	}
}

// touch loads the first slot each of hashes probes and returns a value the
// caller must keep (so the loads are not optimised away). The loads do not
// depend on one another, so the processor overlaps their cache misses;
// a loop that looks each hash up and updates the table takes them one at
// a time. Record calls it before walking a chain.
func (t *table) touch(hashes []uint64) uint64 {
	var sum uint64
	for _, h := range hashes {
		sum += t.slots[t.home(norm(h))].key
	}
	return sum
}

// insert adds hash h, which must be absent, with no owners, and returns its
// slot.
func (t *table) insert(h uint64) int {
	if (t.n+1)*4 > len(t.slots)*3 {
		t.grow()
	}
	key, m := norm(h), t.mask()
	i := t.home(key)
	for t.slots[i].key != 0 {
		i = (i + 1) & m
	}
	t.slots[i] = slot{key: key}
	t.n++
	return i
}

func (t *table) grow() {
	old := t.slots
	t.slots = make([]slot, 2*len(old))
	t.shift--
	m := t.mask()
	for _, s := range old {
		if s.key == 0 {
			continue
		}
		i := t.home(s.key)
		for t.slots[i].key != 0 {
			i = (i + 1) & m
		}
		t.slots[i] = s
	}
}

// del empties slot i (its owners must have been removed), shifting back
// the entries after it that probed past it.
func (t *table) del(i int) {
	m := t.mask()
	for j := (i + 1) & m; t.slots[j].key != 0; j = (j + 1) & m {
		// Move j into the hole at i unless j's home lies cyclically in
		// (i, j]: then a lookup for it never passes i.
		if h := t.home(t.slots[j].key); (j-h)&m >= (j-i)&m {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = slot{}
	t.n--
}

// owner returns owner k of slot i.
func (t *table) owner(i, k int) ref {
	if k < len(slot{}.inline) {
		return t.slots[i].inline[k]
	}
	return t.more[t.slots[i].key][k-len(slot{}.inline)]
}

func (t *table) setOwner(i, k int, r ref) {
	if k < len(slot{}.inline) {
		t.slots[i].inline[k] = r
		return
	}
	t.more[t.slots[i].key][k-len(slot{}.inline)] = r
}

// ownerOf returns the position among slot i's owners of endpoint slot es,
// or -1.
func (t *table) ownerOf(i int, es int32) int {
	s := &t.slots[i]
	for k := 0; k < int(min(s.n, uint32(len(s.inline)))); k++ {
		if s.inline[k].slot == es {
			return k
		}
	}
	if s.n > uint32(len(s.inline)) {
		for k, r := range t.more[s.key] {
			if r.slot == es {
				return k + len(s.inline)
			}
		}
	}
	return -1
}

func (t *table) addOwner(i int, r ref) {
	s := &t.slots[i]
	if s.n < uint32(len(s.inline)) {
		s.inline[s.n] = r
	} else {
		t.more[s.key] = append(t.more[s.key], r)
	}
	s.n++
}

// removeOwner removes owner k of slot i, moving the last owner into its
// place.
func (t *table) removeOwner(i, k int) {
	s := &t.slots[i]
	last := int(s.n) - 1
	if k != last {
		t.setOwner(i, k, t.owner(i, last))
	}
	if last >= len(s.inline) {
		extra := t.more[s.key][:last-len(s.inline)]
		if len(extra) == 0 {
			delete(t.more, s.key)
		} else {
			t.more[s.key] = extra
		}
	}
	s.n--
}

// bytes estimates the table's heap size.
func (t *table) bytes() int {
	b := len(t.slots) * 32
	for _, rs := range t.more {
		b += 64 + cap(rs)*8 // map slot and slice
	}
	return b
}
