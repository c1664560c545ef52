"""The console (peer/progress.py): a live line on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from hivetrain.peer.progress import ERASE, Console


def test_a_terminal_gets_a_live_line_under_the_printed_lines() -> None:
    out = io.StringIO()
    console = Console(out, live=True)
    try:
        console.update(phase="computing", round=3, peers=4, group=3)
        for step in range(1, 5):
            console.update(step=step, steps=8, loss=4.0 - step / 10)
        console.say("round 2: train 3.900 | group 3")
        text = out.getvalue()
        assert ERASE + "round 2: train 3.900 | group 3\n" in text  # the line is printed above the live line
        last = text.rsplit("\n", 1)[-1]
        assert last.startswith("round 3 | computing | [##########..........] 4/8 | ETA ")
        assert "loss 3.600 | peers 4 | group 3" in last
        console.update(phase="averaging")
        assert out.getvalue().rsplit(ERASE, 1)[-1].startswith("round 3 | averaging | 0s")
    finally:
        console.close()
    assert out.getvalue().endswith(ERASE)  # nothing left on the line at the end


def test_a_pipe_gets_plain_lines_only() -> None:
    out = io.StringIO()
    console = Console(out, live=False)
    console.update(phase="computing", step=1, steps=8)
    console.say("round 0: train 4.000")
    console.close()
    assert out.getvalue() == "round 0: train 4.000\n"


def test_the_live_line_is_not_drawn_again_after_the_console_is_closed() -> None:
    # (review 2026-12-02, ux: the live line came back under "done: ...")
    out = io.StringIO()
    console = Console(out, live=True)
    console.update(phase="computing", round=3, peers=4, group=3)
    console.close()
    console.say("done: 3 rounds completed, 0 void, 1.20 MB sent")
    console.update(phase="averaging")
    assert out.getvalue().endswith(ERASE + "done: 3 rounds completed, 0 void, 1.20 MB sent\n"), repr(out.getvalue()[-80:])
