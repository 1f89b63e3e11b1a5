"""The fan-in's rules, stated once: what a finished child does to its flow (pure).

``lua/includes/settle_child.lua`` (and ``lua/includes/quorum.lua`` under a quorum) applies
them in the store, atomically, and stays their source of truth there; an eager run
(``result.py``'s ``FanIn``) applies them in memory by reading this table, since eager mode
runs with no Redis server. ``tests/store/test_fan_in_rules.py`` drives the real scripts
through every row, beside the eager fan-in, and checks that both give the same counts, the
same release and the same failure: the table is what keeps the two in step.

A row is keyed by the flow's kind of fan-in (``count``: released once no child is
outstanding; ``quorum``: released by its K-th success) and the child's outcome (``done``, or
the failed child's policy: its ``parent_policy``, else its flow's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where the flow keeps a child's outcome: its value (``children_values()``), its error under
# ``ignore`` (``ignored_failures()``), or its error under any other policy (the row's
# ``failed:<id>`` fields, ``failed_children()``).
Kept = Literal["values", "ignored", "failures"]

# What the outcome decides while the parent waits:
#   at_last    released once no child is outstanding, unless a child failed under
#              fail_at_end: then the parent fails with the first of those
#   late       as at_last, and the first child failed so is the one the parent fails with
#   at_once    released at once (or failed, as at_last, for a failure under fail_at_end)
#   fail       the parent fails at once with this child's error
#   at_quorum  released by the K-th success (the values in the order they succeeded)
#   short      one child fewer can succeed: the parent fails once fewer than K can
Decides = Literal["at_last", "late", "at_once", "fail", "at_quorum", "short"]


@dataclass(frozen=True)
class Rule:
    """What one outcome does to its flow."""

    kept: Kept
    # Counted toward the parent (its ``:dependencies`` counted down): a child failed under
    # ``fail`` without a quorum never is, and stays outstanding in the counter.
    counted: bool
    decides: Decides
    # A success once its parent was released (not failed) is not taken as a value: the flow
    # ended without it, counted as cut.
    cut_once_released: bool = False


COUNT, QUORUM = "count", "quorum"

RULES: dict[tuple[str, str], Rule] = {
    (COUNT, "done"): Rule("values", True, "at_last"),
    (COUNT, "fail"): Rule("failures", False, "fail"),
    (COUNT, "ignore"): Rule("ignored", True, "at_last"),
    (COUNT, "remove"): Rule("failures", True, "at_last"),
    (COUNT, "continue"): Rule("failures", True, "at_once"),
    (COUNT, "fail_at_end"): Rule("failures", True, "late"),
    # Under a quorum every failure but continue's is one child fewer that can succeed.
    (QUORUM, "done"): Rule("values", True, "at_quorum", cut_once_released=True),
    (QUORUM, "fail"): Rule("failures", True, "short"),
    (QUORUM, "ignore"): Rule("ignored", True, "short"),
    (QUORUM, "remove"): Rule("failures", True, "short"),
    (QUORUM, "continue"): Rule("failures", True, "at_once"),
    (QUORUM, "fail_at_end"): Rule("failures", True, "short"),
}


def rule_of(quorum: int, outcome: str) -> Rule:
    """The rule for ``outcome`` (``done`` or a failed child's policy) in a flow with
    ``quorum`` (0: none)."""
    return RULES[(QUORUM if quorum else COUNT, outcome)]
