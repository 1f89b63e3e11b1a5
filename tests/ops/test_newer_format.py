"""The operator's commands on a flow a newer release wrote (its rows of a newer store format):
each one refuses with one line that names the format found and the one this release knows,
and writes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import redis

from celery_echomq import flow
from celery_echomq.store.store_format import STORE_FORMAT
from tests.helpers import KEYS, echomq, snapshot


def test_cancel_release_and_forget_refuse_a_flow_of_a_newer_format(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("newer-ops")
    children = [proj.add.s(i, i).set(task_id=f"JOB{uuid.uuid4().hex}") for i in range(2)]
    # No worker consumes the queue: the flow stays held, its children pending.
    res = flow(proj.tsum.s(), children).apply_async(queue=queue)
    ids = [res.id, *(c.id for c in children)]
    for job in ids:
        store.hset(KEYS.job_key(queue, job), "format", str(STORE_FORMAT + 1))
    before = snapshot(store, *ids)
    for command in (
        ["cancel", res.id],
        ["release", res.id],
        ["release", res.id, "--revoke"],
        ["forget", res.id, "--force"],
    ):
        out = echomq(*command)
        assert out.exit_code == 1, (command, out.output)
        said = out.stderr.strip().splitlines()
        assert len(said) == 1, (command, out.stderr)
        assert (
            f"is in store format {STORE_FORMAT + 1}, newer than format {STORE_FORMAT}" in (said[0])
        ), (command, said)
        assert snapshot(store, *ids) == before, command
