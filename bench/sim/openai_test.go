package sim

import (
	"context"
	"errors"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// TestOpenAISDK drives the simulator with the official Go SDK.
func TestOpenAISDK(t *testing.T) {
	p, url := servePod(t, fastConfig())
	model := p.Config().Model
	client := openai.NewClient(
		option.WithBaseURL(url+"/v1"),
		option.WithAPIKey("sk-sim"),
		option.WithHTTPClient(newClient(t)),
		option.WithMaxRetries(0),
	)
	ctx := context.Background()

	t.Run("chat streaming", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model:               model,
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Say hi.")},
			MaxCompletionTokens: openai.Int(12),
			StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		})
		var acc openai.ChatCompletionAccumulator
		deltas := 0
		for stream.Next() {
			chunk := stream.Current()
			acc.AddChunk(chunk)
			if len(chunk.Choices) > 0 && chunk.Choices[0].Delta.Content != "" {
				deltas++
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if deltas != 12 || acc.Usage.CompletionTokens != 12 || acc.Usage.PromptTokens == 0 {
			t.Errorf("%d content deltas, usage %+v", deltas, acc.Usage)
		}
		if len(acc.Choices) != 1 || acc.Choices[0].FinishReason != "length" || CountTokens(acc.Choices[0].Message.Content) != 12 {
			t.Errorf("accumulated %+v", acc.Choices)
		}
	})
	t.Run("completions", func(t *testing.T) {
		res, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model:     openai.CompletionNewParamsModel(model),
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(5),
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Choices) != 1 || res.Choices[0].FinishReason != "length" || res.Usage.CompletionTokens != 5 {
			t.Errorf("completion %+v", res)
		}
	})
	t.Run("models", func(t *testing.T) {
		page, err := client.Models.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Data) != 1 || page.Data[0].ID != model || page.Data[0].OwnedBy != "vllm" {
			t.Errorf("models %+v", page.Data)
		}
	})
	t.Run("error", func(t *testing.T) {
		_, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model:  openai.CompletionNewParamsModel("no-such-model"),
			Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")},
		})
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 {
			t.Errorf("error %v, want a 404 *openai.Error", err)
		}
	})
}
