"""Rollout service: a stateless gRPC server around vLLM that generates completions with per-token
logprobs and takes quantized weight updates from the trainer."""
