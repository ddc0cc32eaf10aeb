"""fp8rl: FP8 end-to-end GRPO — shared numerics, weight codec, recipes, config and wire contract."""

__version__ = "0.1.0"
