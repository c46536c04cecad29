package proxy

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"

	"github.com/valyala/fasthttp"
)

// Sentinel errors of the proxy, wrapped with %w where they carry detail.
var (
	// ErrNoEndpoint: no usable endpoint for the request (503).
	ErrNoEndpoint = errors.New("proxy: no endpoint available")
	// ErrUpstream: the endpoint failed: connection refused or reset, a
	// malformed response, or a retryable status after the last attempt (502).
	ErrUpstream = errors.New("proxy: upstream failure")
	// ErrUpstreamTimeout: connect or response-header timeout (504).
	ErrUpstreamTimeout = errors.New("proxy: upstream timeout")
	// ErrInternal: a bug in kvroute (500).
	ErrInternal = errors.New("proxy: internal error")
	// ErrBodyTooLarge: the request body exceeds --max-body-bytes (413).
	ErrBodyTooLarge = errors.New("proxy: request body too large")
	// ErrHeaderTooLarge: the request's header block exceeds
	// MaxHeaderBytes (431).
	ErrHeaderTooLarge = errors.New("proxy: request header fields too large")
	// ErrMalformedRequest: the HTTP request could not be parsed (400).
	// Its message never quotes the request: headers carry credentials.
	ErrMalformedRequest = errors.New("proxy: malformed HTTP request")
	// ErrOverloaded: every endpoint was saturated for longer than the
	// queue timeout, or the queue was full (429, with Retry-After).
	ErrOverloaded = errors.New("proxy: all endpoints are saturated; retry later")
	// ErrClientGone: the client left before the answer; it is counted as
	// StatusClientClosedRequest and never sent.
	ErrClientGone = errors.New("proxy: client closed the connection")
)

// StatusClientClosedRequest is nginx's non-standard status for a request the
// client abandoned; it is logged and counted, never sent.
const StatusClientClosedRequest = 499

// badRequestError is a client mistake in an inference body (400).
type badRequestError struct {
	msg   string
	param string
}

func (e *badRequestError) Error() string { return e.msg }

// unknownModelError: no endpoint serves the request's model (404, in
// vLLM's wording), decided from the endpoints' model lists without
// sending the request anywhere.
type unknownModelError struct{ model string }

func (e *unknownModelError) Error() string {
	return fmt.Sprintf("The model `%s` does not exist.", e.model)
}

// statusOf maps a failure to the HTTP status kvroute answers with, the
// OpenAI error type and a short code. It is the one place that decides.
func statusOf(err error) (status int, typ, code string) {
	var bad *badRequestError
	var unknown *unknownModelError
	var rl *rateLimitError
	switch {
	case errors.As(err, &rl):
		return fasthttp.StatusTooManyRequests, "RateLimitError", "rate_limit_exceeded"
	case errors.As(err, &bad):
		return fasthttp.StatusBadRequest, "BadRequestError", "invalid_request"
	case errors.As(err, &unknown):
		return fasthttp.StatusNotFound, "NotFoundError", "model_not_found"
	case errors.Is(err, ErrBodyTooLarge):
		return fasthttp.StatusRequestEntityTooLarge, "BadRequestError", "request_too_large"
	case errors.Is(err, ErrHeaderTooLarge):
		return fasthttp.StatusRequestHeaderFieldsTooLarge, "BadRequestError", "header_too_large"
	case errors.Is(err, ErrMalformedRequest):
		return fasthttp.StatusBadRequest, "BadRequestError", "malformed_request"
	case errors.Is(err, ErrOverloaded):
		return fasthttp.StatusTooManyRequests, "RateLimitError", "overloaded"
	case errors.Is(err, ErrClientGone):
		return StatusClientClosedRequest, "ClientClosedRequest", "client_closed"
	case errors.Is(err, ErrInternal):
		return fasthttp.StatusInternalServerError, "InternalServerError", "internal_error"
	case errors.Is(err, ErrNoEndpoint):
		return fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", "no_endpoint"
	case errors.Is(err, ErrUpstreamTimeout):
		return fasthttp.StatusGatewayTimeout, "GatewayTimeoutError", "upstream_timeout"
	default:
		return fasthttp.StatusBadGateway, "BadGatewayError", "upstream_error"
	}
}

// classifyUpstream wraps a client error from fasthttp as ErrUpstreamTimeout
// or ErrUpstream and returns the metric kind.
func classifyUpstream(err error) (string, error) {
	var ne net.Error
	if errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, fasthttp.ErrDialTimeout) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return failTimeout, fmt.Errorf("%w: %v", ErrUpstreamTimeout, err)
	}
	var small *fasthttp.ErrSmallBuffer
	if errors.As(err, &small) {
		return failConnect, fmt.Errorf("%w: the model server's response header block is larger than %d KiB", ErrUpstream, upstreamHeaderBytes>>10)
	}
	return failConnect, fmt.Errorf("%w: %v", ErrUpstream, err)
}

// The kinds of failed upstream attempts, kvroute_upstream_errors_total's
// kind label.
const (
	failTimeout   = "timeout"   // no answer, or a stall, within its timeout
	failConnect   = "connect"   // the connection failed or broke
	failDropped   = "dropped"   // the endpoint closed or reset the connection after the request was written, before the answer's first byte (unanswered)
	failStatus    = "status"    // a retryable status (429, 503; a decode leg's 5xx)
	failCancelled = "cancelled" // the client left during the attempt
	failBusy      = "busy"      // no free connection to the endpoint
	failFull      = "full"      // the engine answered 429 with others of kvroute's requests running (backpressure)
	failPrefill   = "prefill"   // a prefill leg failed
	failBody      = "body"      // the response body broke after its header
)

// The causes of a stranded prefill KV, kvroute_pd_stranded_total's cause
// label (strand).
const (
	strandClientGone   = "client_gone"   // the client left before a decode leg took it
	strandDecodeFailed = "decode_failed" // the decode legs sent with it failed
	strandSuperseded   = "superseded"    // an endpoint that did not need it answered
)

// errorBody is vLLM's nested error envelope (ErrorResponse in vLLM's
// vllm/entrypoints/openai/protocol.py); code is a string here, as in
// OpenAI's API.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

// writeError answers ctx with an OpenAI-style JSON error body for err and
// returns the status.
func writeError(ctx *fasthttp.RequestCtx, err error) int {
	status, typ, code := statusOf(err)
	var body errorBody
	body.Error.Message = err.Error()
	body.Error.Type = typ
	body.Error.Code = code
	var bad *badRequestError
	if errors.As(err, &bad) && bad.param != "" {
		body.Error.Param = &bad.param
	}
	b, _ := json.Marshal(&body) // cannot fail: strings only
	ctx.Response.Reset()
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
	return status
}
