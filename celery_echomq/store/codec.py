"""A job's stored message, as its row keeps it, and the one way to read it back.

A row keeps its job either whole (the ``payload`` field: a parent, a nested flow's entry, a
child written by add_children or grow, and every row an earlier version wrote), or, for a
child written in one enqueue_flow step with its siblings, as what differs (the ``delta``
field) from the template on its parent's row (``template``; see :func:`child_template`).
Every reader of a stored job (recovery's re-publish, retry, show) goes through
:func:`load_job`, which accepts both forms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from kombu.exceptions import EncodeError
from kombu.serialization import registry
from kombu.utils import json as kombu_json

from celery_echomq.store.connection import text


class Delta(NamedTuple):
    """A child's stored job as what differs from its flow's template."""

    data: bytes  # the encoded delta
    parent: str  # the parent whose row (on the child's own slot) holds the template


# A child's place in its group (a chord's header task: Celery gives each its own), kept in
# its delta beside the options rather than in them: options that differ are stored whole, and
# a whole options map would take every header task's row out of Redis's compact encoding.
PLACE = "group_index"


def join_job(template: dict[str, Any], delta: dict[str, Any], job_id: str) -> dict[str, Any]:
    """The job dict a child was stored as: ``template`` with ``delta`` over it, and its own
    id and place in its group (the template's task_id and group_index are None placeholders
    that keep the options' order)."""
    job = {**template, **delta}
    options = {**job["options"], "task_id": job_id}
    if PLACE in delta:
        options[PLACE] = job.pop(PLACE)
    job["options"] = options
    return job


class Step(NamedTuple):
    """A chain's step made pending by the completion of the step before it: its payload, and
    that step's value (its row's ``input``), which goes first among its arguments."""

    payload: bytes
    input: bytes


# What a row keeps of its job: the encoded job dict, a delta, or a step with its input.
Stored = bytes | Delta | Step

# The row fields :func:`stored_of` takes, in order.
STORED_FIELDS = ("payload", "delta", "parent", "input")


def with_input(job: Any, value: Any) -> Any:
    """A chain's step as it runs: the value of the step before it first among its arguments
    (none for an immutable step, as in a Celery chain)."""
    if isinstance(job, dict) and not job.get("immutable"):
        job["args"] = [value, *(job.get("args") or ())]
    return job


class TemplateMissingError(LookupError):
    """A child's delta whose flow's template is gone (its parent's row expired or deleted)."""


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def stored_of(
    payload: Any, delta: Any = None, parent: Any = None, step_input: Any = None
) -> Stored | None:
    """The stored job from a row's ``payload``, ``delta``, ``parent`` and ``input`` fields (as
    Redis replies them; a script's missing field may come as False or ''); None when it keeps
    none."""
    if payload and step_input:
        return Step(_bytes(payload), _bytes(step_input))
    if payload:
        return _bytes(payload)
    if delta and parent:
        data = delta if isinstance(delta, bytes) else str(delta).encode()
        return Delta(data, text(parent))
    return None


def read_stored(state: Any, queue: str, job_id: str) -> Stored | None:
    """The stored job of ``job_id``'s row on ``queue``, or None."""
    return stored_of(*state.client.hmget(state.keys.job_key(queue, job_id), STORED_FIELDS))


def read_template(state: Any, queue: str, parent_id: str) -> bytes | None:
    """The encoded template on a parent's row, or None."""
    raw = state.client.hget(state.keys.job_key(queue, parent_id), "template")
    return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()


def load_job(
    state: Any,
    queue: str,
    job_id: str,
    stored: Stored,
    templates: dict[str, bytes | None] | None = None,
) -> Any:
    """The job dict ``stored`` keeps (whatever the app's serializer decodes it to).

    A delta is joined with its flow's template, read from the parent's row on ``queue`` (the
    child's own) unless ``templates`` (parent id -> encoded template, filled in as read)
    already holds it. Raises what :meth:`EchoMQ.loads` raises for content the app does not
    accept, :class:`TemplateMissingError` when the template is gone, and ``ValueError`` for a
    template or delta that is not a dict.
    """
    if isinstance(stored, Step):
        return with_input(state.loads(stored.payload), state.loads(stored.input))
    if not isinstance(stored, Delta):
        return state.loads(stored)
    if templates is not None and stored.parent in templates:
        raw = templates[stored.parent]
    else:
        raw = read_template(state, queue, stored.parent)
        if templates is not None:
            templates[stored.parent] = raw
    if raw is None:
        raise TemplateMissingError(f"the template of flow {stored.parent} on {queue} is gone")
    # Decoded afresh for each child: no two jobs share a mutable value.
    template, delta = state.loads(raw), state.loads(stored.data)
    if not isinstance(template, dict) or not isinstance(delta, dict):
        raise ValueError(f"the stored job of {job_id} on {queue} is not a job")
    return join_job(template, delta, job_id)


# What kombu's JSON encoder makes for each call (json.dumps(obj, cls=JSONEncoder)): one
# encoder of the same options, made once (it keeps no state between calls).
_KOMBU_JSON_DUMPS = kombu_json.dumps
_KOMBU_JSON = kombu_json.JSONEncoder()


def serialize(obj: Any, serializer: str) -> tuple[str, str, Any]:
    """``kombu.serialization.dumps(obj, serializer=serializer)``, without its per-call
    checks and context manager (a flow encodes each child's job and message body: two calls
    a child): the same content type, encoding and data from the same registered encoder
    (kombu's own JSON one called as it calls it), and the same EncodeError where it fails.
    Any other case takes kombu's own path."""
    codec = registry._encoders.get(serializer) if serializer != "raw" else None
    if codec is None:
        return registry.dumps(obj, serializer=serializer)  # type: ignore[no-any-return,no-untyped-call]
    try:
        if codec.encoder is _KOMBU_JSON_DUMPS:
            return codec.content_type, codec.content_encoding, _KOMBU_JSON.encode(obj)
        return codec.content_type, codec.content_encoding, codec.encoder(obj)
    except Exception as exc:
        raise EncodeError(exc) from exc


# A child's stored job, compact: the children a flow writes in one enqueue_flow step share
# one template (the job dict of the first of them, without its task_id), kept on their
# parent's row; each child's row keeps only what differs from it (its ``delta``), so that
# the row stays small enough for Redis's compact hash encoding. Its task_id is the row's own
# id (the template keeps the task_id key, as None, so a joined job's options keep their
# order; so does group_index, see :data:`PLACE`). A nested flow's entry, and children
# written by other steps, keep their full payload.
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


def _same(a: Any, b: Any) -> bool:
    """Equal, and encoded alike by any serializer: same types (1, 1.0 and True are not the
    same argument), same key order; a value of another type never counts as the same."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _SCALARS:
        return bool(a == b)
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    if kind is dict:
        return list(a) == list(b) and all(_same(v, b[k]) for k, v in a.items())
    return False


def child_template(jobs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The template a level's children are stored against: the first child job's dict
    without its task_id and group_index; None when the level has no child job (only nested
    flows)."""
    first = next(iter(jobs), None)
    if first is None:
        return None
    options = {**first["options"], "task_id": None}
    if options.get(PLACE) is not None:
        options[PLACE] = None
    return {**first, "options": options}


def job_delta(template: dict[str, Any], job: dict[str, Any]) -> dict[str, Any] | None:
    """What ``job`` (a task's message) differs from ``template`` in (its task_id aside): the
    fields to store in its row. None when it is not told that way: store it whole (a job of
    other fields, or one with a field of :data:`PLACE`'s name, which a delta keeps for its
    options' place)."""
    if list(job) != list(template) or PLACE in job:
        return None
    delta: dict[str, Any] = {}
    for key, value in job.items():
        if key == "options":
            # The template's task_id and group_index are placeholders: every other option
            # compared. Options that differ are stored whole, their place with them.
            mine = template["options"]
            if list(value) != list(mine) or not all(
                k == "task_id" or (k == PLACE and mine[k] is None) or _same(v, mine[k])
                for k, v in value.items()
            ):
                delta[key] = {**value, "task_id": None}
            elif value.get(PLACE) is not None:
                delta[PLACE] = value[PLACE]
        elif not _same(value, template[key]):
            delta[key] = value
    return delta
