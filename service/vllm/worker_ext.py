"""Methods vLLM mixes into each of its workers (`worker_extension_cls`); the backend calls them with
`collective_rpc`, so they run on every tensor / pipeline parallel rank.

`specroll_reload_drafter` replaces a drafter's weights in place the way vLLM reloads a target: the draft model's
`load_weights` between the layer-wise reload hooks that re-run the platform's weight processing, so captured graphs
and compiled code keep valid storage.

On CPU platforms the expand fix (service/vllm/expand_fix.py) is probed and installed at import, after the platform
replaced Triton kernels and before the model runner exists. `specroll_sampling_check` reports it per rank and runs
the start-up self-check (service/vllm/sampler_check.py) on this worker's rejection sampler.

Nothing may raise out of these methods: an exception inside a worker kills vLLM's engine. Failures come back as a
message, and the backend refuses the push or the sampled requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _expand_at_import() -> dict[str, str]:
    """The expand fix on CPU platforms, before any model code runs (GPUs: at the self-check, on the device)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return {}
        from service.vllm.expand_fix import ensure

        return ensure("cpu")
    except Exception as exc:
        logger.exception("probing vLLM's expand failed")
        return {"before": f"probe failed: {type(exc).__name__}: {exc}", "fix": "none", "after": "unknown"}


EXPAND_AT_IMPORT = _expand_at_import()  # what this worker process found and did, once, read-only afterwards


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

    def specroll_sampling_check(self) -> dict[str, Any]:
        """This rank's evidence for exact speculative sampling: the expand (found, fix, now) and the self-check
        of its rejection sampler. `passed` only where both hold."""
        from service.vllm.expand_fix import ensure

        status: dict[str, Any] = {"rank": self._specroll_rank(), "expand_at_import": dict(EXPAND_AT_IMPORT)}
        try:
            runner = self.model_runner
            device = getattr(runner, "device", "cpu")
            mrv2 = ".v1.worker.gpu." in type(runner).__module__
            status.update(device=str(device), runner="MRv2" if mrv2 else "V1")
            status["expand"] = expand = ensure(device)
            if mrv2:
                from service.vllm.sampler_adapters import mrv2_verifier as make
            else:
                from service.vllm.sampler_adapters import v1_verifier as make
            from service.vllm.sampler_check import run_check

            status["sampler"] = check = run_check(make(device), device)
            faults = ([f"expand: {expand['after']}"] if expand["after"] else []) + check["faults"]
        except Exception as exc:  # raising here would kill vLLM's engine
            logger.exception("the speculative sampling self-check failed to run")
            faults = [f"the self-check raised {type(exc).__name__}: {exc}"]
        status.update(passed=not faults, faults=faults)
        return status

    def _specroll_rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

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
