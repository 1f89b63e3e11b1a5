"""Each example runs as a user runs it (`python examples/NAME.py`) and prints what it promises.

Every example starts its own redis-server and its own `celery worker`, so these tests need
no fixture; they are slow (a worker start each) and run a few seconds apiece.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.e2e


def run_example(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_quickstart_prints_the_parents_result() -> None:
    out = run_example("quickstart")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "children done 8/8" in out.stdout
    assert "parent result: {'pages': 8, 'total': 140, 'values': [0, 1, 4, 9, 16, 25, 36, 49]}" in (
        out.stdout
    )
    # The flow's tree is shown while its store runs; what it suggests after names no flow or
    # store that is gone when it ends.
    flow_id = re.search(r"^flow (JOB\w+): parent held", out.stdout, re.M)
    assert flow_id is not None
    shown, after = out.stdout.split("Try next", 1)
    assert f"$ celery -A quickstart echomq show {flow_id[1]}" in shown
    assert f"flow {flow_id[1]}  quickstart.merge  done" in shown and "done=8/8" in shown
    assert flow_id[1] not in after and "JOBID" in after and "proj.py in the README" in after


def test_fanout_fetches_every_page_and_merges_the_word_counts() -> None:
    out = run_example("fanout")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"serving 6 pages on http://127\.0\.0\.1:\d+", lines[1])
    assert "children done: 6/6" in lines
    # Each page has 200 + 40 n words; each child fetched and counted its own page.
    for n in range(6):
        assert any(
            re.fullmatch(rf"  /page/{n}\.txt: {200 + 40 * n} words  \(JOB[0-9a-f]{{32}}\)", line)
            for line in lines
        ), out.stdout
    assert "pages merged: 6" in lines
    assert "total words: 1800" in lines
    assert any(re.fullmatch(r"top words: (\w+=\d+, ){4}\w+=\d+", line) for line in lines)
    assert lines[-1] == "matches a local count: True"


def test_policies_shows_what_each_policy_makes_of_a_failed_child() -> None:
    out = run_example("policies")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    error = "ValueError: cannot identify image file 'corrupt.png'"
    three = "published 3 thumbnail(s): thumbs/beach.jpg, thumbs/harbour.jpg, thumbs/market.jpg"
    assert re.search(
        rf"    fail: parent failed and did not run: {re.escape(error)} \(child JOB[0-9a-f]{{32}}\)",
        text,
    )
    assert f'  ignore: {three}\n          ignored failures: ["{error}"]\n' in text
    assert f"  remove: {three}\n          ignored failures: none\n" in text
    # "continue" releases the parent as soon as the corrupt child fails: it does not wait
    # for the three slow siblings, which still finish and are recorded afterwards.
    found = re.search(r"continue: published (\d) thumbnail\(s\)", text)
    assert found is not None and int(found.group(1)) < 3, text
    assert "children settled after the parent ran: 4" in text


def test_tree_rolls_nested_flows_up_into_one_report() -> None:
    out = run_example("tree", "--timeout", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "matches a local count: True"
    tree = lines[lines.index("tree:") + 1 : lines.index("tree:") + 14]
    # The root, three regions (nested flows) indented under it, and their nine stores.
    assert tree[0].startswith("  flow JOB") and "tree.report  done" in tree[0]
    regions = [line for line in tree if "tree.region_total" in line]
    stores = [line for line in tree if "tree.store_sales" in line]
    assert len(regions) == 3 and all(re.match(r"  [├└]─ flow JOB", r) for r in regions)
    assert len(stores) == 9 and all(re.match(r"  [│ ]  [├└]─ JOB", s) for s in stores)
    assert all("  done  " in line for line in tree)
