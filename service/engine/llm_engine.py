"""The engine: add_request / step / abort / generate. One step = schedule -> plan -> execute -> update from
output: the scheduler picks the batch, the strategy driver the arm, the runner runs it, the scheduler appends
what it emitted and finishes sequences."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from service.backend.base import StatsSnapshot
from service.config import ConfigError, EngineConfig, ModelConfig
from service.cpu_threads import EngineTeam
from service.drafter_spec import DrafterItem, DrafterSpec
from service.engine.background_compile import BackgroundCompile
from service.engine.cached_model import CachedModel
from service.engine.drafters.base import Drafter
from service.engine.drafters.draft_model import DraftModelDrafter
from service.engine.drafters.eagle import build_eagle
from service.engine.drafters.suffix import SuffixDrafter
from service.engine.kv_cache import KVCache, slots_for_budget
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.speculative.estimates import Ewma
from service.engine.stats import EngineStats, StepRecord
from service.engine.strategy import PLAIN, Arm
from service.engine.strategy_driver import StrategyDriver, open_trace
from service.engine.types import (
    Request,
    RequestOutput,
    SchedulerOutput,
    Sequence,
    StepOutput,
    StepResult,
    TokenResult,
    completion_of,
)
from service.models.llama import CausalLM
from service.models.loader import load_model
from service.params import ModelBounds, SamplingError, SamplingParams, sample_seed, validate_request
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SPEC_HEADROOM = 16  # cache positions past max_model_len that speculative verification may write
BETWEEN_STEPS_MAX_S = 0.05  # a longer gap between two steps is idle time, not per-step overhead


@dataclass(slots=True)
class StepPlan:
    """What a step runs: the arm, its drafter, the drafter that assists it, each row's room (decode)."""

    arm: Arm
    drafter: Drafter | None = None
    assistant: Drafter | None = None
    room: list[int] | None = None


def expand_auto(spec: DrafterSpec, model_dir: Path) -> DrafterSpec:
    """The native engine's "auto": the suffix drafter, plus the model folder's own ``draft/`` model when it ships
    one (the embedded demo model does)."""
    draft = model_dir / "draft"
    shipped = [DrafterItem("draft_model", str(draft))] if (draft / "config.json").is_file() else []
    return spec.expand_auto(DrafterItem("suffix"), *shipped)


def build_drafters(spec: DrafterSpec, target: CachedModel, num_slots: int, seed: int) -> dict[str, Drafter]:
    """The drafters of a resolved setting (no "auto": `expand_auto`), by name: "suffix", "eagle" (a fresh head
    or one from its folder) and "draft" (a draft-model folder). `target` is the served model with its cache:
    drafters share its slots, positions, device and dtype."""
    drafters: dict[str, Drafter] = {}
    vocab = target.cfg.vocab_size
    for item in spec.items:
        if item.method == "suffix":
            drafters["suffix"] = SuffixDrafter(target.device)
            continue
        if item.method == "eagle":
            drafters["eagle"] = build_eagle(item.path, target, num_slots, target.device, seed)
            continue
        path = Path(item.path or item.method)
        if item.method != "draft_model" or not (path / "config.json").is_file():
            raise ConfigError(f"drafter {item.as_flag()!r} is neither 'none', 'suffix' nor a model folder with "
                              "config.json")
        draft_cfg = ModelConfig.from_dir(path)
        if abs(draft_cfg.vocab_size - vocab) > 1024:
            raise ConfigError(f"draft model vocab {draft_cfg.vocab_size} does not match the target's {vocab}: a "
                              "draft model must share the target's tokenizer")
        model = load_model(path, target.dtype, target.device)
        drafters["draft"] = DraftModelDrafter(model, target.cfg, num_slots, target.cache.max_positions, target.device,
                                              compiled=target.graphs is not None or target.compiled is not None)
    return drafters


def compile_in_background(runner: ModelRunner, ks: tuple[int, ...]) -> BackgroundCompile | None:
    """`runner.prepare` where it compiles (CPU), in a thread while steps run eagerly (engine/background_compile.py);
    None where nothing compiles (eager forwards; a GPU captures CUDA graphs in `prepare`)."""
    if runner.target.compiled is None or runner.target.graphs is not None:
        return None
    return BackgroundCompile([(c, runner.query_lens(c, ks)) for c in runner.cached_models()])


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if not config.model:
            raise ValueError("EngineConfig.model must name a model folder (the CLI resolves the default model)")
        self.model_path = Path(config.model)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.model_config: ModelConfig = ModelConfig.from_dir(self.model_path)
        model = load_model(self.model_path, self.dtype, self.device)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        budget = config.kv_cache_memory_gb * 2**30
        token_bytes = self.model_config.kv_bytes_per_token * torch.empty((), dtype=self.dtype).element_size()
        config.resolve_max_model_len(self.model_config.max_position_embeddings,
                                     int(budget // token_bytes) - SPEC_HEADROOM - 1,
                                     f"{config.kv_cache_memory_gb:g} GiB")
        max_positions = config.max_model_len + SPEC_HEADROOM + 1
        num_slots = min(config.max_num_seqs, slots_for_budget(self.model_config, max_positions, self.dtype, budget))
        if 0 < num_slots < config.max_num_seqs:
            logger.warning("the KV cache (%g GiB) holds %d of --max-num-seqs %d sequences of max_model_len %d: raise "
                           "--kv-cache-gb or lower --max-model-len for a larger batch", config.kv_cache_memory_gb,
                           num_slots, config.max_num_seqs, config.max_model_len)
        self.cache = KVCache(self.model_config, num_slots, max_positions, self.dtype, self.device)
        self.scheduler = Scheduler(num_slots, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, self.device, compiled=not config.enforce_eager)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self.failures: dict[str, str] = {}  # request id -> error, for requests that failed on their own
        self.policy_version = str(config.extra.get("policy_version", "0"))
        self.drafter_spec = expand_auto(config.drafter, self.model_path)  # the caller's config stays as it is
        self.drafters: dict[str, Drafter] = build_drafters(self.drafter_spec, self.runner.target, num_slots,
                                                           config.seed)
        self._last_step_end: float | None = None
        self._between_steps = Ewma()
        self._team = EngineTeam() if self.device.type == "cpu" else None  # leaves a push's threads their CPUs
        self.runner.drafters = list(self.drafters.values())
        self.driver = StrategyDriver.configured(config.spec, config.spec_k, config.seed, self.drafters,
                                                self.runner.target)
        self.strategy = self.driver.strategy
        self.runner.prefill_drafters = self.driver.may_run()
        # CUDA graphs (GPU) or compiled forwards (CPU) before the first step, or compiled while steps run eagerly
        self.compiling = compile_in_background(self.runner, self.strategy.depths()) if config.compile_background \
            else None
        t0 = time.perf_counter()
        if self.compiling is None and (n := self.runner.prepare(self.strategy.depths())):
            how = "captured" if self.runner.target.graphs is not None else "compiled"
            logger.info("%s %d decode / verify forwards in %.1f s", how, n, time.perf_counter() - t0)
        self.last_strategy = PLAIN.name  # the label of the last step's choice (metrics, rollout records)
        self.stats = EngineStats()
        self.driver.trace = open_trace(config.strategy_trace)  # last: nothing after it can fail and leave it open

    # -- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        group_id: str | None = None,
    ) -> str:
        """Queue a request from a caller nothing has checked (offline use), with the one validation every API
        runs (`validate_request`; SamplingError naming what does not fit). A sample reaching max_model_len
        ends there with finish reason length."""
        params = params or SamplingParams()
        bounds = ModelBounds(self.model_config.vocab_size, self.config.max_model_len, self.scheduler.num_slots)
        prompt = validate_request(prompt_token_ids, params, bounds, cut_at_context=True)
        return self.enqueue(prompt, params, request_id, group_id)

    def enqueue(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                group_id: str | None = None) -> str:
        """Queue a request already validated (`validate_request`, by its API or `add_request`). What the engine
        relies on for its own state is asserted; a request id still in use is the caller's error (SamplingError)."""
        assert 0 < len(prompt) < self.config.max_model_len, "an unvalidated prompt reached the engine"
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise SamplingError(f"request id {request_id!r} is already in use")
        seqs = [
            Sequence(
                request_id=request_id, index=i, prompt_token_ids=prompt, params=params,
                seed=sample_seed(params.seed, i) if params.seed is not None else self._rng.getrandbits(63),
                group_id=group_id,
            )
            for i in range(params.n)
        ]
        req = Request(request_id, prompt, params, seqs, group_id)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request at any step; its sequences end with finish reason abort and partial output."""
        if request_id not in self.requests:
            return False
        self.scheduler.abort(request_id)
        return True

    def abort_all(self) -> list[str]:
        """Abort every waiting and running request; returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort(rid)
        return ids

    def swap_target(self, model: CausalLM, version: str) -> None:
        """Serve `model` from the next step on. Call between steps; running sequences keep their KV."""
        if model.config != self.model_config:
            raise ValueError("new target weights must have the same architecture as the serving model")
        self.runner.model = model
        self.policy_version = str(version)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def close(self) -> None:
        """At shutdown: stop compiling in the background (the engine serves no more steps)."""
        if self.compiling is not None:
            self.compiling.stop()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting_seqs

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        try:
            start = self._begin_step()
            outputs = self.finish_aborted()
            batch = self.scheduler.schedule()  # idle while paused
            if batch.kind == "idle":
                self.runner.apply_copies(batch.moves)
                return outputs
            plan = self._plan(batch)
            result = self.runner.execute(batch, plan.arm, plan.drafter, plan.assistant, plan.room)
            updated = time.perf_counter()
            outputs += self._update_from_output(result)
            self._record(batch, result, start, updated)
            return outputs
        finally:
            self._last_step_end = time.perf_counter()

    def _begin_step(self) -> float:
        """Between two steps: serve the forwards compiled in the background once ready, and time the gap."""
        start = time.perf_counter()
        if self._last_step_end is not None and start - self._last_step_end < BETWEEN_STEPS_MAX_S:
            # Work between two steps (streaming the last step's tokens out, API threads holding the GIL) is
            # paid once per step, so it is part of what a step costs when strategies are compared.
            self._between_steps.update(start - self._last_step_end, 0.1)
        self.take_compiled()
        if self._team is not None:
            self._team.fit(compiled=any(c.compiled is not None for c in self.runner.cached_models()))
        return start

    def _plan(self, batch: SchedulerOutput) -> StepPlan:
        """The arm a step runs: plain for a prefill; for a decode, the strategy's choice, told each row's room
        (the most drafts it can still emit: its tokens left, less one)."""
        if batch.kind != "decode":
            return StepPlan(PLAIN)
        room = [max(s.tokens_left(self.config.max_model_len) - 1, 0) for s in batch.seqs] \
            if self.strategy.depths() else None
        arm = self.driver.choose(batch.seqs, room)
        assistant = self.drafters.get(arm.assist[0]) if arm.assist else None
        return StepPlan(arm, self.drafters.get(arm.drafter), assistant, room)

    @property
    def between_steps_s(self) -> float:
        return self._between_steps.value or 0.0

    def take_compiled(self) -> None:
        """Serve the forwards compiled in the background once they are all done (engine thread, between steps)."""
        if self.compiling is not None and self.compiling.done:
            if self.compiling.take():  # compiled forwards from this step on: their steps cost other seconds
                self.strategy.forget_costs()
            self.compiling = None

    def _record(self, batch: SchedulerOutput, result: StepResult, start: float, updated: float) -> None:
        """Feedback for the strategy (what the arm that ran cost), counters for the metrics. `start`, `updated`:
        when the step began and when its outputs began to be appended."""
        end = time.perf_counter()
        seconds, postprocess_s = end - start, end - updated
        B = len(result.seqs)
        arm = result.arm
        self.last_strategy = arm.name
        if batch.kind == "decode":
            cost = None if result.captured else seconds + self.between_steps_s
            self.driver.feedback(arm, result, seconds, cost, postprocess_s)
        if not result.k:
            self.stats.record_step(batch.kind, batch, B, seconds)
            return
        record = StepRecord("spec", B, seconds, arm.name, result.k, sum(result.num_drafted),
                            sum(result.num_accepted), result.num_emitted(), result.draft_seconds,
                            seconds - result.draft_seconds)
        self.stats.record_step("spec", batch, B, seconds, record)
        self.stats.add_accepted_per_position([sum(1 for a in result.num_accepted if a > j) for j in range(result.k)])

    @property
    def drafter_version(self) -> str:
        return ",".join(f"{n}@{d.version}" for n, d in self.drafters.items()) or "none"

    def _weighted_drafter(self) -> Drafter | None:
        return next((d for d in self.drafters.values() if d.weights_kind), None)

    def swap_drafter(self, module: nn.Module, version: str) -> None:
        """Serve new drafter weights (a draft model or an EAGLE head) from the next step on (between steps)."""
        drafter = self._weighted_drafter()
        if drafter is None:
            raise ValueError(f"no drafter with weights; drafters: {sorted(self.drafters)}")
        drafter.swap_weights(module, str(version))
        self.driver.renew(drafter.name)  # what it measured of the old weights does not hold for these

    def _update_from_output(self, result: StepResult) -> list[StepOutput]:
        """Each sequence's new tokens, appended by the scheduler (which finishes sequences), then its output."""
        outputs = []
        seqs = result.seqs
        drafter_version = self.drafter_version  # once per step, not per row
        for seq, tokens in zip(seqs, result.tokens, strict=True):
            if seq.is_finished:  # its request failed earlier in this step
                continue
            try:
                self._append(seq, tokens, drafter_version)
            except Exception as exc:  # attributable to this request only: it ends, the others go on
                logger.exception("request %s failed in postprocessing; the rest of the batch continues",
                                 seq.request_id)
                self.fail_request(seq.request_id, f"request failed: {exc}")
                continue
            outputs.append(seq.emit(self.policy_version, drafter_version))
        self._forget_finished(seqs)
        return outputs

    def _append(self, seq: Sequence, tokens: list[TokenResult], drafter_version: str) -> None:
        self.scheduler.update_from_output(seq, tokens, self.eos_token_ids, self.config.max_model_len)
        seq.record_versions(self.policy_version, drafter_version)
        for d in self.runner.drafters:
            d.observe(seq)

    def fail_request(self, request_id: str, message: str) -> None:
        """End one request after an error that is its own: its samples end with finish reason abort and the
        message waits in `failures` for the API layer; no other request is touched."""
        if request_id in self.requests:
            self.failures[request_id] = message
            self.abort(request_id)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def finish_aborted(self) -> list[StepOutput]:
        """The final outputs of the sequences aborted since the last step (no model step runs)."""
        aborted = self.scheduler.take_aborted()
        for seq in aborted:
            for d in self.runner.drafters:
                d.observe(seq)
        drafter_version = self.drafter_version  # once, not per row
        outputs = [s.emit(self.policy_version, drafter_version) for s in aborted]
        self._forget_finished(aborted)
        return outputs

    def _forget_finished(self, seqs: list[Sequence]) -> None:
        for rid in {s.request_id for s in seqs if s.is_finished}:
            req = self.requests.get(rid)
            if req is not None and req.is_finished:
                del self.requests[rid]

    # -- offline convenience ----------------------------------------------------------------------
    def snapshot(self) -> StatsSnapshot:
        """The engine's state and counters as plain values, for other threads (taken on the engine thread)."""
        s = self.stats
        return StatsSnapshot(
            policy_version=str(self.policy_version), drafter_version=self.drafter_version,
            num_running=self.num_running, num_waiting=self.num_waiting, paused=self.scheduler.pause.paused,
            admission_held=self.scheduler.pause.held, compiling=self.compiling is not None, strategy=self.last_strategy,
            mean_accepted_length=s.mean_accepted_length, num_steps=s.num_steps, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens, spec_drafts=s.spec_drafts, spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens, accepted_per_position=tuple(s.accepted_per_position))

    def drafter_weights(self) -> tuple[str, nn.Module] | None:
        """The drafter that has weights (kind "draft_model" or "eagle", its serving module), or None."""
        drafter = self._weighted_drafter()
        return None if drafter is None else (drafter.weights_kind, drafter.weights())

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        reqs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = self.add_request(prompt, p)
            reqs.append(self.requests[rid])
        total = sum(r.params.n * r.params.max_tokens for r in reqs)
        with tqdm(total=total, disable=not use_tqdm, unit="tok", desc="generate") as bar:
            while any(not r.is_finished for r in reqs):
                bar.update(sum(len(o.new_token_ids) for o in self.step()))
        return [
            RequestOutput(r.request_id, r.prompt_token_ids, [completion_of(s) for s in r.seqs], True)
            for r in reqs
        ]
