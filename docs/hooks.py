"""MkDocs hooks (mkdocs.yml): the README is the site's index page, and CHANGELOG.md its
changelog page, each kept where GitHub shows it. Links are written for GitHub, relative to
each file: the README's ``docs/flows.md`` is ``flows.md`` on the site, and a page's
``../README.md`` is the index page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# A page of the site taken from the repository's root: its name there, its name on the site.
FROM_ROOT = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
# A Markdown link's or image's target, up to its anchor.
TARGET = re.compile(r"\]\((?!https?:|#)([^)#\s]+)")


def on_files(files: Files, config: Any) -> Files:
    for name, page in FROM_ROOT.items():
        path = ROOT / name
        files.append(File.generated(config, page, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    at_root = page.file.src_uri in FROM_ROOT.values()
    return TARGET.sub(lambda m: "](" + site_target(m.group(1), at_root), markdown)


def site_target(target: str, at_root: bool) -> str:
    """A GitHub link's target on the site: from a root file, docs/X is X and the other root
    file is its page; from a page of docs/, ../README.md and ../CHANGELOG.md are their pages.
    Anything else is left as it is (a target outside the site then fails the strict build)."""
    if at_root and target.startswith("docs/"):
        return target.removeprefix("docs/")
    if at_root:
        return FROM_ROOT.get(target, target)
    if target.startswith("../"):
        return FROM_ROOT.get(target.removeprefix("../"), target)
    return target
