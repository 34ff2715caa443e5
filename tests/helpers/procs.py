"""/proc helpers for the reliability and security tests (and bench/load_test.py): a server's
processes, their memory, and the sockets they listen on. Linux only."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> list[str]:
    return [
        a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]


def flag_value(argv: list[str], flag: str) -> str:
    """The value of `flag` in a command line, given as `flag value` or `flag=value`."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    raise ValueError(f"{flag} is not in {argv}")


def exited(pid: int) -> bool:
    """Gone, or a zombie that its parent has not reaped (a stopped parent cannot)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def is_api_process(argv: list[str]) -> bool:
    """The API process's command line: `python -P <checkout>/api/server.py ...` (rank 0
    starts it by file path) or `python -m tapserve.api.server ...`."""
    return any(a.endswith("/api/server.py") or a.endswith("api.server") for a in argv)


def api_pid(rank0: int) -> int:
    """The API process started by rank 0."""
    for pid in children(rank0):
        try:
            if is_api_process(cmdline(pid)):
                return pid
        except OSError:
            continue
    raise RuntimeError(f"API process of {rank0} not found")


def socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _ipv4(hex_addr: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hex_addr, 16)))


def _ipv6(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    return socket.inet_ntop(
        socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    )


def listening_tcp(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket (IPv4 and IPv6) the processes hold,
    from /proc/net/tcp{,6} matched by socket inode."""
    by_inode = {}
    for pid in pids:
        try:
            for inode in socket_inodes(pid):
                by_inode[inode] = pid
        except OSError:
            continue
    out = []
    for name, parse in (("tcp", _ipv4), ("tcp6", _ipv6)):
        path = Path(f"/proc/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in by_inode:  # TCP_LISTEN
                addr, port = local.split(":")
                out.append((by_inode[inode], parse(addr), int(port, 16)))
    return out


def unix_socket_paths(pid: int) -> list[str]:
    """Bound paths of the Unix sockets the process holds (from /proc/net/unix); abstract
    sockets show with a leading '@'."""
    inodes = socket_inodes(pid)
    out = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[6]) in inodes:
            out.append(fields[7])
    return out
