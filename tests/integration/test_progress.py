"""The progress writer (``protrain_fx/progress.py``): a line redrawn in place on a terminal and ended
by a newline, nothing on a stream that is not one, ``PROTRAIN_PROGRESS`` forcing either, and phase
times that never overlap. Fake streams and sleeps of tens of milliseconds: no compile here (the
compile's phases are ``tests/planner/test_phases.py``)."""

from __future__ import annotations

import io
import time

import pytest

from protrain_fx import progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _env_unset(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)


def _count_ops(stream, n: int = 3) -> dict[str, float]:
    seconds: dict[str, float] = {}
    with (progress.recording(seconds, title="protrain_fx: graph 0", stream=stream),
          progress.phase("ops", "profiling ops", total=n) as ops):
        for _ in range(n):
            ops.advance()
    return seconds


def test_a_terminal_gets_carriage_return_updates_and_a_final_newline():
    tty = FakeTTY()
    seconds = _count_ops(tty)
    out = tty.getvalue()
    assert out.startswith("\r") and out.endswith("\n") and out.count("\n") == 1
    assert "protrain_fx: graph 0: profiling ops 0/3" in out and "profiling ops 3/3" in out
    final = out.rsplit("\r", 1)[1]
    assert final.startswith("protrain_fx: graph 0: ops ") and "in all)" in final
    assert list(seconds) == ["ops"] and seconds["ops"] >= 0


def test_a_stream_that_is_not_a_terminal_gets_nothing_but_the_times_are_kept():
    plain = io.StringIO()
    seconds = _count_ops(plain)
    assert plain.getvalue() == "" and list(seconds) == ["ops"]


@pytest.mark.parametrize("value, tty, shown", [("0", True, False), ("1", False, True), ("off", True, False),
                                               ("on", False, True), ("", True, True), ("", False, False)])
def test_the_environment_variable_forces_the_line_off_or_on(monkeypatch, value, tty, shown):
    monkeypatch.setenv(progress.ENV, value)
    stream = FakeTTY() if tty else io.StringIO()
    _count_ops(stream)
    assert (stream.getvalue() != "") == shown
    assert progress.shown(stream) == shown


def test_a_phase_inside_another_counts_for_itself_only():
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with progress.recording(seconds, stream=io.StringIO()), progress.phase("outer"):
        time.sleep(0.02)
        with progress.phase("inner"):
            time.sleep(0.05)
        with progress.phase("inner"):  # entered again: adds up
            time.sleep(0.01)
    wall = time.perf_counter() - started
    assert list(seconds) == ["outer", "inner"]
    assert seconds["inner"] >= 0.06 and seconds["outer"] >= 0.02
    assert seconds["outer"] + seconds["inner"] <= wall


def test_begin_since_counts_time_before_the_call_and_end_closes_what_is_inside():
    seconds: dict[str, float] = {}
    before = time.perf_counter()
    time.sleep(0.03)
    with progress.recording(seconds, stream=io.StringIO(), since=before) as rec:
        rec.begin("capture", since=before)
        with progress.phase("inner"):
            progress.end("capture")  # closes the inner phase too
            assert progress.current() is rec and not rec._stack
    assert seconds["capture"] >= 0.03 and set(seconds) == {"capture", "inner"}
    progress.end("capture")  # no recording open: nothing to close


def test_a_phase_with_no_item_is_redrawn_as_its_seconds_pass(monkeypatch):
    monkeypatch.setattr(progress, "TICK_S", 0.005)
    tty = FakeTTY()
    with progress.recording(stream=tty), progress.phase("search"):
        time.sleep(0.2)
    draws = tty.getvalue().count("\r")
    assert draws > 2  # beyond the phase's first draw and the final line: the ticks


def test_a_note_is_a_line_of_its_own_under_the_progress_line():
    tty = FakeTTY()
    with progress.recording(stream=tty), progress.phase("machine", "measuring the machine"):
        progress.note("protrain_fx: measuring cpu (once)")
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in tty.getvalue().split("\n")]
    assert lines[0] == "protrain_fx: measuring cpu (once)"
    assert lines[1].startswith("protrain_fx: machine ") and lines[2] == ""


def test_a_phase_without_a_recording_records_into_its_own(capsys):
    with progress.phase("ops", total=1) as ops:
        ops.advance()
    assert progress.current() is None
    assert capsys.readouterr().err == ""  # pytest's stderr is not a terminal


def test_seconds_line():
    assert progress.seconds_line({"capture": 12.34, "search": 0.0512, "ops": 1.0}) == (
        "capture 12.3 s, search 0.051 s, ops 1.0 s")
    assert progress.seconds_line({}) == ""
