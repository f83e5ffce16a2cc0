"""The distillation loop: take rollouts in, train in the server's idle time, measure, push, checkpoint, ack.

Accounting (what "every entry exactly once" means, see ledger.py): a rollout's id enters the ledger at
the checkpoint after it was read, and its stream entry is acked only after that checkpoint. A crash before
the checkpoint loses the training with the process, and the entry is delivered again; a crash after it
finds the id in the ledger and acks the redelivered entry without training it again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Protocol

import torch

from drafter_trainer.batch import usable
from drafter_trainer.checkpoint import CheckpointStore, load_optimizer
from drafter_trainer.config import TrainerConfig
from drafter_trainer.freshness import FreshnessAlarm
from drafter_trainer.ledger import Ledger
from drafter_trainer.measurement import FRESH_LR, MAX_LR_CUTS, TUNE_LR, Measurement, Part, overall, vars_of
from drafter_trainer.metrics import TrainerMetrics
from drafter_trainer.passes import GateClosed, Passes
from drafter_trainer.pool import RolloutPool
from drafter_trainer.servers import PushRefused, ServerState
from drafter_trainer.source import Entry, Source
from drafter_trainer.students import Student
from drafter_trainer.teacher import Teacher
from service.buffer.codec import BufferedRollout, PayloadError, decode_entry

logger = logging.getLogger(__name__)


class Server(Protocol):
    def state(self) -> ServerState: ...

    def push(self, student: Student, module: torch.nn.Module, version: str) -> None: ...


class Fence(Protocol):
    """The consumer group's lease (lease.py): whether this trainer may still act for the group."""

    @property
    def held(self) -> bool: ...

    def confirm(self) -> bool: ...


class DrafterTrainer:
    def __init__(self, cfg: TrainerConfig, source: Source, server: Server, student: Student, teacher: Teacher,
                 metrics: TrainerMetrics | None = None, store: CheckpointStore | None = None,
                 lease: Fence | None = None) -> None:
        self.cfg, self.source, self.server, self.student, self.teacher = cfg, source, server, student, teacher
        self.lease = lease  # None: the only trainer of its source (in-process)
        self.metrics = metrics or TrainerMetrics()
        if source is not None:
            source.on_dead_letter = lambda kind: self.metrics.dead.labels(kind).inc()
        self.store = store
        self.lr = cfg.lr if cfg.lr is not None else FRESH_LR if student.fresh else TUNE_LR
        self.optim = torch.optim.AdamW(student.module.parameters(), lr=self.lr)
        self.passes = Passes(cfg, student, teacher, self._still_open)
        self.served = student.frozen_copy()
        self.served_version: str | None = None  # None: the drafter the server started with
        self.pool = RolloutPool(cfg)
        self.alarm = FreshnessAlarm(cfg.alarm_ratio, cfg.recover_ratio, self.metrics)
        self.ledger = Ledger(cfg.dedupe_window)
        self.round = self.pushes = 0
        self.history: list[Measurement] = []
        self.rng = random.Random(cfg.seed)
        self._state: ServerState | None = None
        self._state_at = 0.0
        self._round_steps = 0  # training steps done in the round under way (a closed gate pauses a round)
        self._last_round = time.monotonic()
        self._repush = False
        self._resume()
        self.metrics.lr.set(self.optim.param_groups[0]["lr"])

    # -- the loop -------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """Train until `stop` is set, `max_rounds` are done or the lease is lost."""
        stop = stop or threading.Event()
        while not stop.is_set() and (self.cfg.max_rounds is None or self.round < self.cfg.max_rounds):
            if self.lease is not None and not self.lease.held:
                logger.warning("the consumer group's lease is no longer ours: this trainer stops")
                return
            try:
                self.tick()
            except Exception:
                logger.exception("trainer step failed; retrying")
                stop.wait(self.cfg.backoff_s)

    def fenced(self, what: str) -> bool:
        """True (and logged) when the lease is not confirmed ours: `what` must not happen."""
        if self.lease is None or self.lease.confirm():
            return False
        logger.warning("not %s: this trainer no longer holds the consumer group's lease", what)
        return True

    def tick(self) -> None:
        self.server_state()
        if self.lease is not None and not self.lease.held:
            return  # lost while this tick began: read nothing more (run() stops)
        entries = self.source.read(self.cfg.read_count, self.cfg.block_ms)
        if self.lease is not None and not self.lease.held:
            return  # lost during the read: the entries stay pending for the group's new holder to claim
        self.take_in(entries)
        lag, pending = self.source.lag()
        self.metrics.lag.set(lag)
        self.metrics.pending.set(pending)
        if not self.due():
            return
        # Looked at afresh, every `backoff_s` while busy: in an RL loop the server is idle while the policy
        # trainer updates, a second or two each step; a backoff that grew (to 30 s) slept through most of those.
        if not self.gate_open(self.server_state(fresh=True)):
            time.sleep(self.cfg.backoff_s)
            self.metrics.backoff.inc(self.cfg.backoff_s)
            return
        self.train_round()

    def server_state(self, fresh: bool = False) -> ServerState | None:
        if fresh or time.monotonic() - self._state_at >= self.cfg.info_interval_s or self._state is None:
            try:
                self._state = self.server.state()
            except Exception as exc:
                logger.warning("cannot read the server's state: %s", exc)
            self._state_at = time.monotonic()
            if self._state is not None:
                self.follow_policy(self._state)
        return self._state

    def follow_policy(self, st: ServerState) -> None:
        if self.pool.note_version(st.policy_version):
            logger.info("server serves policy version %s", st.policy_version)
            self.teacher.sync(st.policy_version)
            self.alarm.policy_changed(st.policy_version)
        if self._repush and self.served_version and self.served_version not in st.drafter_version:
            self._repush = False
            self._push(self.served, self.served_version)

    def take_in(self, entries: list[Entry]) -> None:
        """Decode and account for each entry on its own: one that is not a rollout, or whose token ids lie outside
        the vocabulary the drafter is trained on, is dead-lettered at once (a retry decodes it the same way); one
        whose taking-in fails for another reason is left for redelivery. Either way the rest go on."""
        for e in entries:
            self.metrics.consumed.inc()
            try:
                r = decode_entry(e.entry_id, e.fields, vocab_size=self.student.vocab)
            except PayloadError as exc:
                self.metrics.failed.inc()
                self.source.dead_letter(e, str(exc), exc.reason)
                continue
            try:
                self._take(e, r)
            except Exception as exc:
                logger.exception("taking in entry %s failed", e.entry_id)
                self.metrics.failed.inc()
                self.source.fail(e, f"{type(exc).__name__}: {exc}", "error")

    def _take(self, e: Entry, r: BufferedRollout) -> None:
        seen = self.ledger.seen(r.rollout_id)
        if seen is not None:
            self.metrics.duplicates.inc()
            if seen == "settled":
                self._ack([e.entry_id])
            else:
                self.ledger.hold(e.entry_id)
            return
        role = self.pool.role(r.rollout_id) if usable(r, self.cfg.max_seq_len, self.student.min_col) else "skip"
        self.ledger.take(r.rollout_id, role, e.entry_id)
        self.metrics.taken.labels(role).inc()
        self.pool.add(r, role)

    def due(self) -> bool:
        waited = time.monotonic() - self._last_round >= self.cfg.max_wait_s
        return len(self.pool.fresh) >= self.cfg.min_new or (bool(self.ledger.held) and waited)

    def gate_open(self, st: ServerState | None) -> bool:
        cfg = self.cfg
        if cfg.gate == "always" or st is None:
            ok = True
        else:
            idle = st.paused or (st.num_running == 0 and st.num_waiting == 0)
            tail = st.num_waiting == 0 and st.num_running <= cfg.tail_max_running
            ok = idle or (cfg.gate == "tail" and tail)
        if not ok and cfg.max_defer_s > 0 and time.monotonic() - self._last_round > cfg.max_defer_s:
            ok = True
        self.metrics.gate.set(1 if ok else 0)
        return ok

    # -- one round ------------------------------------------------------------------------------------
    def _still_open(self) -> bool:
        return self.cfg.gate == "always" or self.gate_open(self.server_state(fresh=True))

    def train_round(self) -> Measurement | None:
        """Train `steps_per_round` steps, then measure and maybe push. The gate is checked again before every
        step and every piece of one (passes.py): when it closes (say the server got busy again) the round
        pauses and goes on at the next opening, so training never holds the compute decoding needs for longer
        than one piece of `micro_tokens` tokens."""
        losses = []
        steps = self.cfg.steps_per_round if self.pool.fresh else 0
        while self._round_steps < steps:
            if self._round_steps and not self._still_open():
                return None
            self._round_steps += 1
            rollouts = self.pool.sample(self.cfg.batch_rollouts, self.rng)
            if rollouts:  # rewards reported since the rollout was read count too
                got = self.source.rewards([r.rollout_id for r in rollouts])
                for r in rollouts:
                    r.reward = got.get(r.rollout_id, r.reward)
            try:
                loss = self.train_step(rollouts) if rollouts else None
            except GateClosed:
                self._round_steps -= 1
                return None
            if loss is not None:
                losses.append(loss)
        if steps and not self._still_open():
            return None  # measure at the next opening (the held-out measure is several forwards)
        groups = self.pool.heldout_recent()
        held = sum(len(rs) for _, rs in groups)
        measured: list[Part] = []
        if held >= self.cfg.min_heldout:
            try:  # each version apart: the freshness alarm reads the current version's alone
                measured = [Part(v, len(rs), *self.passes.measure([self.served, self.student.module], rs))
                            for v, rs in groups]
            except GateClosed:
                return None  # measure at the next opening
        self._round_steps = 0
        self.round += 1
        self.metrics.rounds.inc()
        self.pool.fresh.clear()
        if losses:
            self.metrics.loss.set(sum(losses) / len(losses))
        m = self.evaluate(held, measured) if measured else None
        self.commit()
        self._last_round = time.monotonic()
        return m

    def train_step(self, rollouts: list[BufferedRollout]) -> float | None:
        loss = self.passes.step(self.optim, rollouts, self.pool.weights(rollouts))
        if loss is not None:
            self.metrics.steps.inc()
        return loss

    def evaluate(self, heldout: int, parts: list[Part]) -> Measurement:
        """Record a round's measure (the served drafter and the trained one on each version's held-out rollouts,
        newest first) and push the trained one if it does better on them all together."""
        before, after = overall(parts)
        self.metrics.before.set(before)
        self.metrics.after.set(after)
        m = Measurement(self.round, parts[0].version, self.served_version or "initial", before, after, heldout)
        current = next((p for p in parts if p.version == self.pool.current
                        and 2 * p.rollouts >= self.cfg.min_heldout), None)
        if current is not None:  # what the server's drafter does on the current policy right now
            self.alarm.observe(current.lengths[0])
        if after > before + self.cfg.push_margin:
            version = f"{self.cfg.version_prefix}-{self.pushes + 1}"
            if self._push(self.student.module, version):
                self.served = self.student.frozen_copy()
                m.pushed = True
                if current is not None:
                    self.alarm.observe(current.lengths[1])
        elif after < before - self.cfg.push_margin:
            self.restart_from_served()
            m.restarted = True
        logger.info("round %d: accepted length %.3f (served %s) -> %.3f (trained) on %d held-out rollouts of "
                    "policy %s%s", self.round, before, m.served_version, after, heldout, m.policy_version,
                    f"; pushed {self.served_version}" if m.pushed else "; worse: restarted" if m.restarted else "")
        self.history.append(m)
        return m

    def restart_from_served(self) -> None:
        """measurement.py: train on from the served drafter, with fresh moments and half the learning rate."""
        self.student.load_weights(self.student.module, self.served.state_dict())
        self.optim.state.clear()
        for group in self.optim.param_groups:
            group["lr"] = max(group["lr"] / 2, self.lr / MAX_LR_CUTS)
        self.metrics.lr.set(self.optim.param_groups[0]["lr"])
        logger.info("training again from the served drafter at lr %.2g", self.optim.param_groups[0]["lr"])

    def _push(self, module: torch.nn.Module, version: str) -> bool:
        if self.fenced(f"pushing drafter {version}"):
            self.metrics.pushes.labels("fenced").inc()
            return False
        try:
            self.server.push(self.student, module, version)
        except PushRefused as exc:
            self.metrics.pushes.labels("unsupported").inc()
            logger.warning("drafter not pushed: %s", exc)
            self._save_served(module)
            return False
        except Exception as exc:
            self.metrics.pushes.labels("error").inc()
            logger.warning("drafter push %s failed: %s", version, exc)
            return False
        self.metrics.pushes.labels("ok").inc()
        self.pushes += 1
        self.served_version = version
        self._save_served(module)
        return True

    def _save_served(self, module: torch.nn.Module) -> None:
        if self.store is not None:
            self.student.save_folder(module, self.store.served_dir())

    # -- accounting -----------------------------------------------------------------------------------
    def commit(self) -> None:
        """Checkpoint what was taken in, then ack its entries (neither once the lease is lost: the trainer that
        took it over has the entries delivered again and owns the checkpoint)."""
        if self.fenced("checkpointing or acking"):
            return
        held = self.ledger.settle()
        if self.store is not None:
            state = {"round": self.round, "pushes": self.pushes, "served_version": self.served_version,
                     "versions": self.pool.versions, "history": [vars_of(m) for m in self.history[-100:]],
                     **self.ledger.state()}
            self.store.save(self.round, self.student.module.state_dict(), self.served.state_dict(), self.optim,
                            state)
        self._ack(held)

    def _ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            self.source.ack(entry_ids)
            self.metrics.acked.inc(len(entry_ids))

    def _resume(self) -> None:
        loaded = self.store.load() if self.store is not None else None
        if loaded is None:
            return
        candidate, served, optim, state = loaded
        self.student.load_weights(self.student.module, candidate)
        self.student.load_weights(self.served, served)
        load_optimizer(self.optim, optim, state["param_groups"])
        self.round, self.pushes = int(state["round"]), int(state["pushes"])
        self.served_version = state.get("served_version")
        self.ledger.load(state)
        self._repush = self.served_version is not None

