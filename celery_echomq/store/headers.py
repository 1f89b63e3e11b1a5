"""The message headers that mark a flow job, and reading them back.

The producer writes them on every job it plans (``send/plan.py``); a worker reads them from a
Request, recovery from a stored job. Celery keeps custom headers across retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_echomq.store.script_values import ParentRef

# Message headers that mark a flow job; Celery keeps custom headers across retries.
H_QUEUE = "echomq_q"  # the queue whose slot holds this job's row
H_PARENT = "echomq_p"  # the parent's job id, on a child
H_PARENT_QUEUE = "echomq_pq"  # the queue whose slot holds the parent's keys
# On a chain's step but its last: the step that follows it, which its completion makes pending
# (the row's own ``next`` must name the same one).
H_NEXT = "echomq_n"
H_FLOW = "echomq_f"  # "1" on a flow parent: it has keys of its own to expire
# On a child's first message only (not in its stored payload): the store's clock in ms, read
# just before the flow was enqueued. The claim takes it for the job's pending time.
H_SINCE = "echomq_t"
# On a child's first message only, too: the producer's store, its URL with any password
# masked, so that a worker reading another store can name both.
H_STORE = "echomq_s"
# "1" on the message of a chain's step that the completion of the step before handed out
# active (complete.lua, its option 'lease'), and on no stored payload: its first delivery takes
# the step in one script that writes its token (take_handed.lua) rather than the claim script.
H_HANDED = "echomq_h"
# "1": the store writes this job's result into Celery's result backend when the job completes
# (the worker that holds the job keeps Celery's trace from writing it; the message itself does
# not say ignore_result, so a worker without the extension stores it; see wire/results.py).
H_RESULT = "echomq_r"
# On the parent of a flow that stands for a chord (``echomq_chords``, see chords.py): the
# chord's body as Celery would send it (its failure is then Celery's, from the body), or "1"
# for a chain body (the failure only worded as Celery words a chord's).
H_CHORD = "echomq_c"
# The apply_async option by which chords.py hands a flow that value.
CHORD_OPTION = "echomq_chord"
# "1" on the parent of a chord's flow whose header is a generator, read as it yields: the
# flow stays open (send/chunked.py) while chords.py adds each task, and is sealed after the
# last. A producer that stops before the seal leaves an incomplete header: recovery fails it.
H_OPEN = "echomq_o"
OPEN_OPTION = "echomq_open"
CHORD_OPTIONS = (CHORD_OPTION, OPEN_OPTION)
# "K/N" on every child of a flow released by a quorum (``flow(..., quorum=K)``): the K-th of
# its N children to succeed releases the parent (store/lua/includes/quorum.lua).
H_QUORUM = "echomq_k"
# The reducer (JSON) on every child of a flow whose values are folded as they arrive
# (``flow(..., reduce=R)``, send/fan_in.py, store/lua/includes/reduce.lua).
H_REDUCE = "echomq_x"
# On a batch message (``flow(..., batch=N)``, send/batches.py), never on a job's: the queue whose
# rows its children are. The message's one argument lists their ids.
H_BATCH = "echomq_b"
# On a batch message too: the parent whose row keeps the template its children's rows are
# stored against, read in the round trip of their rows. Only a hint: each row's own 'parent'
# names the template that joins it, and a hint naming another is a read that goes unused.
H_TEMPLATE = "echomq_bt"
# On the request a batch message's runner builds for each child (never on a message, nor in a
# stored payload): the batch message's id, which the child's claim records on its row
# ('batch'), for show and the dashboard to say which message carried it.
H_VIA = "echomq_v"


# The prefix of every header above: reserved for the plan's own.
RESERVED = "echomq_"


def chord_headers(options: dict[str, Any]) -> dict[str, Any]:
    """What a chord on the engine marks its flow's parent with (chords.py sends it as options
    of the flow's apply_async, which pops them here)."""
    marks: dict[str, Any] = {}
    if (body := options.pop(CHORD_OPTION, None)) is not None:
        marks[H_CHORD] = body
    if options.pop(OPEN_OPTION, None):
        marks[H_OPEN] = "1"
    return marks


def is_open_header(job: Mapping[str, Any]) -> bool:
    """Whether the stored parent ``job`` heads a chord whose header was read as it yielded."""
    return bool(((job.get("options") or {}).get("headers") or {}).get(H_OPEN))


class Headers:
    """Attribute access to a job's message headers, as Celery's worker Request gives them:
    what :func:`parent_ref` reads from a stored job's headers or a revoked request's."""

    def __init__(self, headers: dict[str, Any]) -> None:
        self.__dict__.update(headers)

    @classmethod
    def of_job(cls, job: dict[str, Any]) -> Headers:
        """The headers of a stored job dict (its ``options``)."""
        return cls((job.get("options") or {}).get("headers") or {})


def parent_ref(headers: Any) -> ParentRef | None:
    """Where a flow job's parent lives, from its headers (a Request or :class:`Headers`);
    None for a job that is not a flow's child."""
    parent_id = getattr(headers, H_PARENT, None)
    if not parent_id:
        return None
    return ParentRef(
        str(parent_id),
        str(getattr(headers, H_PARENT_QUEUE, None) or getattr(headers, H_QUEUE)),
        str(getattr(headers, H_QUORUM, None) or ""),
        str(getattr(headers, H_REDUCE, None) or ""),
    )


def outer_ref(headers: dict[str, Any], queue: str) -> ParentRef | None:
    """Where the flow a nested flow's parent belongs to lives, from that parent's stored
    headers (``queue``: its own, where the outer flow's keys are unless the headers name
    another); None for a flow nested in none."""
    outer = headers.get(H_PARENT)
    if not outer:
        return None
    return ParentRef(
        str(outer),
        str(headers.get(H_PARENT_QUEUE) or queue),
        str(headers.get(H_QUORUM) or ""),
        str(headers.get(H_REDUCE) or ""),
    )
