"""A quiet console for the job driver: one progress bar per stage, the summary, the errors.

With `QuietConsole` active (pipeline/run.py, unless --verbose) the driver's file descriptors
1 and 2 (Ray's start-up notes and warnings, Ray Train's and Ray Data's reports) are a pipe
read by one thread, which

  - appends everything, as it came, to a log file under the run directory
    (`<run_dir>/logs/run-<time>.log`; a temp dir when the run directory is remote),
    so Ray's worker output (forwarded to the driver) lands there too;
  - reads the stages' own progress lines from that stream (synth's video bar, preprocess'
    and caption's "N to do" / "chunk i/n: k ok, f failed", training's "[train] step S
    total L"), and draws one bar per stage on the real terminal: videos for synth,
    preprocess and caption, steps with the loss and an ETA for training;
  - passes lines that report errors (Python tracebacks' last line, "ERROR" log records,
    "error:" lines) to the terminal as well, so a failure is never hidden.

On a terminal the bar is redrawn in place; into a file or pipe it is written as a line at
each quarter of the stage and at its end, so a piped `make run` stays a few dozen lines.

The reader thread must never stop reading: were it to die, the pipe would fill and the
driver block on its next write. An error while parsing or drawing switches the console to
passing the output through as it comes (to the terminal and, while it can be written, the
log), says so once, and changes nothing else: the run goes on and exits as it would have.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import storage

MAX_ERROR_LINES = 20  # error lines passed to the terminal per stage; the rest are in the log
_ERROR = re.compile(r"^\s*(?:\S+ )?(?:ERROR\b|Traceback \(most recent call last\)|[A-Za-z_.]*(?:Error|Exception): |error: )")
_WORKER_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\([^)]*pid=\d+[^)]*\)(?:\x1b\[[0-9;]*m)?\s*")


@dataclass
class StageProgress:
    """What the console knows about the running stage."""

    name: str
    unit: str = "videos"
    total: int = 0
    done: int = 0
    loss: float | None = None
    start: float = field(default_factory=time.monotonic)
    first: tuple[float, int] | None = None  # (time, done) of the first progress, for the ETA

    def advance_to(self, done: int) -> None:
        if self.first is None:
            self.first = (time.monotonic(), done)
        self.done = max(self.done, done)

    def eta(self) -> float | None:
        if not self.first or not self.total or self.done <= self.first[1]:
            return None
        rate = (self.done - self.first[1]) / max(1e-6, time.monotonic() - self.first[0])
        return max(0.0, (self.total - self.done) / rate)


def parse_progress(stage: StageProgress, line: str, max_steps: int) -> bool:
    """Update `stage` from one output line; True when it changed. Pure: tested on its own."""
    line = _WORKER_PREFIX.sub("", line)
    if stage.name == "train":
        m = re.search(r"\[train\] step (\d+)\s+total ([0-9.eE+-]+|nan)", line)
        if m:
            stage.total = max_steps
            stage.advance_to(int(m.group(1)))
            stage.loss = float(m.group(2))
            return True
        m = re.search(r"\[train\] resumed from .* at step (\d+)", line)
        if m:
            stage.total, stage.done = max_steps, int(m.group(1))
            return True
        return False
    m = re.search(r"synthetic videos:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", line)
    if m:
        stage.total = int(m.group(2))
        stage.advance_to(int(m.group(1)))
        return True
    m = re.search(r"\[(?:preprocess|caption)\] (?:.*?, )?(\d+) (?:videos )?to (?:do|process)", line)
    if m:
        stage.total, stage.done, stage.first = int(m.group(1)), 0, None
        return True
    m = re.search(r"\[(?:preprocess|caption)\] chunk \d+/\d+: (\d+) (?:ok|done), (\d+) failed", line)
    if m:
        stage.advance_to(stage.done + int(m.group(1)) + int(m.group(2)))
        return True
    return False


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def render(stage: StageProgress, width: int = 24) -> str:
    """One bar line: `train      [#######.......]  1200/3800 steps  loss 0.812  ETA 4:10  (1:52)`."""
    elapsed = _clock(time.monotonic() - stage.start)
    if not stage.total:
        return f"{stage.name:<10} ...  ({elapsed})"
    frac = min(1.0, stage.done / stage.total)
    bar = "#" * int(round(frac * width)) + "." * (width - int(round(frac * width)))
    text = f"{stage.name:<10} [{bar}] {stage.done:>5}/{stage.total} {stage.unit}"
    if stage.loss is not None:
        text += f"  loss {stage.loss:.3f}"
    eta = stage.eta()
    if eta is not None and stage.done < stage.total:
        text += f"  ETA {_clock(eta)}"
    return text + f"  ({elapsed})"


def log_dir(run_dir: str) -> str:
    """Where the run's log goes: under the run directory when it is local, else a temp dir."""
    if storage.is_remote(run_dir):
        return tempfile.mkdtemp(prefix="padcap-logs-")
    path = os.path.join(run_dir[len("file://"):] if run_dir.startswith("file://") else run_dir, "logs")
    os.makedirs(path, exist_ok=True)
    return path


class QuietConsole:
    """Redirects fds 1/2 into a log file and draws the stage bars on the terminal (see above)."""

    def __init__(self, run_dir: str, max_steps: int):
        self.log_path = str(Path(log_dir(run_dir)) / time.strftime("run-%Y%m%d-%H%M%S.log"))
        self.max_steps = max_steps
        self.passthrough = False  # set for good when parsing or drawing failed (see the docstring)
        self.stage: StageProgress | None = None
        self._lock = threading.Lock()
        self._errors = 0
        self._last_draw = 0.0
        self._quarter = -1
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
        self.tty = self.out.isatty()
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._log = open(self.log_path, "ab", buffering=0)
        self._reader = threading.Thread(target=self._pump, args=(read_end,), daemon=True, name="padcap-console")
        self._reader.start()

    # ------------------------------------------------------------------ the stream

    def _pump(self, read_end: int) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError:
                return
            if not chunk:
                return
            if self.passthrough:
                self._pass(chunk)
                continue
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            shown = 0
            try:
                self._log.write(chunk)
                for raw in lines:
                    if raw:
                        self._observe(raw.decode("utf-8", errors="replace"))
                    shown += 1
            except Exception:
                self._fall_back(b"".join(raw + b"\n" for raw in lines[shown:]) + pending)
                pending = b""

    def _fall_back(self, unseen: bytes) -> None:
        """Parsing or drawing failed: from now on pass the output through; `unseen` (the lines not
        shown yet, the one that failed first) goes out that way too."""
        self.passthrough = True
        note = (f"(console: the progress display failed, passing the output through from here; "
                f"its error: {traceback.format_exc().strip().splitlines()[-1]})\n").encode()
        self._pass(note, log=True)
        self._pass(unseen, log=False)  # already in the log

    def _pass(self, data: bytes, log: bool = True) -> None:
        """Passthrough: `data` to the log and the terminal, each as far as it can be written."""
        with self._lock:
            for sink in ([self._log] if log else []) + [self.out]:
                try:
                    if sink is self.out:
                        sink.flush()  # what was written as text goes first
                        sink = sink.buffer
                    sink.write(data)
                    sink.flush()
                except Exception:  # a sink that cannot take it; reading goes on regardless
                    pass

    def _observe(self, line: str) -> None:
        with self._lock:
            if _ERROR.search(_WORKER_PREFIX.sub("", line)):
                self._errors += 1
                if self._errors <= MAX_ERROR_LINES:
                    self._write_line(line.rstrip())
                elif self._errors == MAX_ERROR_LINES + 1:
                    self._write_line(f"(more error lines in {self.log_path})")
            elif self.stage is not None and parse_progress(self.stage, line, self.max_steps):
                self._draw()

    # ------------------------------------------------------------------ the terminal

    def _write_line(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\x1b[2K" + text + "\n")
            if self.stage is not None:
                self.out.write(render(self.stage))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def _draw(self, final: bool = False) -> None:
        stage = self.stage
        if self.passthrough:  # no more bars: the output itself is on the terminal
            return
        if self.tty:
            now = time.monotonic()
            if final or now - self._last_draw >= 0.2:
                self._last_draw = now
                self.out.write("\r\x1b[2K" + render(stage) + ("\n" if final else ""))
                self.out.flush()
            return
        quarter = int(4 * stage.done / stage.total) if stage.total else 0
        if final or (quarter > self._quarter and quarter < 4):
            self._quarter = quarter
            self.out.write(render(stage) + "\n")
            self.out.flush()

    def print(self, text: str = "") -> None:
        """A line of the driver's own for the terminal (and the log)."""
        with self._lock:
            self._log.write((text + "\n").encode())
            self._write_line(text)

    def stage_start(self, name: str) -> None:
        with self._lock:
            self.stage = StageProgress(name, unit="steps" if name == "train" else "videos")
            self._quarter, self._errors = -1, 0
            self._draw()

    def stage_end(self, note: str = "") -> None:
        time.sleep(0.1)  # let the pipe drain the stage's last lines
        with self._lock:
            if self.stage is None:
                return
            if self.stage.total and note != "failed":
                self.stage.done = max(self.stage.done, self.stage.total)
            self._draw(final=True)
            if note:
                self._write_line(f"{'':<10} {note}")
            self.stage = None

    def close(self) -> None:
        """Give the terminal back to fds 1/2 (the pipe's readers drain what is left)."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._reader.join(timeout=1.0)
