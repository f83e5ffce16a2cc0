"""Methods vLLM mixes into each of its workers (`worker_extension_cls`); the backend calls them with
`collective_rpc`, so they run on every tensor / pipeline parallel rank.

vLLM can replace the target's weights in place on every platform (`reload_weights`), but a drafter's only over
its GPU transfer engines (NCCL / CUDA IPC). `specroll_reload_drafter` fills that gap the way vLLM reloads a
target: the draft model's own `load_weights` between the layer-wise reload hooks that re-run the platform's
weight processing (CPU repacking, quantisation) into the existing tensors, so captured graphs and compiled code
keep pointing at valid storage.

Nothing may raise out of these methods: an exception inside a worker kills vLLM's engine. Failures come back as
a message instead, and the backend turns them into a refused push.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


class SpecrollWorkerExtension:
    """Mixed into vLLM's worker class: `self` is a vLLM worker with a `model_runner`."""

    model_runner: Any

    def specroll_drafter_kind(self) -> str:
        """The class of this worker's drafter model ('' when its drafter has no model)."""
        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        return "" if model is None else type(model).__name__

    def specroll_reload_drafter(self, weights_path: str) -> str:
        """Load the draft model's weights from a folder of safetensors files (Hugging Face names, the layout of
        the draft checkpoint). Returns '' on success, else what went wrong."""
        try:
            return self._specroll_load_drafter(Path(weights_path))
        except Exception as exc:  # raising here would kill vLLM's engine
            logger.exception("drafter reload from %s failed", weights_path)
            error = f"{type(exc).__name__}: {exc}"
        # A load that failed half-way may leave layers without storage: put the drafter's own checkpoint back.
        try:
            original = Path(self.model_runner.vllm_config.speculative_config.draft_model_config.model)
            self._specroll_load_drafter(original)
            return f"{error} (the drafter's weights from {original} were restored)"
        except Exception:
            logger.exception("restoring the drafter's own weights failed")
            return f"{error} (restoring the drafter's own weights failed too)"

    def _specroll_load_drafter(self, folder: Path) -> str:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if model is None:
            return "this engine's drafter has no model to load weights into"
        draft_config = self.model_runner.vllm_config.speculative_config.draft_model_config
        initialize_layerwise_reload(model)
        loaded = model.load_weights(_tensors(folder))
        finalize_layerwise_reload(model, draft_config)
        expected = {name for name, _ in model.named_parameters()}
        missing = sorted(expected - set(loaded or expected))
        return f"the drafter did not receive {len(missing)} tensors, e.g. {missing[:3]}" if missing else ""
