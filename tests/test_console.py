"""pipeline/console.py: the stages' progress lines parsed, and the quiet console end to end in
a child process (its fds 1/2 redirected into the log, bars and errors on the real output)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from pipeline.console import StageProgress, parse_progress, render

ROOT = Path(__file__).resolve().parents[1]


def test_progress_lines_of_every_stage():
    train = StageProgress("train", unit="steps")
    line = "\x1b[36m(RayTrainWorker pid=24804)\x1b[0m [train] step 1900  total 0.6239  lm 0.0007  lr 8.00e-04  360s"
    assert parse_progress(train, line, max_steps=3800)
    assert (train.done, train.total, train.loss) == (1900, 3800, 0.6239)
    assert "1900/3800 steps  loss 0.624" in render(train)
    assert not parse_progress(train, "Reporting training result 11: TrainingReport(...)", 3800)

    pre = StageProgress("preprocess")
    assert parse_progress(pre, "[preprocess] 144 videos to process, 0 already done, 0 failed before decoding", 0)
    assert parse_progress(pre, "[preprocess] chunk 1/3: 60 ok, 4 failed", 0)
    assert (pre.done, pre.total) == (64, 144)

    cap = StageProgress("caption")
    assert parse_progress(cap, "[caption] 36 videos, 0 already captioned with model-a08, 36 to do", 0)
    assert parse_progress(cap, "[caption] chunk 1/1: 36 done, 0 failed, 210.3 videos/min", 0)
    assert (cap.done, cap.total) == (36, 36)

    synth = StageProgress("synth")
    assert parse_progress(synth, "synthetic videos:  24%|██▎       | 34/144 [00:03<00:10, 10.47video/s]", 0)
    assert (synth.done, synth.total) == (34, 144)


def test_quiet_console_keeps_the_terminal_short_and_the_log_whole(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from pipeline.console import QuietConsole
        console = QuietConsole({str(tmp_path / "run")!r}, max_steps=1000)
        console.stage_start("train")
        for step in range(0, 1001, 10):
            print(f"(RayTrainWorker pid=1) Reporting training result {{step}}: TrainingReport(metrics=...)", flush=True)
            print(f"(RayTrainWorker pid=1) [train] step {{step}}  total {{1 / (step + 1):.4f}}  lr 1e-3  1s", flush=True)
        os.write(2, b"(RayTrainWorker pid=1) RuntimeError: a worker failed here\\n")
        console.stage_end()
        console.print("stage  time  result")
        console.close()
        print("after close")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2:] == ["stage  time  result", "after close"]
    assert any("RuntimeError: a worker failed here" in line for line in lines)  # errors reach the terminal
    bars = [line for line in lines if line.startswith("train ")]
    assert 2 <= len(bars) <= 6 and "1000/1000 steps" in bars[-1]  # a few bar lines, not 200 lines of output
    assert not any("Reporting training result" in line for line in lines)
    log = next((tmp_path / "run" / "logs").glob("run-*.log")).read_text()
    assert log.count("Reporting training result") == 101 and "a worker failed here" in log


def test_a_failing_parser_falls_back_to_passing_the_output_through(tmp_path):
    """The reader thread's parser raises mid-stage: the driver neither hangs on a full pipe (it then
    writes far more than a pipe holds) nor changes its exit status, and every line after the
    failure reaches the terminal as it came."""
    script = textwrap.dedent(f"""
        import os, sys
        from pipeline import console as module
        from pipeline.console import QuietConsole, parse_progress

        def parser(stage, line, max_steps):
            if "boom" in line:
                raise ValueError("a parser bug")
            return parse_progress(stage, line, max_steps)

        module.parse_progress = parser  # the reader thread's parser, broken on purpose
        console = QuietConsole({str(tmp_path / "run")!r}, max_steps=100)
        console.stage_start("train")
        print("[train] step 30  total 0.5000  lr 1e-3  1s", flush=True)
        print("boom: a line the parser cannot take", flush=True)
        for i in range(20000):  # ~1 MB: blocks the driver unless the pipe is still drained
            print(f"after the failure {{i:05d}} " + "x" * 40, flush=True)
        console.stage_end()
        console.print("stage  time  result")
        console.close()
        print("after close", flush=True)
        sys.exit(3)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 3, out.stderr  # the script's own exit status
    lines = out.stdout.splitlines()
    note = next(i for i, line in enumerate(lines) if "passing the output through" in line)
    assert "ValueError: a parser bug" in lines[note]
    assert lines[note + 1] == "boom: a line the parser cannot take"  # the failing line is shown, then the rest
    passed = [line for line in lines if line.startswith("after the failure")]
    assert len(passed) == 20000 and passed[-1].startswith("after the failure 19999")
    assert any("30/100 steps" in line for line in lines[:note])  # bars until the failure
    assert lines[-2:] == ["stage  time  result", "after close"]
    log = next((tmp_path / "run" / "logs").glob("run-*.log")).read_text()
    assert log.count("after the failure") == 20000 and "passing the output through" in log
