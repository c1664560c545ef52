"""Console output for ``peer start``: plain lines, and on a terminal a live status line under them.

The live line shows the phase the peer is in (computing / averaging / syncing / waiting), a bar
for the inner steps of the current round with its ETA, the latest training loss and tokens/s, and
the peers in the run and in our last group. It is redrawn in place (carriage return, erase line)
and every printed line goes above it. When stdout is not a terminal, or with ``--quiet``, there is
no live line: the output is the same lines as always, one per event, nothing redrawn.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TextIO

BAR = 20  # characters of the inner-step bar
TICK = 1.0  # seconds between redraws while nothing changes (the elapsed time moves on)
ERASE = "\r\x1b[K"  # to the start of the line, erase it


class Console:
    """``say`` prints a line; ``update`` changes the live line (only when ``live``). Thread-safe:
    the training thread, the dashboard and the DHT threads may all say something."""

    def __init__(self, out: TextIO, live: bool):
        self.out, self.live = out, live
        self.state: dict[str, Any] = {"phase": "starting"}
        self._since = time.monotonic()  # when the phase began
        self._step_times: list[float] = []  # when each inner step of the current round ended
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if live:
            self._ticker = threading.Thread(target=self._tick, name="hivetrain-console", daemon=True)
            self._ticker.start()

    def say(self, msg: str) -> None:
        with self._lock:
            if self.live:
                self.out.write(ERASE + msg + "\n" + self._line())
            else:
                self.out.write(msg + "\n")
            self.out.flush()

    def update(self, **fields: Any) -> None:
        if not self.live:
            return
        with self._lock:
            if fields.get("phase", self.state["phase"]) != self.state["phase"]:
                self._since = time.monotonic()
            if fields.get("step") == 1 or fields.get("phase") == "computing" and "step" not in fields:
                self._step_times = []
            if "step" in fields:
                self._step_times.append(time.monotonic())
            self.state.update(fields)
            self.out.write(ERASE + self._line())
            self.out.flush()

    def close(self) -> None:
        """Erases the live line for good: what is said after (the ``done:`` line) is a plain line."""
        self._stop.set()
        with self._lock:
            if self.live:
                self.out.write(ERASE)
                self.out.flush()
            self.live = False

    def _tick(self) -> None:
        while not self._stop.wait(TICK):
            with self._lock:
                self.out.write(ERASE + self._line())
                self.out.flush()

    def _line(self) -> str:
        s = self.state
        parts = [f"round {s['round']}" if "round" in s else "", s["phase"]]
        if s["phase"] == "computing" and s.get("steps"):
            done, total = s.get("step", 0), s["steps"]
            filled = BAR * done // total
            parts.append(f"[{'#' * filled}{'.' * (BAR - filled)}] {done}/{total}")
            times = self._step_times
            if len(times) >= 2 and done < total:  # the first step includes warm-up: time the ones after it
                per_step = (times[-1] - times[0]) / (len(times) - 1)
                parts.append(f"ETA {per_step * (total - done):.0f}s")
        else:
            parts.append(f"{time.monotonic() - self._since:.0f}s")
        if s.get("loss") is not None:
            parts.append(f"loss {s['loss']:.3f}")
        if s.get("tokens_per_s"):
            parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
        if s.get("peers") is not None:
            parts.append(f"peers {s['peers']}")
        if s.get("group") is not None:
            parts.append(f"group {s['group']}")
        return " | ".join(p for p in parts if p)
