"""Fan-out, fan-in: fetch pages over HTTP in parallel, then merge their word counts once.

    python examples/fanout.py        (inside the venv; needs celery-echomq[embedded])

The script serves a few generated pages from a local ``http.server`` on a free loopback
port, starts a private redis-server and a real ``celery -A fanout worker``, and runs

    flow(merge_counts.s(), [count_words.s(url) for url in urls])

Each child fetches one page with urllib and counts its words; the parent is held in Redis
until the last child completes, then gets the list of their counts (in the children's order,
like a chord body) and merges them. The script prints the merged result and checks it
against a count made locally from the same pages.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.error import URLError

from _local import configure_from_env, local_worker
from celery import Celery

from celery_echomq import flow

app = Celery("fanout")
configure_from_env(app)

WORDS = [
    "redis",
    "celery",
    "flow",
    "parent",
    "child",
    "queue",
    "worker",
    "script",
    "atomic",
    "counter",
    "release",
    "fan",
    "chord",
    "group",
    "message",
    "broker",
    "result",
    "value",
    "retry",
    "policy",
    "lease",
    "slot",
    "key",
]


def make_pages(count: int = 6, seed: int = 8) -> dict[str, str]:
    """A few pages of pseudo-text, the same on every run."""
    rng = random.Random(seed)
    return {
        f"/page/{n}.txt": " ".join(rng.choice(WORDS) for _ in range(200 + 40 * n))
        for n in range(count)
    }


@contextmanager
def serve(pages: dict[str, str]) -> Iterator[str]:
    """Serve ``pages`` on 127.0.0.1 (a free port) from a thread; yield the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            if body is None:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the example prints its own progress; no access log on stderr

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def count(text: str) -> dict[str, int]:
    return dict(Counter(re.findall(r"[a-z]+", text.lower())))


# No proxy: the pages are on loopback, and an http_proxy in the environment must not
# send the request (or the page) anywhere else.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@app.task(autoretry_for=(URLError,), retry_backoff=True, max_retries=3)
def count_words(url: str) -> dict[str, int]:
    """A child: fetch one page and count its words (a flaky fetch is retried by Celery)."""
    with _opener.open(url, timeout=10) as response:
        return count(response.read().decode("utf-8"))


@app.task
def merge_counts(counts: list[dict[str, int]]) -> dict[str, Any]:
    """The parent: runs once, with every child's counts."""
    total: Counter[str] = Counter()
    for page in counts:
        total.update(page)
    return {"pages": len(counts), "words": sum(total.values()), "top": total.most_common(5)}


def main() -> int:
    pages = make_pages()
    with serve(pages) as base, local_worker("fanout", app):
        urls = [base + path for path in pages]
        print(f"serving {len(urls)} pages on {base}")
        children = [count_words.s(url) for url in urls]
        fan = flow(merge_counts.s(), children)
        fan.freeze()  # assigns every job id now, so we can name each child below
        res = fan.apply_async()
        print(f"flow {res.id}: {len(urls)} children fetch, the parent merges")
        merged = res.get(timeout=120)
        # The children's own values stay readable in Redis after the parent ran.
        per_child = res.children_values()
        print(f"children done: {res.dependencies().done}/{len(urls)}")
        for child, path in zip(children, pages, strict=True):
            child_id = child.options["task_id"]
            print(f"  {path}: {sum(per_child[child_id].values())} words  ({child_id})")
        print(f"pages merged: {merged['pages']}")
        print(f"total words: {merged['words']}")
        print("top words: " + ", ".join(f"{word}={n}" for word, n in merged["top"]))
        local: Counter[str] = Counter()
        for text in pages.values():
            local.update(count(text))
        matches = merged["words"] == sum(local.values()) and [
            list(pair) for pair in local.most_common(5)
        ] == [list(pair) for pair in merged["top"]]
        print(f"matches a local count: {matches}")
        return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
