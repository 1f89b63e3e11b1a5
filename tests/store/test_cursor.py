"""The one cursor of the paged reads: what a page hands back is what the next call takes."""

from __future__ import annotations

import pytest

from celery_echomq.errors import CursorError
from celery_echomq.store.cursor import Cursor

ID = "JOB6f7bfe8494704881a545971730195395"


@pytest.mark.parametrize(
    ("text", "phases", "after", "cursor"),
    [
        ("0", "", "any", Cursor("", 0)),
        ("17:failed:" + ID, "", "any", Cursor("", 17, "failed:" + ID)),
        ("i42", "fic", "any", Cursor("i", 42)),
        ("r1796120636460123:" + ID, "fr", "id", Cursor("r", 1796120636460123, ID)),
        ("250", "", "none", Cursor("", 250)),
    ],
)
def test_a_cursor_reads_back_as_the_page_wrote_it(
    text: str, phases: str, after: str, cursor: Cursor
) -> None:
    assert Cursor.parse(text, "page", phases, after=after) == cursor
    assert str(cursor) == text


def test_no_cursor_is_the_first_page_of_the_first_phase() -> None:
    assert Cursor.parse(None, "page", "fic") == Cursor("f", 0)
    assert Cursor.parse(None, "page") == Cursor()


@pytest.mark.parametrize(
    ("text", "phases", "after"),
    [
        ("nope", "", "any"),
        ("", "", "any"),
        ("x12", "fic", "any"),  # a phase the read does not have
        ("f", "fic", "any"),  # a phase without a position
        ("12:", "", "any"),  # a member left empty
        ("12:" + ID, "", "none"),  # a read by position takes no member
        ("12:notajob", "", "id"),  # a member that is no job id
        ("9" * 21, "", "any"),  # past any HSCAN cursor
        ("-3", "", "any"),
    ],
)
def test_a_cursor_no_page_gave_is_refused_naming_the_read(
    text: str, phases: str, after: str
) -> None:
    with pytest.raises(CursorError, match="not a failed_children cursor"):
        Cursor.parse(text, "failed_children", phases, after=after)
