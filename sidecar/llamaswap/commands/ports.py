"""Who listens on a port: what `up` and `serve` say when a listen address is taken.

Linux only (/proc): the listening socket's inode from /proc/net/tcp and tcp6, then the process
holding it among those whose /proc/PID/fd this user may read. Anything else: None.
"""

from __future__ import annotations

import os
import pathlib

_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _listening_inodes(port: int, proc: pathlib.Path) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            local_port = fields[1].rsplit(":", 1)[-1]
            if int(local_port, 16) == port:
                inodes.add(fields[9])
    return inodes


def port_holder(port: int, *, proc: pathlib.Path = pathlib.Path("/proc")) -> str | None:
    """``"llama-server (pid 123)"`` for the process listening on TCP ``port``; None when it
    cannot be told (not Linux, another user's process)."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) not in wanted:
                    continue
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name = os.path.basename(argv[0].decode(errors="replace")) if argv and argv[0] else entry.name
            if name.startswith("python") and len(argv) > 2 and argv[1] == b"-m":
                name = argv[2].decode(errors="replace")  # python -m llamaswap
            elif name.startswith("python") and len(argv) > 1 and argv[1] and not argv[1].startswith(b"-"):
                name = os.path.basename(argv[1].decode(errors="replace"))  # python server.py
            return f"{name} (pid {entry.name})"
    return None


def is_llamaswap(holder: str | None) -> bool:
    """A holder that is (most likely) another llamaswap stack: its sidecar or its Envoy."""
    return holder is not None and holder.split(" ")[0] in ("llamaswap", "envoy")
