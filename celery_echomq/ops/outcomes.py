"""What an operator's retry or release did: the replies of ``retry_flow`` and ``release_flow``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryOutcome:
    """What a retry did."""

    flow_id: str
    republished: tuple[str, ...]  # children published again, as new attempts
    held: tuple[str, ...]  # parents put back to awaiting_children (nested and outer flows too)
    released: tuple[str, ...] = ()  # parents that had nothing left to wait for: dispatched
    state: str = "awaiting_children"  # the flow's parent state after the retry


@dataclass(frozen=True)
class ReleaseOutcome:
    """What a release did."""

    flow_id: str
    values: int  # children whose values the parent was released with
    # Children still unsettled when it was released, by id where --revoke read every child
    # (a chunk at a time); a release without it reads none (see ``left``).
    outstanding: tuple[str, ...]
    revoked: tuple[str, ...] = field(default=())  # of those, the ones revoked (--revoke)
    state: str = "pending"  # the parent's state after the release
    left: int = 0  # how many children were unsettled when it was released (its counter)
    # Of ``outstanding``, the ones already running, which a revoke does not stop (they finish
    # and are recorded), unless ``terminate`` signalled their processes (``terminated``).
    running: tuple[str, ...] = field(default=())
    terminated: tuple[str, ...] = field(default=())
