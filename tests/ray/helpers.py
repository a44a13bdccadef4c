"""What the Ray tests check the cluster with: live stage actors and placement groups."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Callable, TypeVar

import ray


def live_stage_actors() -> set[str]:
    """Ids of StageActors not DEAD (from the GCS; no dashboard needed)."""
    from ray._private import state

    return {
        aid
        for aid, a in state.actors().items()
        if a["ActorClassName"].endswith("StageActor") and a["State"] != "DEAD"
    }


def live_placement_groups() -> set[str]:
    return {pid for pid, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``check`` until true (the GCS learns of deaths asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def actor_ids(handles) -> set[str]:
    return {h._actor_id.hex() for h in handles}


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it (from /proc's parent links)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def _socket_inodes(pid: int) -> set[int]:
    import os

    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _hex_address(text: str, v6: bool) -> str:
    import ipaddress
    import struct

    raw = bytes.fromhex(text)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw))
        return str(ipaddress.IPv6Address(raw))
    return str(ipaddress.IPv4Address(struct.pack("<I", int(text, 16))))


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that the processes
    ``pids`` hold, read from /proc/net/tcp and tcp6 (inodes mapped to pids through
    /proc/<pid>/fd)."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            inode = int(cols[9])
            if inode in owner:
                addr, port = cols[1].split(":")
                found.append((owner[inode], _hex_address(addr, v6), int(port, 16)))
    return found


def not_loopback(sockets: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    import ipaddress

    def loopback(text: str) -> bool:
        addr = ipaddress.ip_address(text)
        mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return (mapped or addr).is_loopback

    return [s for s in sockets if not loopback(s[1])]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(port: int, path: str, body, method: str = "POST") -> tuple[int, dict]:
    """(status, JSON answer) of one request to 127.0.0.1:``port`` (``body``: bytes, or a
    value sent as JSON; GET sends none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, data if method == "POST" else None,
                     {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def sse_stream(port: int, path: str, body: dict) -> list[dict]:
    """Every event of a /generate_stream answer, read as it arrives."""
    from actors.serve.generate_request import parse_sse

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        assert r.getheader("content-type").startswith("text/event-stream")
        return list(parse_sse(r))
    finally:
        conn.close()


T = TypeVar("T")


def at_once(work: Callable[[int], T], n: int, timeout: float = 300.0) -> list[T]:
    """``work(0) .. work(n - 1)``, each in a thread of its own, all at once; their results
    in order, or the first error one raised."""
    got: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = work(i)
        except BaseException as e:  # raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return [got[i] for i in range(n)]
