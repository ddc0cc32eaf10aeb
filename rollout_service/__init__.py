"""Rollout service: a gRPC (and OpenAI-compatible HTTP) server around vLLM that generates completions
with per-token logprobs and takes quantized weight updates from the trainer. It holds no training state
(no optimizer, no gradients); what it holds is the weights of one version, its multi-turn episodes and
the high-water mark of the updates it applied."""
