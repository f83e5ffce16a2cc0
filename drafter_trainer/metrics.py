"""The trainer's Prometheus metrics (its own registry as a sidecar, the server's when in-process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "specroll:trainer_"
RECOVERY_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry(auto_describe=True)
        self.consumed = Counter(P + "entries_consumed", "Stream entries read (new, resumed or taken over)",
                                registry=r)
        self.acked = Counter(P + "entries_acked", "Stream entries acked after the checkpoint that took them in",
                             registry=r)
        self.dead = Counter(P + "entries_dead_lettered", "Entries moved to the dead-letter stream, by kind of fault "
                            "(encoding, protobuf, missing, shape, token_range, non_finite, params, error, deliveries)",
                            ["reason"], registry=r)
        self.failed = Counter(P + "entries_failed", "Entries that failed to decode or to be taken in", registry=r)
        self.duplicates = Counter(P + "entries_duplicate", "Entries whose rollout id was already taken in",
                                  registry=r)
        self.taken = Counter(P + "rollouts_taken", "Rollouts taken in, by role", ["role"], registry=r)
        self.lag = Gauge(P + "lag", "Stream entries not yet delivered to the trainer's group", registry=r)
        self.pending = Gauge(P + "pending", "Entries delivered but not yet acked", registry=r)
        self.loss = Gauge(P + "loss", "Mean distillation loss of the last round", registry=r)
        self.steps = Counter(P + "train_steps", "Optimizer steps", registry=r)
        self.rounds = Counter(P + "rounds", "Training rounds", registry=r)
        self.before = Gauge(P + "accepted_length_before",
                            "Expected tokens per step of the served drafter on held-out rollouts", registry=r)
        self.after = Gauge(P + "accepted_length_after",
                           "Expected tokens per step of the trained drafter on the same rollouts", registry=r)
        self.pushes = Counter(P + "pushes", "Drafter pushes to the server by result (ok, error, unsupported, fenced)",
                              ["result"], registry=r)
        self.stale = Gauge(P + "drafter_stale", "1 while the freshness alarm is raised", registry=r)
        self.alarms = Counter(P + "stale_alarms", "Times the freshness alarm was raised", registry=r)
        self.recovery = Histogram(P + "stale_recovery_seconds", "Policy push to recovered accepted length",
                                  buckets=RECOVERY_BUCKETS, registry=r)
        self.last_recovery = Gauge(P + "last_recovery_seconds", "Duration of the last recovery", registry=r)
        self.gate = Gauge(P + "gate_open", "1 when the server is idle or in its long tail", registry=r)
        self.backoff = Counter(P + "backoff_seconds", "Seconds spent waiting for the server to be less busy",
                               registry=r)
        self.lease_held = Gauge(P + "lease_held", "1 while this trainer holds its consumer group's lease, 0 in standby",
                                registry=r)
        self.lease_acquired = Counter(P + "lease_acquired", "Times this trainer took its consumer group's lease",
                                      registry=r)
        self.lease_lost = Counter(P + "lease_lost", "Times the lease was found taken or lapsed while held",
                                  registry=r)
        self.lr = Gauge(P + "learning_rate", "The student's learning rate (halved when a round makes it worse)",
                        registry=r)
