"""StallBackoff: an engine loop that admits nothing is paced, not spun.

Both engines step again at once while they hold requests (vLLM's busy loop,
SGLang's event loop with its idle turn). Natively a request that can never fit
is refused on arrival; under a kvcached limit, or while peers hold the device
budget, waiting requests can stay unadmitted with nothing running, and the loop
would turn millions of times a minute. A turn that admits nothing sleeps a
little longer each time (``first_s`` doubling to ``max_s``: a peer's give-back
or a raised limit is still seen within ``max_s``); a turn that runs anything
resets it. One line when a stall passes ``warn_after_s``, saying what holds it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from kvcached.units import format_size

logger = logging.getLogger(__name__)


class StallBackoff:
    """Paces the turns of one engine loop; ``pool``: the ``ElasticPool`` its line names."""

    def __init__(
        self,
        pool: Any,
        first_s: float = 0.0005,
        max_s: float = 0.005,
        warn_after_s: float = 30.0,
        sleep: Optional[Callable[[float], None]] = None,
    ) -> None:
        self.pool, self.first_s, self.max_s, self.warn_after_s = pool, first_s, max_s, warn_after_s
        self._sleep = sleep or time.sleep
        self.delay_s = 0.0
        self.since: Optional[float] = None
        self.warned = False

    def progress(self) -> None:
        """The loop ran something: the next stall starts from ``first_s``."""
        self.delay_s, self.since, self.warned = 0.0, None, False

    def stalled(self, waiting: int) -> None:
        """A turn with ``waiting`` requests, none admitted and nothing running: sleeps."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif not self.warned and now - self.since >= self.warn_after_s:
            self.warned = True
            limit = self.pool.limit_bytes()
            logger.warning(
                "kvcached: %s: %d requests waiting, none admitted for %.0f s (limit %s, page %s): raise the "
                "limit (kvctl limit %s SIZE) or free memory on the device",
                self.pool.name, waiting, now - self.since, "none" if limit is None else format_size(limit),
                format_size(self.pool.bytes_per_page), self.pool.name,
            )  # fmt: skip
        self.delay_s = min(self.max_s, self.delay_s * 2 if self.delay_s else self.first_s)
        self._sleep(self.delay_s)
