"""A child's stored job as a delta against its flow's template: joined back, it is the job."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, register, unregister

from celery_echomq.store.codec import child_template, job_delta, join_job, serialize


def job(task_id: str, *args: Any, task: str = "t.add", **options: Any) -> dict[str, Any]:
    opts = {"queue": "q", "headers": {"echomq_q": "q", "echomq_p": "JOBp"}, **options}
    opts["task_id"] = task_id
    opts.setdefault("ignore_result", True)  # after task_id, as plan_children sets it
    return {
        "task": task,
        "args": list(args),
        "kwargs": {},
        "options": opts,
        "subtask_type": None,
        "immutable": False,
    }


def test_only_what_differs_is_stored_and_the_join_gives_the_job_back() -> None:
    first = job("JOB1", 1, 2)
    template = child_template([{"nested": {}}, first])
    assert template is not None and template["options"]["task_id"] is None
    assert job_delta(template, first) == {}
    assert job_delta(template, job("JOB2", 3, 4)) == {"args": [3, 4]}
    for other in (
        job("JOB2", 3, 4),
        job("JOB3", 1, 2, task="t.mul"),
        job("JOB4", 1, 2, soft_time_limit=5),
        job("JOB5"),
    ):
        delta = job_delta(template, other)
        assert delta is not None
        joined = join_job(template, delta, other["options"]["task_id"])
        assert joined == other
        # Same order too: the message built from it is the one first sent.
        assert list(joined["options"]) == list(other["options"])


@pytest.mark.parametrize("arg", [1.0, True, "1", None, [1], (1, 2)])
def test_an_argument_of_another_type_is_not_the_same_argument(arg: Any) -> None:
    template = child_template([job("JOB1", 1)])
    assert template is not None
    assert job_delta(template, job("JOB2", arg)) == {"args": [arg]}


def test_keyword_arguments_in_another_order_are_stored() -> None:
    first, other = job("JOB1"), job("JOB2")
    first["kwargs"], other["kwargs"] = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    template = child_template([first])
    assert template is not None
    assert job_delta(template, other) == {"kwargs": {"y": 2, "x": 1}}


def test_a_nested_flows_entry_is_stored_whole() -> None:
    assert child_template([{"nested": {"parent_id": "JOBn"}}]) is None
    template = child_template([job("JOB1")])
    assert template is not None
    assert job_delta(template, {"nested": {"parent_id": "JOBn"}}) is None


@pytest.mark.parametrize("serializer", ["json", "pickle", "yaml-like", "raw"])
def test_a_message_is_encoded_as_kombu_encodes_it(serializer: str) -> None:
    """The producer's own path to the registered encoder gives kombu's bytes, and kombu's
    EncodeError, for its JSON encoder, another built-in one and one an app registers."""
    register("yaml-like", repr, lambda s: s, content_type="text/x-like")
    try:
        value: Any = b"raw bytes" if serializer == "raw" else {"args": [1, 2.5, "é", None]}
        assert serialize(value, serializer) == dumps(value, serializer=serializer)
        if serializer in ("json", "pickle"):
            with pytest.raises(EncodeError):
                serialize(lambda: None, serializer)
    finally:
        unregister("yaml-like")
