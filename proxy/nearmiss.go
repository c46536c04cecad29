package proxy

import (
	"time"

	"go.uber.org/zap"
)

// nearMissMemory is how many normalised blocks the detector remembers
// (16 bytes each in the LRU, plus its list: ≈ 5 MB).
const nearMissMemory = 1 << 16

// nearMissLogEvery bounds the near-miss log lines to one per interval.
const nearMissLogEvery = 10 * time.Second

// checkNearMiss runs the near-identical prompt detector on st's parsed
// prompt: a normalised prefix seen before with other bytes is counted, by
// model, and a sample logged with where the bytes first differ (never the
// text).
func (s *Server) checkNearMiss(st *reqState, reqID []byte) {
	n := &st.norm
	depth, exact, offset := s.near.Observe(n.Hashes(), n.Raw, n.Offsets)
	if exact >= depth {
		return
	}
	s.opt.Metrics.NearMiss([]byte(st.req.Model))
	now := time.Now().UnixNano()
	if last := s.nearLog.Load(); now-last >= int64(nearMissLogEvery) && s.nearLog.CompareAndSwap(last, now) {
		s.opt.Logger.Info("near-identical prompt prefix: the same text up to whitespace, line endings or a byte-order mark, other bytes",
			zap.ByteString("request_id", reqID), zap.String("model", st.req.Model),
			zap.Int("normalised_blocks_matched", depth), zap.Int("exact_blocks_matched", exact),
			zap.Int("first_difference_block_offset", offset))
	}
}
