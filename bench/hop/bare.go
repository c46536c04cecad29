package hop

import (
	"net"
	"time"

	"github.com/valyala/fasthttp"
)

// BareTarget is the target name of the bare fasthttp reverse proxy: a
// handler that passes the request to a HostClient and its answer back,
// streamed, and nothing else. It measures what Go and fasthttp cost a hop,
// in the same run as kvroute, so that kvroute's own share can be told
// apart (issue #27).
const BareTarget = "fasthttp"

// ServeBare serves the bare proxy on ln in front of backend (host:port)
// until ln is closed. kvhop runs it as its own process (kvhop bare-proxy),
// like the other proxies.
func ServeBare(ln net.Listener, backend string) error {
	c := &fasthttp.HostClient{Addr: backend, MaxConns: 4096, StreamResponseBody: true,
		ReadBufferSize: 16 << 10, MaxIdleConnDuration: time.Minute}
	srv := &fasthttp.Server{NoDefaultDate: true, ReadBufferSize: 16 << 10, MaxRequestBodySize: 1 << 20,
		Handler: func(ctx *fasthttp.RequestCtx) {
			if err := c.Do(&ctx.Request, &ctx.Response); err != nil {
				ctx.Error(err.Error(), fasthttp.StatusBadGateway)
			}
		}}
	return srv.Serve(ln)
}
