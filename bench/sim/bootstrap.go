package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"
)

// SGLang's prefill/decode protocol (SGLang's mini_lb and sgl-model-gateway
// PD router, llm-d's routing sidecar with --connector=sglang): the router
// adds bootstrap_host, bootstrap_port (the prefill pod's bootstrap server)
// and a random bootstrap_room to the client's body and sends the same body
// to a prefill pod and a decode pod at once. The two engines meet in the
// room: the prefill pod opens it when it accepts the request and holds the
// prompt's KV blocks there once prefilled; the decode pod pulls the room
// from the bootstrap server, which waits for the prefill (the decode leg
// may well arrive first) and releases the hold. The bootstrap server is the
// pod's KV side channel, at bootstrapPullPath. Only the pod's role tells the
// legs apart: a prefill pod opens rooms, a decode pod pulls them, a mixed
// pod ignores the fields. Unlike SGLang, the prefill pod answers once it
// has prefilled rather than once the KV has moved, and a decode pod whose
// pull fails computes the prompt itself (as with the NixlConnector) rather
// than failing the request.

// bootstrapPullPath is the bootstrap server's route on the side channel.
const bootstrapPullPath = "/bootstrap/pull"

// bootstrapPullRequest is the body of a bootstrap pull.
type bootstrapPullRequest struct {
	Room      *uint64 `json:"bootstrap_room"`
	NumTokens int     `json:"num_tokens"`
}

// roomState is where a bootstrap room is in its life.
type roomState uint8

const (
	roomAwaited roomState = iota // a pull waits; no prefill request opened it yet
	roomPending                  // its prefill request runs
	roomReady                    // its KV is held
	roomClosed                   // pulled, failed or expired; remembered for a while
)

// roomEnd is why a room closed, and so how a pull of it is answered.
type roomEnd struct {
	status int
	msg    string
}

// The ways a room closes, and the two ways a pull ends without one.
var (
	roomPulled   = roomEnd{fasthttp.StatusGone, "its KV was pulled already"}
	roomExpired  = roomEnd{fasthttp.StatusGone, "its KV hold expired"}
	roomAborted  = roomEnd{fasthttp.StatusGone, "its prefill request was aborted"}
	roomFailed   = roomEnd{fasthttp.StatusGone, "its prefill request failed"}
	roomUnknown  = roomEnd{fasthttp.StatusNotFound, "no prefill request opened it"}
	roomShutdown = roomEnd{fasthttp.StatusServiceUnavailable, "the prefill pod is shutting down"}
)

// room is one bootstrap room of a prefill pod. Guarded by engine.mu.
type room struct {
	id      uint64
	state   roomState
	ready   chan struct{} // closed when the state passes roomPending
	hold    *kvHold       // roomReady: the KV
	end     roomEnd       // roomClosed: why
	expires time.Time     // roomClosed: when it is forgotten (wall)
}

// settled reports whether r.ready is closed.
func (r *room) settled() bool { return r.state >= roomReady }

// openRoom opens room id for a prefill request, taking over a room that a
// pull already waits for; nil when the room is pending or ready for
// another request. Safe for concurrent use.
func (e *engine) openRoom(id uint64, now time.Time) *room {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.purgeRooms(now)
	r := e.rooms[id]
	switch {
	case r == nil || r.state == roomClosed:
		r = &room{id: id, ready: make(chan struct{})}
		e.rooms[id] = r
	case r.state != roomAwaited:
		return nil
	}
	r.state = roomPending
	return r
}

// failRooms closes the rooms of a prefill request that failed before it
// reached the engine. Safe for concurrent use.
func (e *engine) failRooms(rooms []*room) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range rooms {
		e.closeRoom(r, time.Now(), roomFailed)
	}
}

// readyRoom puts hold h in room r and wakes its pulls. The caller holds
// e.mu.
func (e *engine) readyRoom(r *room, h *kvHold) {
	r.state, r.hold = roomReady, h
	close(r.ready)
}

// closeRoom closes room r (unless it is closed already) and wakes its
// pulls; it is remembered for BootstrapWaitTimeout so that a late pull
// learns why. The caller holds e.mu.
func (e *engine) closeRoom(r *room, now time.Time, end roomEnd) {
	if r.state == roomClosed {
		return
	}
	if !r.settled() {
		close(r.ready)
	}
	r.state, r.hold, r.end = roomClosed, nil, end
	r.expires = now.Add(e.cfg.BootstrapWaitTimeout)
	e.closedRooms = append(e.closedRooms, r)
	e.purgeRooms(now)
}

// purgeRooms forgets the closed rooms whose time is up. The caller holds
// e.mu.
func (e *engine) purgeRooms(now time.Time) {
	k := 0
	for ; k < len(e.closedRooms) && !e.closedRooms[k].expires.After(now); k++ {
		r := e.closedRooms[k]
		if e.rooms[r.id] == r {
			delete(e.rooms, r.id)
		}
		e.closedRooms[k] = nil
	}
	e.closedRooms = e.closedRooms[k:]
}

// takeRoom takes the hold of room id for a pull. While the room's prefill
// runs, or no request opened it yet and waited is false, it returns the
// room to wait on; otherwise the hold or why there is none. Safe for
// concurrent use.
func (e *engine) takeRoom(id uint64, now time.Time, waited bool) (wait *room, h *kvHold, end roomEnd) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.purgeRooms(now)
	r := e.rooms[id]
	switch {
	case r == nil && waited:
		return nil, nil, roomUnknown
	case r == nil:
		r = &room{id: id, ready: make(chan struct{})}
		e.rooms[id] = r
		return r, nil, roomEnd{}
	case r.state == roomAwaited && waited:
		delete(e.rooms, id) // other pulls of it wait on until their own grace ends
		return nil, nil, roomUnknown
	case r.state <= roomPending:
		return r, nil, roomEnd{}
	case r.state == roomClosed:
		return nil, nil, r.end
	case !r.hold.deadline.After(now):
		return nil, nil, roomExpired // the sweep releases it
	}
	h = r.hold
	h.done = true
	e.nHeld.Add(-int64(len(h.blocks)))
	e.closeRoom(r, now, roomPulled)
	return nil, h, roomEnd{}
}

// awaitRoom waits for room id's KV and takes its hold: while the room's
// prefill runs, and up to BootstrapWaitTimeout for a room that no prefill
// request opened yet; pod shutdown ends the wait. It returns the hold, or
// why there is none.
func (p *Pod) awaitRoom(id uint64) (*kvHold, roomEnd) {
	grace := time.NewTimer(p.cfg.BootstrapWaitTimeout)
	defer grace.Stop()
	waited := false
	for {
		r, h, end := p.eng.takeRoom(id, time.Now(), waited)
		if r == nil {
			return h, end
		}
		select {
		case <-r.ready:
		case <-grace.C:
			waited = true
		case <-p.done:
			return nil, roomShutdown
		}
	}
}

// handleBootstrapPull serves a decode pod's pull of a bootstrap room: it
// waits for the room's prefill, releases its hold and checks the prompt
// length.
func (p *Pod) handleBootstrapPull(ctx *fasthttp.RequestCtx) {
	var req bootstrapPullRequest
	err := json.Unmarshal(ctx.PostBody(), &req)
	if err == nil && req.Room == nil {
		err = errors.New("bootstrap_room is missing")
	}
	if err != nil {
		answerPull(ctx, fasthttp.StatusBadRequest, pullResponse{Error: "bad bootstrap pull: " + err.Error()})
		return
	}
	if p.cfg.Role != RolePrefill {
		answerPull(ctx, fasthttp.StatusNotFound, pullResponse{Error: fmt.Sprintf("a %s pod opens no bootstrap rooms", p.cfg.Role)})
		return
	}
	h, end := p.awaitRoom(*req.Room)
	if h == nil {
		answerPull(ctx, end.status, pullResponse{Error: fmt.Sprintf("bootstrap room %d: %s", *req.Room, end.msg)})
		return
	}
	p.eng.post(event{kind: evRelease, hold: h})
	if req.NumTokens != h.tokens {
		answerPull(ctx, fasthttp.StatusBadRequest, pullResponse{Error: fmt.Sprintf("room has %d tokens, decode wants %d", h.tokens, req.NumTokens)})
		return
	}
	answerPull(ctx, fasthttp.StatusOK, pullResponse{NumTokens: h.tokens})
}

// openRooms opens the bootstrap rooms of a prefill request, one per
// prompt. When one is in use by another request, the rooms opened so far
// fail and the request is refused.
func (p *Pod) openRooms(ids []uint64) ([]*room, *apiError) {
	now := time.Now()
	rooms := make([]*room, len(ids))
	for i, id := range ids {
		if rooms[i] = p.eng.openRoom(id, now); rooms[i] == nil {
			p.eng.failRooms(rooms[:i])
			return nil, badRequest("bootstrap_room %d is in use by a prefill request", id)
		}
	}
	return rooms, nil
}
