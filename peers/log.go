package peers

import (
	"bytes"

	"go.uber.org/zap"
)

// logWriter takes memberlist's log lines ("2006/01/02 15:04:05 [WARN]
// memberlist: …") to zap at their level: [ERR] and [WARN] as warnings,
// [INFO] as information, the rest (its [DEBUG] chatter) as debug.
type logWriter struct{ l *zap.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	if i := bytes.IndexByte(p, '['); i >= 0 {
		line = string(bytes.TrimSpace(p[i:]))
	}
	switch {
	case bytes.Contains(p, []byte("[ERR]")), bytes.Contains(p, []byte("[WARN]")):
		w.l.Warn(line)
	case bytes.Contains(p, []byte("[INFO]")):
		w.l.Info(line)
	default:
		w.l.Debug(line)
	}
	return len(p), nil
}
