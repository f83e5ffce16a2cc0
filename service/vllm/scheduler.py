"""vLLM's scheduler with specroll's online speculation depth (`service/vllm/online.py`).

Loaded by name in vLLM's engine-core process (`scheduler_cls`), configured through
`additional_config["specroll_online"]`. It changes one thing: the batch size -> k lookup vLLM's scheduler reads
each step (`dynamic_sd_lookup`) is the one `OnlineDepth` gives for that step, fed with every verified draft
vLLM reports (`make_spec_decoding_stats`, called per request per step, counted before vLLM's own `log_stats`
check). A resume from a pause (`set_pause_state`), where every weight push happens, restarts the measured
acceptance from the profile's (`OnlineDepth.renew`). Verification, sampling and the rest of scheduling are
vLLM's, unchanged: k only decides how many drafted tokens a step verifies, so outputs stay exactly those of the
target (greedy tests run through it).

vLLM calls its scheduler interface internal: the subclass touches three members (`dynamic_sd_lookup`,
`make_spec_decoding_stats`, `set_pause_state`) and the pinned range is tested in CI; on any mismatch it logs and
leaves vLLM's table in place rather than failing the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from service.vllm.online import OnlineDepth, rows_of

logger = logging.getLogger(__name__)


class _OnlineDepthMixin:
    """Mixed in before vLLM's Scheduler (or AsyncScheduler)."""

    vllm_config: Any
    dynamic_sd_lookup: list[int] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._online: OnlineDepth | None = None
        settings = (getattr(self.vllm_config, "additional_config", None) or {}).get("specroll_online")
        if settings is None or self.dynamic_sd_lookup is None:
            logger.warning("specroll's online speculation depth is off: no settings or no speculation table")
            return
        try:
            online = OnlineDepth.from_json(settings)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("specroll's online speculation depth is off: bad settings (%s)", exc)
            return
        if len(online.lookup) != len(self.dynamic_sd_lookup):
            logger.warning("specroll's online speculation depth is off: %d batch sizes, vLLM has %d",
                           len(online.lookup) - 1, len(self.dynamic_sd_lookup) - 1)
            return
        self._online = online
        self._last_rows = rows_of(online.lookup)
        logger.info("online speculation depth on; first table %s", self._last_rows)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._online is not None:
            self.dynamic_sd_lookup = self._online.step()
            rows = rows_of(self._online.lookup)
            if rows != self._last_rows:
                self._last_rows = rows
                logger.info("speculation table now %s (acceptance per position %s)", rows,
                            [round(a, 3) for a in self._online.acceptance()])
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def set_pause_state(self, pause_state: Any) -> None:
        was = getattr(self, "pause_state", PauseState.UNPAUSED)
        super().set_pause_state(pause_state)  # type: ignore[misc]
        online = getattr(self, "_online", None)  # None while vLLM's __init__ runs
        if online is not None and was != PauseState.UNPAUSED and pause_state == PauseState.UNPAUSED:
            online.renew()
            logger.info("resumed (weights may have changed): speculation table back to the profile's %s",
                        rows_of(online.lookup))

    def make_spec_decoding_stats(self, spec_decoding_stats: Any, num_draft_tokens: int, num_accepted_tokens: int,
                                 *args: Any, **kwargs: Any) -> Any:
        if self._online is not None:
            self._online.observe(num_draft_tokens, num_accepted_tokens)
        return super().make_spec_decoding_stats(  # type: ignore[misc]
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args, **kwargs)


class OnlineScheduler(_OnlineDepthMixin, Scheduler):
    pass


class OnlineAsyncScheduler(_OnlineDepthMixin, AsyncScheduler):
    pass
