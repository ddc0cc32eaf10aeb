"""Trainer service: a gRPC GRPO learner with FP8 linear layers that publishes quantized weights."""
