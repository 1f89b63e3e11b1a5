"""Failure policies: what one bad child means for its parent.

    python examples/policies.py

A photo gallery is published once its thumbnails are made; one upload is corrupt. The same
flow runs four times, the corrupt child marked each time with another policy:

    flow(publish_gallery.s(),
         [thumbnail.s(name), ..., thumbnail.s("corrupt.png").set(parent_policy=P)])

- ``fail``     (the default) the parent fails and never runs; ``get()`` raises ``FlowFailed``
- ``ignore``   the child counts as resolved, its error is kept: ``res.ignored_failures()``
- ``remove``   the child counts as resolved, and nothing is kept
- ``continue`` the parent is released at once, with the values of the children done so far

A flow's ``policy=`` sets the default for children that set none.
"""

from __future__ import annotations

import sys
import time

from _local import configure_from_env, local_worker
from celery import Celery

from celery_echomq import FlowFailed, flow

app = Celery("policies")
configure_from_env(app)

PHOTOS = ["beach.jpg", "corrupt.png", "harbour.jpg", "market.jpg"]


@app.task
def thumbnail(name: str) -> str:
    """A child: make one thumbnail. A corrupt file fails at once; the others take a while."""
    if name.startswith("corrupt"):
        raise ValueError(f"cannot identify image file {name!r}")
    time.sleep(1.0)  # long enough that "continue" visibly does not wait for it
    return f"thumbs/{name}"


@app.task
def publish_gallery(thumbs: list[str]) -> str:
    """The parent: runs at most once, with the thumbnails its policy let through."""
    return f"published {len(thumbs)} thumbnail(s): {', '.join(thumbs) or '-'}"


def run(policy: str) -> None:
    children = [
        thumbnail.s(name).set(parent_policy=policy) if name.startswith("corrupt")
        else thumbnail.s(name)
        for name in PHOTOS
    ]  # fmt: skip
    res = flow(publish_gallery.s(), children).apply_async()
    try:
        print(f"{policy:>8}: {res.get(timeout=120)}")
    except FlowFailed as exc:
        print(f"{policy:>8}: parent failed and did not run: {exc.error} (child {exc.child_id})")
        return
    ignored = res.ignored_failures()
    print(f"{'':>8}  ignored failures: {list(ignored.values()) or 'none'}")
    if policy == "continue":
        # The parent ran without waiting; the slow children still finish and are recorded.
        while res.dependencies().outstanding:
            time.sleep(0.1)
        deps = res.dependencies()
        settled = deps.done + deps.failed + deps.ignored
        print(f"{'':>8}  children settled after the parent ran: {settled}")


def main() -> int:
    # Four worker processes: the corrupt child fails while its siblings are still running.
    with local_worker("policies", app, concurrency=4):
        for policy in ("fail", "ignore", "remove", "continue"):
            run(policy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
