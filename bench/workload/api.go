package workload

import (
	"fmt"
	"strings"
)

// API selects the OpenAI endpoint requests are sent to.
type API uint8

// APIs.
const (
	// APICompletions posts {"prompt": …} to /v1/completions.
	APICompletions API = iota
	// APIChat posts {"messages": […]} to /v1/chat/completions.
	APIChat
)

// String returns the API's flag spelling.
func (a API) String() string {
	if a == APIChat {
		return "chat"
	}
	return "completions"
}

// Path returns the API's request path.
func (a API) Path() string {
	if a == APIChat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// MarshalText implements encoding.TextMarshaler.
func (a API) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *API) UnmarshalText(b []byte) (err error) { *a, err = ParseAPI(string(b)); return err }

// ParseAPI converts a flag value ("completions" or "chat") to an API.
func ParseAPI(s string) (API, error) {
	switch strings.ToLower(s) {
	case "completions", "completion", "":
		return APICompletions, nil
	case "chat":
		return APIChat, nil
	}
	return 0, fmt.Errorf("%w: unknown API %q (want completions or chat)", ErrConfig, s)
}
