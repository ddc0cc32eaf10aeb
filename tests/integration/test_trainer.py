"""The trainer service through a real gRPC server: exactly-once TrainStep, rejected input leaves every
byte unchanged, ComputeLogprobs, status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.weight_set import raw_bytes
from fp8rl.errors import InvalidRequest
from fp8rl.serving import start_server
from fp8rl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2
from tests.support import (
    assert_pickle_free,
    load_reference,
    reference_logprobs,
    serve_trainer,
    trainer_config,
    unpickling_forbidden,
)
from trainer_service.config import TrainerConfig
from trainer_service.publisher import Publisher, Target
from trainer_service.service import TrainerService, parse_samples


@pytest.fixture
def trainer(tiny_model_dir_f32: Path) -> Iterator[tuple[TrainerService, trainer_pb2_grpc.TrainerStub]]:
    config = trainer_config(
        tiny_model_dir_f32,
        "fp8",
        device="cpu",
        fp8_backend="emulated",
        port=0,
        micro_batch_size=3,
        optimizer={"lr": 1e-3},
    )
    service = TrainerService(config)
    running = serve_trainer(service)
    with grpc.insecure_channel(running.address) as channel:
        yield service, trainer_pb2_grpc.TrainerStub(channel)
    running.stop(0)


def samples(seed: int, count: int = 6) -> list[trainer_pb2.Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(4, 100, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        completion = torch.randint(
            4, 100, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g
        ).tolist()
        logprobs = (-torch.rand(len(completion), generator=g) * 6).tolist()
        out.append(
            trainer_pb2.Sample(
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                gen_logprobs=logprobs,
                reward=float(i % 2),
                group_id=f"g{i // 3}",
            )
        )
    return out


def step_request(
    step: int, batch: list[trainer_pb2.Sample], run_id: str = "run"
) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(
        run_id=run_id, step=step, samples=batch, sampling=common_pb2.SamplingParams(temperature=1.0)
    )


def weight_bytes(service: TrainerService) -> dict[str, bytes]:
    state = {f"model.{k}": v for k, v in service.learner.master_weights().items()}
    for index, fields in service.learner.optimizer.state_dict()["state"].items():
        state |= {f"optim.{index}.{k}": v for k, v in fields.items()}
    return {k: raw_bytes(v).tobytes() for k, v in state.items()}


def test_train_step_is_exactly_once_and_ordered(trainer) -> None:  # type: ignore[no-untyped-def]
    service, stub = trainer
    first = stub.TrainStep(step_request(0, samples(0)), timeout=120)
    assert (first.step, first.weight_version, first.replayed) == (0, 1, False)
    m = first.metrics
    assert (
        m.num_samples == 6 and m.num_tokens > 0 and m.grad_norm > 0 and m.learning_rate == pytest.approx(1e-3)
    )
    assert m.token_mult_prob_error > 1.0 and m.is_weight_max >= m.is_weight_mean >= m.is_weight_min > 0
    after_first = weight_bytes(service)
    again = stub.TrainStep(step_request(0, samples(0)), timeout=120)
    assert again.replayed and again.metrics == first.metrics and again.weight_version == 1
    assert weight_bytes(service) == after_first  # nothing trained twice
    # Only the identical request replays: another batch for a trained step, or no run id, is refused.
    for bad, code, text in (
        (step_request(0, samples(1)), grpc.StatusCode.FAILED_PRECONDITION, "step 0 was trained on another"),
        (step_request(1, samples(1), run_id=""), grpc.StatusCode.INVALID_ARGUMENT, "run_id: required"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.TrainStep(bad, timeout=120)
        assert err.value.code() == code and err.value.details().startswith(text), err.value.details()
    assert weight_bytes(service) == after_first
    with pytest.raises(grpc.RpcError) as err:
        stub.TrainStep(step_request(2, samples(1)), timeout=120)
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expected step 1" in err.value.details()
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.TrainStep(step_request(1, samples(1), run_id="other"), timeout=120)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.TrainStep(step_request(1, samples(1)), timeout=120).weight_version == 2
    assert weight_bytes(service) != after_first
    status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    assert (status.step, status.weight_version, status.backend, status.recipe, status.run_id) == (
        2,
        2,
        "emulated",
        "fp8",
        "run",
    )


def corrupt(field: str) -> list[trainer_pb2.Sample]:
    batch = samples(3)
    s = batch[1]
    if field == "gen_logprobs-length":
        s.gen_logprobs.append(-1.0)
    elif field == "gen_logprobs-nan":
        s.gen_logprobs[0] = float("nan")
    elif field == "gen_logprobs-inf":
        s.gen_logprobs[0] = float("-inf")
    elif field == "gen_logprobs-positive":
        s.gen_logprobs[0] = 0.5
    elif field == "completion-vocab":
        s.completion_token_ids[0] = 100_000
    elif field == "prompt-vocab":
        s.prompt_token_ids[0] = -3
    elif field == "completion-empty":
        del s.completion_token_ids[:]
        del s.gen_logprobs[:]
    elif field == "loss_mask-length":
        s.loss_mask.extend([True] * (len(s.completion_token_ids) + 1))
    elif field == "loss_mask-none":
        s.loss_mask.extend([False] * len(s.completion_token_ids))
    return batch


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("gen_logprobs-length", "samples[1].gen_logprobs"),
        ("gen_logprobs-nan", "samples[1].gen_logprobs"),
        ("gen_logprobs-inf", "samples[1].gen_logprobs"),
        ("gen_logprobs-positive", "samples[1].gen_logprobs"),
        ("completion-vocab", "samples[1].completion_token_ids"),
        ("prompt-vocab", "samples[1].prompt_token_ids"),
        ("completion-empty", "samples[1].completion_token_ids"),
        ("loss_mask-length", "samples[1].loss_mask"),
        ("loss_mask-none", "samples[1].loss_mask"),
        ("empty", "samples"),
    ],
)
def test_malformed_samples_are_rejected_and_nothing_changes(trainer, case: str, field: str) -> None:  # type: ignore[no-untyped-def]
    service, stub = trainer
    before = weight_bytes(service)
    batch = [] if case == "empty" else corrupt(case)
    with pytest.raises(grpc.RpcError) as err:
        stub.TrainStep(step_request(0, batch), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert weight_bytes(service) == before and service.step == 0
    assert stub.TrainStep(step_request(0, samples(3)), timeout=120).weight_version == 1  # still serving


def test_a_loss_mask_trains_and_measures_only_the_policys_tokens(tiny_model_dir_f32: Path) -> None:
    """A multi-turn sample's environment tokens (loss_mask false) are context only: their rollout
    logprobs change nothing, bit for bit, and the policy's tokens are scored as without a mask."""
    from fp8rl.recipes import get_recipe
    from fp8rl.sampling import SamplingSettings
    from trainer_service.learner import Learner

    batch = samples(4)
    masks = [
        [bool(torch.rand(()) < 0.6) or j == 0 for j in range(len(s.completion_token_ids))] for s in batch
    ]
    for s, m in zip(batch, masks, strict=True):
        s.loss_mask.extend(m)
    data = parse_samples(batch, vocab=320, max_positions=512)
    config = trainer_config(tiny_model_dir_f32, "fp8", fp8_backend="emulated")  # type: ignore[arg-type]
    sampling = SamplingSettings()
    masked, unmasked = Learner(config, get_recipe("fp8")), Learner(config, get_recipe("fp8"))
    plain_batch = masked.collate(parse_samples(samples(4), vocab=320, max_positions=512))
    masked_batch = masked.collate(data)
    assert masked_batch.mask.sum() == sum(map(sum, masks)) < plain_batch.mask.sum()
    scored = masked.score(masked_batch, sampling)
    on = masked_batch.mask.bool()
    torch.testing.assert_close(scored[on], unmasked.score(plain_batch, sampling)[on], rtol=0, atol=0)

    # The environment's tokens' logprobs are ignored: other values train the same update, bit for bit.
    for s, m in zip(batch, masks, strict=True):
        s.gen_logprobs[:] = [lp if keep else -50.0 for lp, keep in zip(s.gen_logprobs, m, strict=True)]
    other = parse_samples(batch, vocab=320, max_positions=512)
    assert [s.gen_logprobs for s in other] != [s.gen_logprobs for s in data]
    first, second = masked.train(data, sampling), unmasked.train(other, sampling)
    assert first["num_tokens"] == sum(map(sum, masks))
    for key in ("loss", "token_mult_prob_error", "grad_norm", "num_tokens"):
        assert first[key] == second[key], key
    for (name, p), q in zip(masked.model.named_parameters(), unmasked.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_mean_normalised_advantages_need_non_negative_rewards() -> None:
    batch = samples(3)
    batch[1].reward = -1.0
    assert parse_samples(batch, vocab=320, max_positions=512)  # fine under std normalisation
    with pytest.raises(InvalidRequest, match=r"^samples\[1\]\.reward: must be >= 0"):
        parse_samples(batch, vocab=320, max_positions=512, rewards_non_negative=True)
    batch[1].advantage = 0.5  # an explicit advantage needs no normalisation
    assert parse_samples(batch, vocab=320, max_positions=512, rewards_non_negative=True)


def test_compute_logprobs_matches_the_fp8_reference(trainer, tiny_model_dir_f32: Path) -> None:  # type: ignore[no-untyped-def]
    _, stub = trainer
    seqs = [([5, 6, 7, 8], [9, 10, 11]), ([40, 41], [42, 43, 44, 45, 46])]
    reply = stub.ComputeLogprobs(
        trainer_pb2.ComputeLogprobsRequest(
            sequences=[
                trainer_pb2.TokenSequence(prompt_token_ids=p, completion_token_ids=c) for p, c in seqs
            ],
            sampling=common_pb2.SamplingParams(temperature=0.8),
        ),
        timeout=60,
    )
    assert reply.weight_version == 0
    # The trainer batches (and pads) the two sequences, the reference runs each alone: float32 rounding
    # of other matrix shapes can flip the odd FP8 code (~1e-3 in a logprob); all else agrees to 1e-5.
    # Without activation quantization the reference is far off: the comparison sees the FP8 path.
    errors: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for quantized in (True, False):
        reference = load_reference(tiny_model_dir_f32, fp8=True, activation_fake_quant=quantized)
        for (p, c), got in zip(seqs, reply.results, strict=True):
            ref = reference_logprobs(reference, p, c, temperature=0.8)
            errors[quantized].append((ref - torch.tensor(list(got.logprobs), dtype=torch.float64)).abs())
    fp8_errors, unquantized_errors = torch.cat(errors[True]), torch.cat(errors[False])
    assert (fp8_errors < 1e-5).sum() >= len(fp8_errors) - 1 and fp8_errors.max() < 1e-2, fp8_errors
    assert unquantized_errors.median() > 100 * fp8_errors.median()


def test_padding_for_transformer_engine_changes_nothing(tiny_model_dir_f32: Path) -> None:
    """TE's FP8 GEMMs need the token count padded (to 16 positions here): the padded positions are
    masked, so logprobs, metrics and the update equal those of the unpadded batch up to float32 rounding
    of other matrix shapes. Checked without FP8 (float32, bf16 recipe): a rounding difference can flip
    an FP8 code and hide what this checks, that nothing leaks from the padding."""
    import random

    from fp8rl.recipes import get_recipe
    from fp8rl.sampling import SamplingSettings
    from trainer_service.learner import TE_TOKEN_MULTIPLE, Learner, SampleData, collate

    rng = random.Random()
    data = []
    for i in range(6):
        completion = [rng.randrange(4, 300) for _ in range(rng.randrange(1, 6))]
        prompt = [rng.randrange(4, 300) for _ in range(rng.randrange(3, 9))]
        data.append(SampleData(prompt, completion, [-1.0] * len(completion), float(i % 2), str(i // 2)))
    config = TrainerConfig(model=tiny_model_dir_f32, recipe="bf16", compute_dtype="float32")
    plain, padded = Learner(config, get_recipe("bf16")), Learner(config, get_recipe("bf16"))
    padded.token_multiple = TE_TOKEN_MULTIPLE  # what the te backend pads to
    batch, padded_batch = plain.collate(data), padded.collate(data)
    assert padded_batch.input_ids.shape[1] % TE_TOKEN_MULTIPLE == 0
    assert padded_batch.input_ids.shape[1] > batch.input_ids.shape[1] or batch.input_ids.shape[1] % 16 == 0
    assert torch.equal(collate(data, multiple=1).mask, batch.mask)
    width = batch.targets.shape[1]
    sampling = SamplingSettings()
    torch.testing.assert_close(
        padded.score(padded_batch, sampling)[:, :width], plain.score(batch, sampling), rtol=2e-5, atol=1e-5
    )
    metrics_plain, metrics_padded = plain.train(data, sampling), padded.train(data, sampling)
    for key in ("loss", "token_mult_prob_error", "num_tokens", "grad_norm"):
        assert metrics_padded[key] == pytest.approx(metrics_plain[key], rel=1e-5, abs=1e-7), key
    # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient near eps turns float32 rounding
    # into a fraction of lr, while a leak that flips a gradient's sign moves it by 2 * lr.
    lr = config.optimizer.lr
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(dict(padded.model.named_parameters())[name], p, rtol=0, atol=lr / 2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_exact_mode_scores_only_the_masked_positions_and_the_same_bits(
    tiny_model_dir_f32: Path, recipe: str
) -> None:
    """Exact mode runs the LM head on the completion positions only: their logprobs are the bits of the
    whole forward's (the exact GEMM's rows do not depend on how many it has), 0 elsewhere; sequences
    of several lengths, so the batch has padding."""
    import random

    from fp8rl.logprobs import token_logprobs
    from fp8rl.recipes import get_recipe
    from fp8rl.sampling import SamplingSettings
    from trainer_service.learner import Learner, SampleData

    rng = random.Random()
    data = []
    for i in range(5):
        completion = [rng.randrange(4, 300) for _ in range(rng.randrange(1, 9))]
        prompt = [rng.randrange(4, 300) for _ in range(rng.randrange(3, 12))]
        data.append(SampleData(prompt, completion, [-1.0] * len(completion), float(i % 2), str(i // 2)))
    config = trainer_config(tiny_model_dir_f32, recipe, precision={"consistency": "exact"})
    learner = Learner(config, get_recipe(recipe))
    batch, sampling = learner.collate(data), SamplingSettings(temperature=0.9)
    scored = learner.score(batch, sampling)
    with torch.no_grad():
        logits = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    whole = token_logprobs(logits[:, :-1].float(), batch.targets, temperature=0.9)
    mask = batch.mask != 0
    assert mask.sum() < mask.numel()  # (prompt and padding positions are skipped)
    assert torch.equal(scored[mask], whole[mask])
    assert torch.equal(scored[~mask], torch.zeros_like(scored[~mask]))


def test_the_emulation_pads_as_transformer_engine_does(tiny_model_dir_f32: Path) -> None:
    """The emulated FP8 learner pads its sequences to TE's 16 positions, so that its wgrad quantizes the
    same 128 tokens per feature as TE's (the grouping changes dW: tests/unit/test_fp8_linear.py); without FP8
    linears nothing is padded."""
    from fp8rl.recipes import get_recipe
    from trainer_service.learner import TE_TOKEN_MULTIPLE, Learner, SampleData

    data = [SampleData([5, 6, 7], [8, 9], [-1.0, -1.0], 1.0, "0")]  # 5 positions
    for recipe, multiple in (("fp8", TE_TOKEN_MULTIPLE), ("fp8-rollout", 1)):
        config = trainer_config(tiny_model_dir_f32, recipe, fp8_backend="emulated")  # type: ignore[arg-type]
        learner = Learner(config, get_recipe(recipe))
        assert learner.token_multiple == multiple
        assert learner.collate(data).input_ids.shape[1] == max(5, multiple)


def huge_advantages(batch: list[trainer_pb2.Sample], rows: range) -> list[trainer_pb2.Sample]:
    for i in rows:
        batch[i].advantage = 3e38  # finite, but its gradient is not
    return batch


def test_a_non_finite_gradient_skips_the_step_and_changes_nothing(trainer) -> None:  # type: ignore[no-untyped-def]
    service, stub = trainer
    stub.TrainStep(step_request(0, samples(0)), timeout=120)
    before = weight_bytes(service)
    skipped = stub.TrainStep(step_request(1, huge_advantages(samples(1), range(6))), timeout=120)
    assert skipped.HasField("skipped") and skipped.step == 1 and skipped.weight_version == 1
    assert skipped.skipped.reason == trainer_pb2.StepSkipped.REASON_NON_FINITE_GRADIENT
    assert "step 1: non-finite gradient" in skipped.skipped.detail
    assert weight_bytes(service) == before and service.step == 1
    assert stub.TrainStep(step_request(1, samples(1)), timeout=120).weight_version == 2  # the next try trains


def test_a_non_finite_gradient_in_a_later_mini_batch_undoes_the_earlier_ones(
    tiny_model_dir_f32: Path,
) -> None:
    config = trainer_config(
        tiny_model_dir_f32,
        "fp8",
        mini_batches=2,
        optimizer={"lr": 1e-3},
    )
    service = TrainerService(config)
    service.train_step(step_request(0, samples(0)))
    before = weight_bytes(service)
    skipped = service.train_step(step_request(1, huge_advantages(samples(1), range(3, 6))))
    assert skipped.HasField("skipped") and "mini-batch 1" in skipped.skipped.detail
    assert weight_bytes(service) == before and service.step == 1


def checkpointing(model: Path, root: Path, **settings: int) -> TrainerConfig:
    """A float32 bf16-recipe trainer that checkpoints into ``root``."""
    return trainer_config(model, "bf16", checkpoint_dir=root, **settings)  # type: ignore[arg-type]


def checkpoint_steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_checkpoints_are_kept_to_the_newest_and_leftovers_cleaned(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".tmp-step-00000009-999999999").mkdir()  # left by a process that is gone
    (root / "step-00000042").mkdir()  # a torn checkpoint of an abandoned timeline
    config = checkpointing(tiny_model_dir_f32, root, checkpoint_every=1, keep_checkpoints=2)
    service = TrainerService(config)
    assert checkpoint_steps(root) == ["step-00000042"]
    for step in range(3):
        service.train_step(step_request(step, samples(step)))
    assert checkpoint_steps(root) == ["step-00000002", "step-00000003"]
    resumed = TrainerService(config.model_copy(update={"resume": True}))
    assert resumed.step == 3 and weight_bytes(resumed) == weight_bytes(service)


def older_layout(service: TrainerService, root: Path) -> Path:
    """Checkpoint ``service`` as one process did before every checkpoint had shards: whole tensors in
    model/optimizer.safetensors, AdamW's state by parameter index (its non-tensors in trainer.json)."""
    from trainer_service import checkpoint

    adam = service.learner.optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, fields in adam["state"].items():
        for key, value in fields.items():
            (tensors if isinstance(value, torch.Tensor) else scalars)[f"{index}.{key}"] = value
    parts = {
        "model": dict(service.learner.master_weights()),
        "optimizer": tensors,
        "rng": {"torch": torch.get_rng_state()},
    }
    optimizer = {"param_groups": adam["param_groups"], "scalars": scalars}
    return checkpoint.save(
        root, service.step, parts, service._meta() | {"step": service.step, "optimizer": optimizer}
    )


def test_a_checkpoint_of_the_older_one_process_layout_still_resumes(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    config = checkpointing(tiny_model_dir_f32, tmp_path / "ckpt")
    service = TrainerService(config)
    for step in range(2):
        service.train_step(step_request(step, samples(step)))
    older_layout(service, tmp_path / "ckpt")
    resumed = TrainerService(config.model_copy(update={"resume": True}))
    assert resumed.step == 2 and weight_bytes(resumed) == weight_bytes(service)
    assert resumed.train_step(step_request(1, samples(1))).replayed
    assert (Path(resumed.save_checkpoint().path) / "shards").is_dir()  # written again in today's layout
    assert weight_bytes(TrainerService(config.model_copy(update={"resume": True}))) == weight_bytes(service)


def test_a_checkpoint_is_pickle_free_and_resumes_without_unpickling(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    config = checkpointing(tiny_model_dir_f32, tmp_path / "ckpt")
    service = TrainerService(config)
    service.train_step(step_request(0, samples(0)))
    saved = Path(service.save_checkpoint().path)
    assert_pickle_free(saved)
    with unpickling_forbidden():
        resumed = TrainerService(config.model_copy(update={"resume": True}))
    assert resumed.step == 1 and weight_bytes(resumed) == weight_bytes(service)  # weights and AdamW's
    groups = [g | {"params": [], "betas": tuple(g["betas"])} for g in resumed.learner.optimizer.param_groups]
    assert groups == [g | {"params": []} for g in service.learner.optimizer.param_groups]  # (JSON: a list)
    for trained in (service, resumed):
        trained.train_step(step_request(1, samples(1)))
    assert weight_bytes(resumed) == weight_bytes(service)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_pickled_shards_is_refused_unread(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from trainer_service import checkpoint

    root = tmp_path / "ckpt"
    staged = checkpoint.staging(root, 1)
    staged.mkdir(parents=True)
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=staged / checkpoint.SHARDS, no_dist=True)
    checkpoint.save(root, 1, {"rng": {"torch": torch.get_rng_state()}}, {"step": 1}, staged=staged)
    with unpickling_forbidden(), pytest.raises(RuntimeError, match="pickled"):
        TrainerService(checkpointing(tiny_model_dir_f32, root).model_copy(update={"resume": True}))


class CheckpointError(BaseException):
    """As torch.distributed.checkpoint's CheckpointException: not an Exception."""


@pytest.mark.parametrize(
    "failure",
    [OSError(28, "No space left on device"), RuntimeError("a bug in the writer"), CheckpointError("rank 0")],
    ids=["oserror", "exception", "base-exception"],
)
def test_a_failed_checkpoint_does_not_fail_the_step_and_is_retried(
    tiny_model_dir_f32: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """Whatever a save raises (a full disk on a real filesystem: tests/integration/test_full_disk.py)."""
    from trainer_service import checkpoint

    root = tmp_path / "ckpt"
    service = TrainerService(checkpointing(tiny_model_dir_f32, root, checkpoint_every=2))
    service.train_step(step_request(0, samples(0)))
    real_save = checkpoint.save

    def disk_full(*args: object, **kwargs: object) -> Path:
        raise failure

    monkeypatch.setattr(checkpoint, "save", disk_full)
    response = service.train_step(step_request(1, samples(1)))  # due to checkpoint: the disk is full
    assert response.weight_version == 2 and service.step == 2 and service.save_failures == 1
    assert not root.exists() or checkpoint_steps(root) == []
    monkeypatch.setattr(checkpoint, "save", real_save)
    service.train_step(step_request(2, samples(2)))  # not due, but the failed one is retried now
    assert checkpoint_steps(root) == ["step-00000003"] and not service.save_pending
    assert {s.name: s.value for s in service.prometheus()}["trainer_checkpoint_failures"] == 1
    status = service.status()
    assert (status.checkpoint_failures, status.checkpoint_pending, status.last_checkpoint_step) == (
        1,
        False,
        3,
    )


def test_a_stale_fencing_token_is_refused(trainer) -> None:  # type: ignore[no-untyped-def]
    """A coordinator whose lease was taken over (an older fencing token in the call metadata) can no
    longer train or publish; the newest token goes on; calls without a token are not fenced."""
    service, stub = trainer
    step = service.step
    fenced = [("fp8rl-fence", "7")]
    stub.TrainStep(step_request(step, samples(step)), timeout=120, metadata=fenced)
    before = weight_bytes(service)
    for call in (
        lambda md: stub.TrainStep(step_request(step + 1, samples(step + 1)), timeout=120, metadata=md),
        lambda md: stub.PublishWeights(
            trainer_pb2.PublishWeightsRequest(
                version=step + 1, targets=[trainer_pb2.PublishTarget(address="127.0.0.1:1")]
            ),
            timeout=60,
            metadata=md,
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call([("fp8rl-fence", "6")])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fencing token 6 is stale" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.TrainStep(
            step_request(step + 1, samples(step + 1)), timeout=120, metadata=[("fp8rl-fence", "x")]
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert weight_bytes(service) == before  # nothing trained by the stale coordinator
    assert (
        stub.TrainStep(
            step_request(step + 1, samples(step + 1)), timeout=120, metadata=[("fp8rl-fence", "8")]
        ).weight_version
        == step + 2
    )


class RefusingReplica(rollout_pb2_grpc.RolloutServicer):
    """A stand-in replica that refuses every update with one status code, after reading its first header."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code, self.encodings = code, list[str]()

    def UpdateWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.UpdateWeightsResponse:
        self.encodings.append(next(iter(request_iterator)).header.encoding)
        context.abort(self.code, "refused by the stand-in")
        raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "code, healed",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (grpc.StatusCode.UNAVAILABLE, False),
    ],
)
def test_a_refused_delta_is_followed_by_a_keyframe_unless_the_replica_is_busy_or_away(
    code: grpc.StatusCode, healed: bool, gen: torch.Generator
) -> None:
    replica = RefusingReplica(code)
    running = start_server(lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(replica, s), [])
    publisher = Publisher("bf16", torch.float32, "bf16")
    try:
        state = {"w": torch.randn(8, 8, generator=gen)}
        publisher.last = (1, build_weight_set(state, "bf16", torch.float32))
        [delivery] = publisher.publish(2, lambda: {"w": state["w"] + 1}, [Target(running.address, 1)])
    finally:
        publisher.close()
        running.stop(0)
    assert not delivery.ok and code.name in delivery.error
    assert replica.encodings == (["delta", "keyframe"] if healed else ["delta"])
