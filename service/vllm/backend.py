"""vLLM behind the RolloutBackend interface.

A driver thread runs its own asyncio loop with vLLM's `AsyncLLM` (whose engine core runs in its own processes:
tensor / pipeline / data parallel and the Ray executor are vLLM's). Every interface call either posts a
coroutine to that loop (returning a concurrent Future) or reads what the loop published. Everything a request or
a push carries is validated before it reaches vLLM: an exception inside its workers kills its engine.
Weight pushes: service/vllm/pushes.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from service.backend.admission import Admission, request_share
from service.backend.base import (
    CAP_SEEDS,
    CAP_TOP_LOGPROBS,
    BackendInfo,
    NotReady,
    RolloutBackend,
    StatsSnapshot,
    check_mode,
)
from service.backend.events import Failed
from service.backend.hooks import Hooks
from service.config import EngineConfig, ModelConfig
from service.params import SamplingError
from service.tokenizer import Tokenizer
from service.vllm.config import VllmConfig, vllm_drafter
from service.vllm.engine import build_engine, spec_table_for, wants_profile
from service.vllm.profile import profiled_table
from service.vllm.pushes import WeightPushes
from service.vllm.requests import Outbox, RequestRun, Versions
from service.vllm.sampling import check_params
from service.vllm.stats import step_logger, vllm_counters
from service.vllm.weights import WeightFiles, drafter_spec, target_spec

if TYPE_CHECKING:

    from service.backend.events import GenRequest, RequestHandle
    from service.backend.metrics import Metrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class VllmBackend(WeightPushes, RolloutBackend):
    def __init__(self, config: EngineConfig, vllm_config: VllmConfig | None = None, metrics: Metrics | None = None,
                 hooks: Hooks | None = None, admission: Admission | None = None) -> None:
        if not config.model:
            raise ValueError("EngineConfig.model must name a model folder")
        if config.strategy_trace:
            logger.warning("--strategy-trace traces the native backend's adaptive strategy; vLLM runs a fixed k: "
                           "nothing is traced")
        self.config = config
        self.vcfg = vllm_config or VllmConfig()
        self.metrics = metrics
        self.hooks = hooks or Hooks()
        self.admission = admission or Admission()
        if metrics is not None and self.hooks.on_rollout_lost is None:
            self.hooks.on_rollout_lost = metrics.rollout_unrecorded
        self.model_dir = Path(config.model).resolve()
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.drafter = vllm_drafter(config.drafter, self.model_dir)  # a bad --drafter fails here, at start
        self.table = spec_table_for(self.drafter, config, self.vcfg)
        self.versions = Versions(str(config.extra.get("policy_version", "0")),
                                 "none" if self.drafter.method == "none" else f"{self.drafter.method}@0")
        self._tokenizer = Tokenizer.from_dir(self.model_dir)
        self._cpu = str(config.device).startswith("cpu")
        self._files = WeightFiles(self.model_dir)
        self._roles = {"target": target_spec(self.model_config, str(config.dtype))}
        if self.table and (spec := drafter_spec(self.drafter, str(config.dtype))) is not None:
            self._roles["drafter"] = spec
        self._engine: Any = None
        self._vllm: Any = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._loaded = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="specroll-vllm", daemon=True)
        self._runs: dict[str, RequestRun] = {}
        self._outbox = Outbox()
        self._paused = False
        self._held = False  # a wait-mode pause or commit holds new requests back
        self._info: BackendInfo | None = None
        self._strategy = "plain"  # what vLLM's last step ran
        self._sampled_refusal = ""  # why sampled requests are refused under speculation ('' = served)
        self.sampling_checks: list[dict[str, Any]] = []  # each rank's expand / self-check report

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.hooks.start()
        self._thread.start()

    def _drive(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # the engine failed to load or died
            logger.exception("the vLLM engine stopped")
            self._error = self._error or exc
        finally:
            self._ready.clear()
            self._loaded.set()

    async def _main(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        online = None
        if wants_profile(self.drafter, self.config, self.vcfg):
            self.table, depth = await profiled_table(self.config, self.vcfg, self.drafter,
                                                     self.model_config.vocab_size)
            online = depth.to_json()
        self._vllm, self._engine = build_engine(self.config, self.vcfg, self.drafter, self.table,
                                                [step_logger(self._on_step, self.drafter.method)], online)
        # The context vLLM settled on (its auto-fit when --max-model-len is unset: the checkpoint's, cut to the cache)
        self.config.max_model_len = int(self._engine.model_config.max_model_len)
        if self.table:
            await self._check_sampling()
        await self._warm_up()
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        caps = (set() if self._cpu else {CAP_SEEDS}) | (set() if self._sampled_refusal else {CAP_TOP_LOGPROBS})
        covered = ", ".join(sorted({f"{r.get('runner')} verification on {r.get('device')}"
                                    for r in self.sampling_checks}))
        sampling = ("no speculation" if not self.table else f"refused: {self._sampled_refusal}"
                    if self._sampled_refusal else f"exact (self-check passed: {covered})")
        self._info = BackendInfo(
            backend="vllm", model_path=self.model_dir, vocab_size=self.model_config.vocab_size,
            max_model_len=self.config.max_model_len, dtype=str(self.config.dtype), eos_token_id=eos,
            drafter=self.drafter.as_flag(),
            num_slots=self.config.max_num_seqs, capabilities=frozenset(caps), speculative_sampling=sampling,
            parallel=(self.vcfg.tensor_parallel_size, self.vcfg.pipeline_parallel_size, self.vcfg.data_parallel_size))
        self.admission.slots = self.config.max_num_seqs
        self._ready.set()
        self._loaded.set()
        logger.info("vLLM engine ready: %s, drafter %s, speculation table %s", self.model_dir, self.drafter.method,
                    self.table)
        await self._stop_event.wait()
        await self._shutdown()

    async def _check_sampling(self) -> None:
        """Every rank's expand status and sampler self-check (`SpecrollWorkerExtension.specroll_sampling_check`):
        sampled requests under speculation are served only where all of them passed."""
        try:
            self.sampling_checks = list(await self._engine.collective_rpc("specroll_sampling_check"))
        except Exception as exc:  # an engine whose workers cannot run the check is not trusted with sampling
            logger.exception("the speculative sampling self-check could not run")
            self.sampling_checks = [{"rank": -1, "passed": False,
                                     "faults": [f"the self-check could not run ({type(exc).__name__}: {exc})"]}]
        faults = [f"rank {r.get('rank')} ({r.get('runner', '?')} on {r.get('device', '?')}): {f}"
                  for r in self.sampling_checks for f in r.get("faults", [])]
        if not self.sampling_checks:
            faults = ["no worker reported a self-check"]
        self._sampled_refusal = ("the start-up self-check of vLLM's speculative sampling failed: " + "; ".join(faults)
                                 if faults else "")
        for r in self.sampling_checks:
            logger.info("speculative sampling self-check, rank %s: %s", r.get("rank"),
                        {k: v for k, v in r.items() if k != "rank"})
        if faults:
            logger.warning("sampled requests with speculation are refused: %s", self._sampled_refusal)
        if self.metrics is not None:
            self.metrics.speculative_sampling(not faults, self._sampled_refusal)

    def _on_step(self, batch_size: int, strategy: str) -> None:
        self._strategy = strategy
        if self.metrics is not None:
            self.metrics.observe_step(batch_size, strategy)

    async def _warm_up(self) -> None:
        """One tiny request before the server reports ready: a kernel this platform lacks for this model (vLLM's
        CPU attention has no head_dim 16, say) fails the load, not the first caller's request."""
        params = self._vllm.SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)
        async for _ in self._engine.generate({"prompt_token_ids": [0]}, params, request_id="specroll-warm-up"):
            pass

    async def _shutdown(self) -> None:
        for run in list(self._runs.values()):
            for task in run.tasks:
                task.cancel()
        await asyncio.gather(*[t for r in self._runs.values() for t in r.tasks], return_exceptions=True)
        self._engine.shutdown()

    def stop(self, timeout: float = 30.0) -> None:
        if self._aloop is not None and self._stop_event is not None and self._thread.is_alive():
            self._aloop.call_soon_threadsafe(self._stop_event.set)
            self._thread.join(timeout)
        self.hooks.stop()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    @property
    def load_error(self) -> BaseException | None:
        return self._error

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._error is None and (self._thread.is_alive() or not self._loaded.is_set())

    def _call(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if not self.ready or self._aloop is None:
            coro.close()
            raise NotReady(f"model failed to load: {self._error}" if self._error else "model is still loading")
        return asyncio.run_coroutine_threadsafe(coro, self._aloop)

    # -- what it serves --------------------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        if self._info is None or not self.ready:
            raise NotReady(f"model failed to load: {self._error}" if self._error else "model is still loading")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer | None:
        self.info()
        return self._tokenizer

    def stats(self) -> StatsSnapshot:
        self.info()
        runs = list(self._runs.values())
        running = sum(r.num_running() for r in runs)
        total = sum(len(r.samples) - r.finished for r in runs)
        return StatsSnapshot(policy_version=self.versions.policy, drafter_version=self.versions.drafter,
                             num_running=running, num_waiting=max(total - running, 0), paused=self._paused,
                             admission_held=self._held, strategy=self._strategy, **vllm_counters())

    # -- generation ------------------------------------------------------------------------------------------
    def submit_all(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        self.info()
        for req, _ in items:  # what this backend cannot do (the model's bounds were validated by the API)
            check_params(req.params, speculating=bool(self.table), cpu=self._cpu,
                         sampled_refusal=self._sampled_refusal)
            if req.request_id in self._runs:
                raise SamplingError(f"request id {req.request_id!r} is already in use")
        tickets = self.admission.admit([(r.params.n, len(r.prompt_token_ids) + r.params.max_tokens)
                                        for r, _ in items])
        for (_, handle), ticket in zip(items, tickets, strict=True):
            handle.ticket = ticket
        try:
            self._call(self._start(items))
        except NotReady:
            for ticket in tickets:
                ticket.release()
            raise

    async def _start(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        for req, handle in items:
            if req.request_id in self._runs:
                handle.release()
                handle.put_many([Failed(f"request id {req.request_id!r} is already in use", invalid=True)])
                continue
            run = RequestRun(req, handle, self._engine, self._vllm, self.versions, self.hooks, self.metrics,
                             lambda: self._strategy, self._forget, self._outbox,
                             request_share(self.config.max_num_seqs))
            self._runs[req.request_id] = run
            run.start()

    def _forget(self, run: RequestRun) -> None:
        self._runs.pop(run.req.request_id, None)

    def abort(self, request_id: str, reason: str = "client") -> Future[bool]:
        return self._call(self._abort([request_id], reason))

    def abort_all(self, reason: str = "admin") -> Future[list[str]]:
        return self._call(self._abort(list(self._runs), reason))

    async def _abort(self, request_ids: list[str], reason: str) -> Any:
        found = [rid for rid in request_ids if rid in self._runs]
        for rid in found:
            self._runs[rid].aborted = True
        ids = [sid for rid in found for sid in self._runs[rid].sample_ids]
        if ids:
            await self._engine.abort(ids)
        if found and self.metrics is not None:
            self.metrics.aborted(reason, len(found))
        return found if len(request_ids) != 1 else bool(found)

    def pause(self, mode: str) -> Future[list[str]]:
        return self._call(self._pause(check_mode(mode)))

    async def _pause(self, mode: str) -> list[str]:
        """vLLM's own pause: wait lets running requests finish first, keep freezes them. New requests queue
        meanwhile. abort ends the running rows only (partial outputs): vLLM's abort pause would end the waiting
        ones too, so it freezes everything (keep), then aborts the rows that have produced tokens."""
        self._held = mode == "wait"
        try:
            await self._engine.pause_generation(mode="keep" if mode == "abort" else mode, clear_cache=False)
        finally:
            self._held = False
        running: list[str] = []
        if mode == "abort":
            await self._engine.is_paused()  # a round trip: step outputs sent before the pause are queued first
            await asyncio.sleep(0.02)  # ... and handed to their rows (as vLLM's own pause waits)
            running = [rid for rid, r in self._runs.items() if r.num_running()]
            for rid in running:  # their samples held back by the share end too
                self._runs[rid].aborted = True
            ids = [sid for rid in running for sid in self._runs[rid].running_sample_ids()]
            if ids:
                await self._engine.abort(ids)
        self._paused = True
        if running and self.metrics is not None:
            self.metrics.aborted("pause", len(running))
        return running

    def resume(self) -> Future[None]:
        return self._call(self._resume())

    def reset_prefix_cache(self) -> Future[bool]:
        return self._call(self._reset_prefix_cache())

    async def _reset_prefix_cache(self) -> bool:
        return bool(await self._engine.reset_prefix_cache())

    async def _resume(self) -> None:
        await self._engine.resume_generation()
        self._paused = False
