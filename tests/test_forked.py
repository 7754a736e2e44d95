"""tvsmt/forked.py `ForkedCall`'s notes: written by a thread of the child, so a note larger
than a pipe holds never stops the child's work; a child that sends no note in time is
stopped and collected, never left running."""

from __future__ import annotations

import os
import time

import pytest

from tvsmt.forked import ForkedCall

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")

BIG = b"n" * (4 << 20)  # a pipe holds 64 KiB


def _wait_for(path, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def test_a_note_larger_than_a_pipe_does_not_stop_the_child(tmp_path):
    went_on = tmp_path / "went-on"

    def fn(note):
        note(BIG)
        went_on.touch()  # before this process has read a byte of the note
        note(b"second")
        return b"answer"

    call = ForkedCall(fn, notes=True)
    assert _wait_for(went_on)
    assert call.next_note() == BIG  # whole, and the notes in their order
    assert call.next_note() == b"second"
    assert call.next_note() is None
    assert call.answer(30) == b"answer"


def test_a_child_that_sends_no_note_in_time_is_stopped():
    def fn(note):
        time.sleep(600)
        return b""

    call = ForkedCall(fn, notes=True)
    pid = call.pid
    t0 = time.monotonic()
    assert call.next_note(0.5) is None
    assert time.monotonic() - t0 < 20
    assert call.pid is None  # stopped, and collected:
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert call.answer(1) is None
