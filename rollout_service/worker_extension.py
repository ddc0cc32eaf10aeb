"""Methods fp8rl adds to vLLM's workers (vLLM's ``worker_extension_cls``), callable by name through
``collective_rpc`` in-process and in worker processes alike."""

from __future__ import annotations

from typing import Any


class RefitExtension:
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
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or head.weight.data_ptr() != embed.weight.data_ptr():
            return
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
