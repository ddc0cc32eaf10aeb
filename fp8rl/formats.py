"""The FP8 scale formats, a literal every layer names: here, below fp8rl.quant (torch) and fp8rl.recipes
(pydantic), so that neither has to import the other and a config parses without torch."""

from __future__ import annotations

from typing import Literal, get_args

ScaleFormat = Literal["fp32", "pow2"]
"""FP8 scales as any float32 (the study's) or as powers of two (UE8M0); see fp8rl.quant."""
SCALE_FORMATS: tuple[ScaleFormat, ...] = get_args(ScaleFormat)
