"""Reads ``lua/<name>.lua`` (one file per transition) and expands its includes."""

from __future__ import annotations

import re
from importlib import resources

from celery_echomq.store.store_format import FORMAT_SLOT, STORE_FORMAT

TRANSITIONS = (
    "enqueue_flow",
    "claim",
    "complete",
    "fail",
    "retry",
    "dispatch",
    "cancel",
    "cancel_elsewhere",
    # a job shared by several flows (on_exists="join"), once none of them waits for it
    "cancel_shared",
    # an operator's repairs: retry a failed flow (its parent's slot, then its children's),
    # release a held parent now
    "retry_flow",
    "retry_children",
    "retry_counted",
    "retry_parent",
    "release",
    # the chunked / cross-slot path: open, add per queue and chunk, seal; credit on the parent
    "open_flow",
    "add_children",
    "seal_flow",
    "credit",
    # children cut on another slot (cancelled, or by a deadline or a quorum) counted on the
    # parent's
    "credit_cut",
    # a job that exists joined to one more parent (on_exists="join")
    "join_edge",
    # children added to a held flow: on the parent's slot, then (other slots) add_children,
    # then grow_done
    "grow_flow",
    "grow_done",
    # recovery's: take back a lost job, make a handed step no delivery took pending again,
    # renew a live worker's leases, end a dead holder's lease, watch a job replaced by another
    # task, give up the recovery lease
    "requeue",
    "unhand",
    # a delivery takes a step handed out active by the completion of the step before
    "take_handed",
    "extend",
    "drop",
    # delete jobs and their flows' keys (echomq forget, the undo of a refused start)
    "forget",
    "hand_over",
    "lease_release",
    "abandon_flow",
    # deadlines (store/deadlines.py): arm before the enqueue, fire once, cut children of other
    # slots, end the follow-up, retry a flow failed by its deadline with a new one
    "deadline_arm",
    "deadline",
    "deadline_cut",
    "deadline_done",
    "retry_deadline",
)


INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.MULTILINE)


def _read_lua(*parts: str) -> str:
    return (
        resources.files(__package__ or "celery_echomq").joinpath("lua", *parts).read_text("utf-8")
    )


def load_source(name: str) -> str:
    """The source of ``lua/<name>.lua`` with its includes expanded.

    A line ``--- @include "piece"`` is replaced by ``lua/includes/<piece>.lua`` (itself expanded
    the same way), at most once per script: a piece included twice, directly or through
    another piece, is written only where it first appears, so each Lua local is defined once.
    """
    seen: set[str] = set()

    def expand(source: str) -> str:
        def piece(match: re.Match[str]) -> str:
            included = match.group(1)
            if included in seen:
                return f"-- ({included} is included above)"
            seen.add(included)
            return expand(_read_lua("includes", f"{included}.lua")).rstrip("\n")

        return INCLUDE.sub(piece, source)

    # The one format constant is Python's: the format include names it by a slot.
    return expand(_read_lua(f"{name}.lua")).replace(FORMAT_SLOT, str(STORE_FORMAT))
