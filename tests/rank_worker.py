"""Run under torchrun by tests/integration/test_distributed.py: one GRPO step of a sharded Learner, the
gathered weights and the step's figures written by rank 0. With CHECKPOINTS, the step starts from their
newest (resumed with unpickling forbidden; its gathered weights written first, as
``resumed.safetensors``) and is checkpointed there.

    torchrun --nproc-per-node N tests/rank_worker.py MODEL RECIPE OUT_DIR [CHECKPOINTS]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8rl.recipes import get_recipe
from tests.integration.test_distributed import STEP_SAMPLES, learner_config, sampling
from tests.support import unpickling_forbidden
from trainer_service import checkpoint
from trainer_service.distributed import join_group, leave_group
from trainer_service.learner import Learner


def main() -> None:
    model, recipe, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    checkpoints = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    ranks = join_group()
    learner = Learner(learner_config(model, recipe), get_recipe(recipe), ranks)
    if checkpoints is not None:
        with unpickling_forbidden():
            checkpoint.resume(checkpoints, learner)
        write(learner.published_weights(), out / "resumed.safetensors", ranks.is_root)
    metrics = learner.train(STEP_SAMPLES, sampling())
    write(learner.published_weights(), out / "weights.safetensors", ranks.is_root)
    if checkpoints is not None:
        checkpoint.write(checkpoints, learner, {})
    if ranks.is_root:
        (out / "metrics.json").write_text(
            json.dumps({k: metrics[k] for k in ("loss", "grad_norm", "token_mult_prob_error")})
        )
    leave_group()


def write(weights: Mapping[str, torch.Tensor], path: Path, root: bool) -> None:
    """``weights``, gathered on every rank, saved by the root."""
    gathered = {k: v.contiguous() for k, v in weights.items()}
    if root:
        save_file(gathered, path)


if __name__ == "__main__":
    main()
