"""Methods fp8rl adds to vLLM's workers (vLLM's ``worker_extension_cls``), callable by name through
``collective_rpc`` in-process and in worker processes alike."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


def rederive_tied_head(model: Any) -> None:
    """Process a tied output layer again after its shared weight changed (see :meth:`fp8rl_refit`)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight.data_ptr() != embed.weight.data_ptr():
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


class WorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    model_runner: Any
    reload_weights: Any

    def fp8rl_refit(self, **reload_kwargs: Any) -> None:
        """vLLM's in-place ``reload_weights(**reload_kwargs)``, then the tied output layer made anew.

        With tied embeddings the checkpoint has no ``lm_head.weight``, so the reload loads nothing into
        the output layer and does not process it again; on CPU, vLLM computes the logits through a
        oneDNN handle (or a packed copy) made from the weight when it was processed, which would keep the
        first version's embedding while the input embedding moved on. Processing it again re-derives it
        from the shared weight (on CUDA the output layer reads the weight itself; this is then a no-op)."""
        self.reload_weights(**reload_kwargs)
        rederive_tied_head(self.model_runner.model)

    def fp8rl_abort_weight_update(self) -> None:
        """Drop a device-plane update staged on this worker and end its update session (vLLM ends it
        only on the worker that failed): another worker refused the same update, so none loads it."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "abort_weight_update"):
            engine.abort_weight_update()
            engine.reset_weight_update_target()
        self._weight_update_active = False

    def fp8rl_exact_routing(self) -> int:
        """Route every MoE layer with fp8rl.exact.route (exact consistency); returns how many."""
        from rollout_service.vllm_exact import exact_routing

        return exact_routing(self.model_runner.model)

    def fp8rl_record_routing(self) -> tuple[int, int]:
        """Record, from now on, the experts every request's positions are routed to (see
        :class:`RoutingRecorder`); returns (MoE layers, top_k)."""
        recorder = getattr(self, "_fp8rl_routing", None)
        if recorder is None:
            recorder = self._fp8rl_routing = RoutingRecorder(self.model_runner)
        return recorder.moe_layers, recorder.top_k

    def fp8rl_take_routing(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """The routing recorded for each of ``request_ids`` ([positions, MoE layers, top_k]), forgotten
        here; a request nothing was recorded for is left out."""
        return self._fp8rl_routing.take(request_ids)

    def fp8rl_drop_routing(self, request_ids: list[str]) -> None:
        self._fp8rl_routing.take(request_ids)


class RoutingRecorder:
    """The experts vLLM's routers choose, per request and position, in an eager engine (CPU).

    Each MoE layer's router reports its top-k ids through vLLM's capture hook (``set_capture_fn``, the
    hook vLLM's own routed-experts capture uses) into a buffer of this step's tokens; after the step the
    rows are split by request in the batch's order (the model runner lays a step's tokens out request by
    request, ``input_batch.req_ids``, each with its scheduled count) and filed at the positions they
    computed (from the scheduler's ``num_computed_tokens``: a preempted request recomputed from the
    start overwrites what it had)."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        layers = sorted(
            ((m.layer_id, m) for m in runner.model.modules() if isinstance(m, MoERunner)),
            key=lambda lm: lm[0],
        )
        if not layers:
            raise ValueError("the model has no mixture-of-experts layers: there is no routing to record")
        for slot, (layer_id, module) in enumerate(layers):
            if module.is_monolithic or not isinstance(module.router, BaseRouter):
                raise ValueError(
                    f"MoE layer {layer_id}: its kernel routes inside itself, which fp8rl cannot record"
                )
            module.router.set_capture_fn(functools.partial(self._capture, slot))
        router: Any = layers[0][1].router  # (a BaseRouter)
        self.moe_layers, self.top_k = len(layers), int(router.top_k)
        self._ids_dtype = np.uint8 if router.global_num_experts <= 256 else np.uint16
        rows = int(runner.scheduler_config.max_num_batched_tokens)
        self._step = torch.zeros(rows, self.moe_layers, self.top_k, dtype=torch.int32)
        self._routed: dict[str, list[tuple[int, np.ndarray]]] = {}  # request -> (first position, ids)
        self._runner = runner
        forward = runner.execute_model

        @functools.wraps(forward)
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            out = forward(scheduler_output, *args, **kwargs)
            self._file(scheduler_output)
            return out

        runner.execute_model = execute_model

    def _capture(self, slot: int, topk_ids: torch.Tensor) -> None:
        n = min(len(topk_ids), len(self._step))  # (real tokens come first; padding after)
        self._step[:n, slot] = topk_ids[:n].to(self._step.device)

    def _file(self, scheduler_output: Any) -> None:
        total = int(scheduler_output.total_num_scheduled_tokens)
        if not total:
            return
        if total > len(self._step):
            raise RuntimeError(f"a step of {total} tokens exceeds the routing buffer ({len(self._step)})")
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        step = self._step[:total].numpy().astype(self._ids_dtype)
        offset = 0
        for request_id in self._runner.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if n:
                self._routed.setdefault(request_id, []).append(
                    (starts[request_id], step[offset : offset + n])
                )
                offset += n
        if offset != total:
            raise RuntimeError(f"routing of {offset} tokens filed, the step scheduled {total}")

    def take(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """By the ids the engine's caller gave (vLLM's workers see them with 8 random characters added,
        ``{id}-1a2b3c4d``, unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)."""
        internal = {k.rsplit("-", 1)[0] if k not in request_ids else k: k for k in self._routed}
        taken = {}
        for request_id in request_ids:
            chunks = self._routed.pop(internal.get(request_id, request_id), None)
            if not chunks:
                continue
            ids = np.zeros((max(s + len(c) for s, c in chunks), self.moe_layers, self.top_k), self._ids_dtype)
            for start, chunk in chunks:
                ids[start : start + len(chunk)] = chunk
            taken[request_id] = ids
        return taken
