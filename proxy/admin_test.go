package proxy

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/prefix"
	"github.com/kvroute/kvroute/routing"
)

func TestAdminExplainAndParams(t *testing.T) {
	a, _ := echoBackend(t, "a")
	b, _ := echoBackend(t, "b")
	policy := routing.NewPrefix(prefix.NewIndex(prefix.IndexConfig{BlocksPerEndpoint: 1000}), 1024, routing.DefaultPrefixParams())
	h := startProxy(t, policy, Options{AdminToken: "s3cret"}, a.URL, b.URL)
	mux := h.srv.AdminHandler(h.reg)
	h.srv.HandleExplain(mux, policy)
	h.srv.HandleParams(mux, policy)
	admin := httptest.NewServer(mux)
	defer admin.Close()

	body := `{"model":"m","prompt":"` + strings.Repeat("a shared system prompt. ", 400) + `"}`
	explain := func() explanation {
		resp, err := http.Post(admin.URL+"/debug/route?path=/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var e explanation
		if err := json.NewDecoder(resp.Body).Decode(&e); err != nil || resp.StatusCode != 200 {
			t.Fatalf("status %d: %v", resp.StatusCode, err)
		}
		return e
	}
	cold := explain()
	if cold.Reason != routing.ReasonCold || cold.Pick == "" || len(cold.Endpoints) != 2 || cold.Blocks != 9 {
		t.Fatalf("cold explanation %+v", cold)
	}
	readAll(t, post(t, h.url+"/v1/completions", body)) // routes and records
	warm := explain()
	if warm.Reason != routing.ReasonWarm || warm.Pick != cold.Pick || warm.MatchedBlocks != 9 {
		t.Fatalf("warm explanation %+v", warm)
	}

	// Had the stream failed on the warm pick, its continuation would go to
	// the other endpoint, with the text in its prompt.
	resp, err := http.Post(admin.URL+"/debug/route?path=/v1/completions&failed="+url.QueryEscape(warm.Pick)+"&text="+url.QueryEscape(` "so" far`)+"&tokens=3",
		"application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var cont explanation
	if err := json.NewDecoder(resp.Body).Decode(&cont); err != nil || resp.StatusCode != 200 {
		t.Fatalf("continuation: status %d: %v", resp.StatusCode, err)
	}
	resp.Body.Close()
	if !cont.Continuation || cont.FailedEndpoint != warm.Pick || cont.Pick == "" || cont.Pick == warm.Pick || cont.PromptBytes <= warm.PromptBytes {
		t.Fatalf("continuation explanation %+v (warm %+v)", cont, warm)
	}

	resp, err = http.Post(admin.URL+"/debug/route?path=/v1/models", "application/json", strings.NewReader(body))
	if err != nil || resp.StatusCode != 400 {
		t.Fatalf("non-inference path: %v %d", err, resp.StatusCode)
	}
	resp.Body.Close()

	token := "Bearer s3cret"
	put := func(js string) int {
		req, _ := http.NewRequest(http.MethodPut, admin.URL+"/debug/prefix/params", strings.NewReader(js))
		req.Header.Set("Authorization", token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if put(`{"spill_margin_sec":0.5}`) != 200 || policy.Params().SpillMarginSec != 0.5 || policy.Params().MinMatchBlocks != routing.DefaultPrefixParams().MinMatchBlocks {
		t.Fatalf("params after PUT: %+v", policy.Params())
	}
	if put(`{"min_match_blocks":0}`) != 400 || put(`{"bogus":1}`) != 400 || policy.Params().MinMatchBlocks != routing.DefaultPrefixParams().MinMatchBlocks {
		t.Fatalf("bad params accepted: %+v", policy.Params())
	}
	for _, tok := range []string{"", "Bearer wrong", "s3cret", "Basic s3cret"} {
		token = tok
		if code := put(`{"spill_margin_sec":9}`); code != http.StatusUnauthorized || policy.Params().SpillMarginSec != 0.5 {
			t.Fatalf("PUT with Authorization %q: %d, params %+v", tok, code, policy.Params())
		}
	}
}

// Without an admin token, mutations and profiling are off; probes and
// metrics stay open.
func TestAdminTokenGuards(t *testing.T) {
	a, _ := echoBackend(t, "a")
	for _, tc := range []struct {
		token, auth string
		want        int
	}{{"", "", http.StatusForbidden}, {"", "Bearer x", http.StatusForbidden},
		{"t0k", "", http.StatusUnauthorized}, {"t0k", "Bearer t0k", http.StatusOK}} {
		h := startProxy(t, routing.NewRoundRobin(), Options{AdminToken: tc.token}, a.URL)
		admin := httptest.NewServer(h.srv.AdminHandler(h.reg))
		get := func(path, auth string) int {
			req, _ := http.NewRequest(http.MethodGet, admin.URL+path, nil)
			if auth != "" {
				req.Header.Set("Authorization", auth)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		if got := get("/debug/pprof/cmdline", tc.auth); got != tc.want {
			t.Errorf("token %q, Authorization %q: pprof %d, want %d", tc.token, tc.auth, got, tc.want)
		}
		for _, open := range []string{"/metrics", "/livez", "/readyz"} {
			if got := get(open, ""); got != http.StatusOK {
				t.Errorf("token %q: %s %d, want 200 without credentials", tc.token, open, got)
			}
		}
		admin.Close()
	}
}
