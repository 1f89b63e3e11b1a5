"""A tree of flows: a sales report whose children are regions, each a flow over its stores.

    python examples/tree.py [--timeout SECONDS]

    flow(report.s(), [
        flow(region_total.s("north"), [store_sales.s("north", store) for store in ...]),
        flow(region_total.s("south"), [...]),
        ...
    ])

Each region's parent is held until its stores are counted; the report is held until every
region's parent has run. The script prints the report and then the whole tree, as
``celery -A tree echomq show JOBID`` would (nested flows indented).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import Any

from _local import configure_from_env, local_worker
from celery import Celery

from celery_echomq import flow, get_state
from celery_echomq.ops.cli import render_tree
from celery_echomq.ops.views import JobNode, read_tree

app = Celery("tree")
configure_from_env(app)

REGIONS = {
    "north": ["oslo", "bergen", "tromso"],
    "south": ["lyon", "nice"],
    "east": ["krakow", "gdansk", "lodz", "poznan"],
}


@app.task
def store_sales(region: str, store: str) -> int:
    """A leaf: one store's sales (deterministic, so the example's output is checkable)."""
    time.sleep(0.1)  # pretend to query the store's database
    return zlib.crc32(f"{region}/{store}".encode()) % 1000


@app.task
def region_total(sales: list[int], region: str) -> dict[str, Any]:
    """A nested flow's parent: runs once its stores are counted."""
    return {"region": region, "stores": len(sales), "total": sum(sales)}


@app.task
def report(regions: list[dict[str, Any]]) -> dict[str, Any]:
    """The root: runs once every region's parent has run."""
    return {
        "regions": {r["region"]: r["total"] for r in regions},
        "total": sum(r["total"] for r in regions),
    }


def expected() -> dict[str, Any]:
    """The same report computed locally, to check the tree's."""
    totals = {
        region: sum(zlib.crc32(f"{region}/{store}".encode()) % 1000 for store in stores)
        for region, stores in REGIONS.items()
    }
    return {"regions": totals, "total": sum(totals.values())}


def settled_tree(flow_id: str, wait: float = 10) -> JobNode:
    """The tree once its root's row has finished (or after ``wait`` seconds).

    Celery stores the root's result before the worker's task_success signal marks its row
    done, so right after ``get()`` the row may still read "active" for a moment.
    """
    deadline = time.monotonic() + wait
    node = read_tree(get_state(app), flow_id)
    while not node.finished and time.monotonic() < deadline:
        time.sleep(0.05)
        node = read_tree(get_state(app), flow_id)
    return node


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the report")
    args = parser.parse_args(argv)
    with local_worker("tree", app):
        tree = flow(
            report.s(),
            [
                flow(region_total.s(region), [store_sales.s(region, store) for store in stores])
                for region, stores in REGIONS.items()
            ],
        )
        res = tree.apply_async()
        print(f"flow {res.id}: {len(REGIONS)} regions, {sum(map(len, REGIONS.values()))} stores")
        try:
            value = res.get(timeout=args.timeout)
        except Exception as exc:  # a timeout or a failed flow: show where the tree stands
            print(f"the report did not finish: {type(exc).__name__}: {exc}")
            value = None
            # Stop listening for the result while Redis is still up; otherwise the result's
            # finalizer retries an unsubscribe against the stopped server at exit.
            res.backend.remove_pending_result(res)
        print("tree:")
        for line in render_tree(settled_tree(res.id, wait=10 if value is not None else 0)):
            print("  " + line)
        if value is None:
            return 1
        for region, total in value["regions"].items():
            print(f"{region}: {total}")
        print(f"total: {value['total']}")
        matches = value == expected()
        print(f"matches a local count: {matches}")
        return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
