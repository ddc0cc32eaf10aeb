"""Run under torchrun by tests/integration/test_distributed.py: one GRPO step of a sharded Learner, the
gathered weights and the step's figures written by rank 0.

    torchrun --nproc-per-node N tests/rank_worker.py MODEL RECIPE OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from fp8rl.recipes import get_recipe
from tests.integration.test_distributed import STEP_SAMPLES, learner_config, sampling
from trainer_service.distributed import join_group
from trainer_service.learner import Learner


def main() -> None:
    model, recipe, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    ranks = join_group()
    learner = Learner(learner_config(model, recipe), get_recipe(recipe), ranks)
    metrics = learner.train(STEP_SAMPLES, sampling())
    weights = {k: v.contiguous() for k, v in learner.published_weights().items()}  # gathered on every rank
    if ranks.is_root:
        save_file(weights, out / "weights.safetensors")
        (out / "metrics.json").write_text(
            json.dumps({k: metrics[k] for k in ("loss", "grad_norm", "token_mult_prob_error")})
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
