"""The engine-neutral elastic runtime: what every engine adapter shares.

An engine adapter (``kvcached.integration.vllm``, ``kvcached.integration.sglang``)
translates its engine's objects and seams; the policy lives here, once:

==================  ===========================================================
``fence``           ``ReleaseFence``: an emptied page is released only when no
                    submitted step can still read it (``cuMemUnmap`` does not
                    wait for running kernels), optionally after a grace period.
``pool``            ``ElasticPool``: one KV group's manager and instance limits:
                    pages over the limit, live pages, give memory back.
``instance``        ``ElasticInstance``: the pools of one engine instance, its
                    fence, the "want" signal to peers sharing the device budget
                    and the decision to give memory back while idle (in
                    chunks, ``give_chunks``: what peers lack first).
``cache_bound``     the ``KVCACHED_MAX_CACHED_TOKENS`` bound on the prefix cache.
``stall``           ``StallBackoff``: an engine loop that admits nothing sleeps a
                    little longer each turn instead of spinning.
``cleanup``         removing what crashed instances left behind.
==================  ===========================================================

Nothing here imports an engine or torch.
"""

from kvcached.elastic.cache_bound import cache_excess_tokens
from kvcached.elastic.fence import ReleaseFence
from kvcached.elastic.instance import GIVE_CHUNK_PAGES, ElasticInstance, IdleAction, give_chunks
from kvcached.elastic.pool import ElasticPool
from kvcached.elastic.stall import StallBackoff

__all__ = [
    "GIVE_CHUNK_PAGES",
    "ElasticInstance",
    "ElasticPool",
    "IdleAction",
    "ReleaseFence",
    "StallBackoff",
    "cache_excess_tokens",
    "give_chunks",
]
