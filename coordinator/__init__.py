"""Coordinator: the Redis-backed GRPO driver (`coordinator start --recipe fp8`)."""
