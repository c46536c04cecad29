package proxy

import (
	"encoding/json"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvroute/kvroute/discovery"
)

// answerModels answers GET /v1/models with the union of the model lists
// of the routable serving endpoints (clients call it before anything
// else, and any one endpoint lists only its own); false when no endpoint's
// list is known yet, and the request goes to an endpoint as any other.
func (s *Server) answerModels(ctx *fasthttp.RequestCtx, st *reqState, start time.Time) bool {
	list, ok := s.opt.Pool.Load().Models()
	if !ok {
		return false
	}
	if list == nil {
		list = []discovery.Model{}
	}
	b, err := json.Marshal(struct {
		Object string            `json:"object"`
		Data   []discovery.Model `json:"data"`
	}{"list", list})
	if err != nil {
		return false
	}
	ctx.SetStatusCode(fasthttp.StatusOK)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
	s.endOwnAnswer(ctx, st, fasthttp.StatusOK, nil, start)
	return true
}
