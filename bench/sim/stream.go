package sim

import (
	"errors"
	"io"
	"strconv"
)

var (
	errDropped   = errors.New("sim: connection dropped by fault injection")
	errPodClosed = errors.New("sim: pod closed mid-stream")
)

// sseStream is the body of a streaming response. fasthttp calls WriteTo on
// the connection's own goroutine and frames every Write as one flushed HTTP
// chunk, so a stream costs no goroutine of its own: per engine step it wakes
// once, formats the new deltas and writes them. Not safe for concurrent use.
type sseStream struct {
	p         *Pod
	r         *request
	sent      []int // tokens already emitted, per sequence
	snap      []seqPub
	buf       []byte
	pending   []byte // Read's undelivered bytes
	rerr      error  // Read's error after pending drains
	tokens    int    // tokens emitted in total (drop fault)
	dropAfter int
	complete  bool // [DONE] written
}

func newSSEStream(p *Pod, r *request, dropAfter int) *sseStream {
	return &sseStream{p: p, r: r, sent: make([]int, len(r.seqs)), snap: make([]seqPub, len(r.seqs)),
		buf: make([]byte, 0, 1024), dropAfter: dropAfter}
}

// SupportsBodyWriteTo tells fasthttp to use WriteTo (fasthttp.BodyWriterTo).
func (st *sseStream) SupportsBodyWriteTo() bool { return true }

// WriteTo writes events as they are generated until [DONE] (nil error), an
// injected drop or pod shutdown (non-nil error: fasthttp closes the
// connection without the terminating chunk) or a write error.
func (st *sseStream) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		chunk, err := st.next()
		if len(chunk) > 0 {
			n, werr := w.Write(chunk)
			total += int64(n)
			if werr != nil {
				return total, werr
			}
		}
		if err != nil || st.complete {
			return total, err
		}
	}
}

// Read implements io.Reader for callers that do not use WriteTo.
func (st *sseStream) Read(b []byte) (int, error) {
	for len(st.pending) == 0 {
		if st.rerr != nil {
			return 0, st.rerr
		}
		if st.complete {
			return 0, io.EOF
		}
		st.pending, st.rerr = st.next()
	}
	n := copy(b, st.pending)
	st.pending = st.pending[n:]
	return n, nil
}

// Close is called by fasthttp when the response ends; an unfinished stream
// means the client went away (or a fault dropped it), so the engine aborts it.
func (st *sseStream) Close() error {
	if !st.complete && st.r.cancel() {
		st.p.eng.post(event{kind: evNudge})
	}
	return nil
}

// next blocks until there is something to send and returns it.
func (st *sseStream) next() ([]byte, error) {
	r := st.r
	for {
		r.mu.Lock()
		for i, s := range r.seqs {
			st.snap[i] = s.pub
		}
		allDone := r.doneSeqs == len(r.seqs)
		r.mu.Unlock()

		b := st.buf[:0]
		var err error
		interval := st.p.cfg.StreamInterval
	seqs:
		for i, s := range r.seqs {
			pub := st.snap[i]
			for st.sent[i] < pub.generated {
				from := st.sent[i]
				// Deltas are [0,1), then groups of interval tokens; a group
				// goes out complete, or short at the end of the sequence.
				to := 1
				if from > 0 {
					to = from + interval - (from-1)%interval
				}
				if to > pub.generated {
					if pub.finish == "" {
						break
					}
					to = pub.generated
				}
				if st.dropAfter > 0 {
					if st.tokens >= st.dropAfter {
						err = errDropped
						break seqs
					}
					to = min(to, from+st.dropAfter-st.tokens)
				}
				if r.chat && from == 0 {
					b = st.appendChatRole(b, s)
				}
				b = st.appendDelta(b, s, from, to, pub)
				st.tokens += to - from
				st.sent[i] = to
			}
		}
		if err == nil && allDone {
			if r.includeUsage {
				b = append(b, "data: "...)
				object := "text_completion"
				if r.chat {
					object = "chat.completion.chunk"
				}
				b = appendHead(b, r, object)
				b = append(b, `,"choices":[],"usage":`...)
				b = appendUsage(b, requestUsage(r, st.snap))
				b = append(b, "}\n\n"...)
			}
			b = append(b, "data: [DONE]\n\n"...)
			st.complete = true
		}
		st.buf = b
		if len(b) > 0 || err != nil {
			return b, err
		}
		select {
		case <-r.wake:
		case <-st.p.done:
			return nil, errPodClosed
		}
	}
}

func (st *sseStream) appendChatRole(b []byte, s *seq) []byte {
	b = append(b, "data: "...)
	b = appendHead(b, st.r, "chat.completion.chunk")
	b = append(b, `,"choices":[{"index":`...)
	b = strconv.AppendInt(b, int64(s.index), 10)
	return append(b, `,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
}

// appendDelta appends one event carrying generated tokens [from, to) of s;
// the event that carries the last token has the finish reason.
func (st *sseStream) appendDelta(b []byte, s *seq, from, to int, pub seqPub) []byte {
	finish := ""
	if to == pub.generated {
		finish = pub.finish
	}
	b = append(b, "data: "...)
	if st.r.chat {
		b = appendHead(b, st.r, "chat.completion.chunk")
		b = append(b, `,"choices":[{"index":`...)
		b = strconv.AppendInt(b, int64(s.index), 10)
		b = append(b, `,"delta":{"content":"`...)
		b = appendSeqText(b, s, from, to, pub)
		b = append(b, `"},"logprobs":null,"finish_reason":`...)
		b = appendFinish(b, finish)
		if finish != "" {
			b = append(b, `,"stop_reason":null`...)
		}
		return append(b, "}]}\n\n"...)
	}
	b = appendHead(b, st.r, "text_completion")
	b = append(b, `,"choices":[{"index":`...)
	b = strconv.AppendInt(b, int64(s.index), 10)
	b = append(b, `,"text":"`...)
	b = appendSeqText(b, s, from, to, pub)
	b = append(b, `","logprobs":null,"finish_reason":`...)
	b = appendFinish(b, finish)
	return append(b, `,"stop_reason":null}],"usage":null}`+"\n\n"...)
}
