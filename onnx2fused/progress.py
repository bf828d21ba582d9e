"""Progress lines of long commands, on stderr, with the time since the command started.

    say = Progress()                      # onnx2fused: [   0.4 s] building the plugin for 1 kernel(s)
    say("building the plugin")            # any callable(str) progress hook in onnx2fused accepts it
    say.close()                           # (or `with Progress() as say:`)

A step that runs longer than `interval` seconds without a new line (an nvcc build, a long benchmark sweep)
gets a heartbeat line every `interval` seconds: `onnx2fused: [  60.0 s] still: compiling 9 translation units
(45 s)`, so that a user sees the command is alive and how long the step has taken. The interval is
$ONNX2FUSED_PROGRESS_INTERVAL seconds (default 30; 0 turns the heartbeat off). A disabled Progress
(`--quiet`) prints nothing and starts no thread.
"""
from __future__ import annotations

import os
import sys
import threading
import time

DEFAULT_INTERVAL = 30.0


def interval_from_env() -> float:
    try:
        return max(0.0, float(os.environ.get("ONNX2FUSED_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


class Progress:
    def __init__(self, prog: str = "onnx2fused", stream=None, interval: float | None = None, enabled: bool = True):
        self.prog = prog
        self.stream = stream if stream is not None else sys.stderr   # fixed now: a redirect later does not move it
        self.interval = interval_from_env() if interval is None else interval
        self.enabled = enabled
        self.t0 = time.monotonic()
        self._last_msg: str | None = None
        self._last_at = self.t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _write(self, text: str) -> None:
        try:
            print(f"{self.prog}: [{self.elapsed():6.1f} s] {text}", file=self.stream, flush=True)
        except (OSError, ValueError):   # a closed or broken stderr must not break the command
            pass

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._last_msg, self._last_at = msg, time.monotonic()
            self._write(msg)
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._beat, name="onnx2fused-progress", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                since = time.monotonic() - self._last_at
                if self._last_msg is not None and since >= self.interval * 0.999:
                    self._write(f"still: {self._last_msg} ({since:.0f} s)")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
