// Package kvevents owns the engines' KV-cache event stream: the ZeroMQ
// subscriber (over kvroute's one ZMTP implementation, which bench/sim's
// publisher also speaks), the batch decoders, sequence checking with
// replay, and the off-path tokenizer that links forwarded prompts to the
// tokens the events name. EngineTruth joins them to prefix.Truth, the
// token-keyed residency in the prefix index that routing reads; nothing on
// the request path waits on events or tokenization.
package kvevents

import "errors"

var (
	// ErrBadConfig is returned by Subscriber.Run for an unusable Config.
	ErrBadConfig = errors.New("kvevents: bad configuration")
	// ErrRunning is returned by Subscriber.Run once Run started.
	ErrRunning = errors.New("kvevents: subscriber already running")
)
