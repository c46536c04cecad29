package proxy

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvroute/kvroute/bench/sim"
	"github.com/kvroute/kvroute/routing"
)

// The official OpenAI Go SDK, unchanged, works through kvroute in front of
// simulated vLLM pods: chat streaming with usage, completions, models.
func TestOpenAISDKThroughKvroute(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.TimeScale = 100
	fleet := startSimFleet(t, 2, cfg)
	h := startProxy(t, routing.NewLeastRequest(nil), Options{}, fleet.URLs()...)

	client := openai.NewClient(option.WithBaseURL(h.url+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	models, err := client.Models.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(models.Data) == 0 || models.Data[0].ID != cfg.Model {
		t.Fatalf("models %+v", models.Data)
	}

	stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model: cfg.Model,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage("You are terse."),
			openai.UserMessage("Say something."),
		},
		MaxTokens:     openai.Int(12),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var acc openai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Usage.CompletionTokens != 12 || len(acc.Choices) != 1 || acc.Choices[0].Message.Content == "" {
		t.Fatalf("chat stream: %d chunks, usage %+v, choices %+v", chunks, acc.Usage, acc.Choices)
	}

	comp, err := client.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel(cfg.Model),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(strings.Repeat("San Francisco is a city. ", 40))},
		MaxTokens: openai.Int(5),
	})
	if err != nil {
		t.Fatal(err)
	}
	if comp.Usage.CompletionTokens != 5 || len(comp.Choices) != 1 || comp.Choices[0].FinishReason != "length" {
		t.Fatalf("completion %+v", comp)
	}
	h.waitIdle(t)
}
