"""gRPC edge of the trainer service: messages in, messages out, errors mapped by fp8rl.serving."""

from __future__ import annotations

import grpc

from fp8rl.errors import NotReady
from fp8rl.serving import FENCE_METADATA, RESERVED_THREADS, SERVER_THREADS, Capacity, map_errors
from fp8rl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from trainer_service.service import TrainerService

SERVICE_NAME = "fp8rl.v1.Trainer"


def fence_of(context: grpc.ServicerContext) -> str | None:
    """The caller's fencing token, if it sent one."""
    return next((str(v) for k, v in context.invocation_metadata() if k == FENCE_METADATA), None)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Serves as soon as it is bound; every call answers UNAVAILABLE until the learner is attached."""

    def __init__(self, service: TrainerService | None = None, threads: int = SERVER_THREADS) -> None:
        self._service = service
        # Calls that wait for the model share all threads but a few: status and health always get one.
        self.model_calls = Capacity(
            "model calls (TrainStep, ComputeLogprobs, ...)", threads - RESERVED_THREADS
        )

    def attach(self, service: TrainerService) -> None:
        self._service = service

    @property
    def service(self) -> TrainerService:
        if self._service is None:
            raise NotReady("the model is still loading")
        return self._service

    @map_errors
    def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        self.service.check_fence(fence_of(context), "TrainStep")
        with self.model_calls.slot():
            return self.service.train_step(request)

    @map_errors
    def ComputeLogprobs(
        self, request: trainer_pb2.ComputeLogprobsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ComputeLogprobsResponse:
        with self.model_calls.slot():
            return self.service.compute_logprobs(request)

    @map_errors
    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        self.service.check_targets(request)  # before the fence moves: a refused call changes nothing
        self.service.check_fence(fence_of(context), "PublishWeights")
        with self.model_calls.slot():
            return self.service.publish(request)

    @map_errors
    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        self.service.check_fence(fence_of(context), "SaveCheckpoint")
        with self.model_calls.slot():
            return self.service.save_checkpoint()

    @map_errors
    def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return self.service.status()
