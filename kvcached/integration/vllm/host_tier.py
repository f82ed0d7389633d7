"""Give-back that prefers blocks the host tier already holds (vLLM ``--kv-offloading-size``).

When kvcached gives pages back (a lowered limit, a peer's want, an idle engine, the
cache bound) it evicts cached prefix blocks from vLLM's GPU cache, whole pages first.
With vLLM's offloading connector attached, this view tells, per cached GPU block,
whether the host tier has it, so the pages whose blocks it holds go first and those
whose prefix would be lost go last.

What a block is for the tier (vLLM 0.26-0.32, read from their sources): the
connector's scheduler keys a chunk of ``blocks_per_chunk`` GPU blocks by the block
hash of its last block plus its KV group (``make_offload_key``), the same bytes as the
GPU pool's ``BlockHashWithGroupId``. With one block a chunk (vLLM's default,
``blocks_per_chunk=1``, and hashes of one block) a cached block's own hash *is* its
key; otherwise a block inside a chunk has no key of its own (the chain's hashes run
forward, not back) and is ``UNKNOWN`` here.

The question is asked without side effects: ``CPUOffloadingManager.lookup`` counts
lookups when ``store_threshold >= 2`` (that count decides admission) and other
managers may start async lookups, so the view reads the manager's cache policy
(``_policy.get``: a dict look-up in its LRU and ARC policies) and answers
``UNKNOWN`` for a manager without one.

States: ``HELD`` (stored and readable), ``PENDING`` (a store is copying it: kvcached's
transfer holds keep its page mapped until the store ends, ``transfers.py``, so the tier
gets it whatever the GPU cache does), ``ABSENT`` (the tier does not have it: it was
full or refused the store, a partial chunk, or it evicted the block since), ``UNKNOWN``.
kvcached never asks for a store itself: the connector has no API for storing blocks
outside a request's own jobs (see README, "KV offloading to host memory").
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List, Optional

HELD, PENDING, ABSENT, UNKNOWN = "held", "pending", "absent", "unknown"
# States whose data the host tier has or will have: evicting them loses nothing.
KEPT = (HELD, PENDING)


class HostTierView:
    """Side-effect-free look-ups of GPU blocks in one connector's offloading manager."""

    def __init__(self, policy: Any, keyed: bool) -> None:
        self._policy = policy  # the manager's cache policy (``get(key) -> BlockStatus | None``)
        self.keyed = keyed  # one GPU block a chunk: a block's hash is its offload key
        self.dropped: Counter = Counter()  # evicted blocks per state (give-back only)

    @classmethod
    def of_connector(cls, connector: Any) -> Optional[HostTierView]:
        """The view of an ``OffloadingConnector``'s scheduler side, or None where it has
        no manager with a readable cache policy (then give-back order is unchanged)."""
        sched = getattr(connector, "connector_scheduler", None)
        manager = getattr(sched, "manager", None)
        policy = getattr(manager, "_policy", None)
        if policy is None or not callable(getattr(policy, "get", None)):
            return None
        config = getattr(sched, "config", None)
        groups = getattr(config, "kv_group_configs", None) or ()
        keyed = getattr(config, "blocks_per_chunk", None) == 1 and all(
            getattr(g, "hashes_per_chunk", 1) == 1 for g in groups
        )
        return cls(policy, keyed)

    def state(self, block: Any) -> str:
        """The tier's state of a cached GPU block (``KVCacheBlock``)."""
        key = getattr(block, "block_hash", None)
        if key is None or not self.keyed:
            return UNKNOWN
        try:
            entry = self._policy.get(key)  # OffloadKey == BlockHashWithGroupId bytes
        except Exception:  # noqa: BLE001 - a policy that cannot answer: not known
            return UNKNOWN
        if entry is None:
            return ABSENT
        return HELD if getattr(entry, "is_ready", True) else PENDING

    def kept(self, blocks: Iterable[Any]) -> bool:
        """Whether the tier has (or is storing) every one of ``blocks``."""
        return all(self.state(b) in KEPT for b in blocks)

    def order_pages(self, by_page: Dict[int, List[Any]]) -> List[int]:
        """The pages of ``by_page`` (page -> its cached blocks, oldest page first): those
        whose blocks the tier keeps first, the rest after, each group in the given order."""
        kept = [pid for pid, blocks in by_page.items() if self.kept(blocks)]
        first = set(kept)
        return kept + [pid for pid in by_page if pid not in first]

    def note_dropped(self, blocks: Iterable[Any]) -> Dict[str, int]:
        """Counts evicted ``blocks`` by state; returns this call's counts."""
        now = Counter(self.state(b) for b in blocks)
        self.dropped.update(now)
        return dict(now)
