"""The control socket that `supermem top` reads: a unix socket served by a daemon thread.

Where: `$XDG_RUNTIME_DIR/supermem/<pid>.sock`, or `/tmp/supermem-<uid>/<pid>.sock` without a usable
XDG_RUNTIME_DIR. The directory is created 0700 and must be owned by this user with no group or other
access (else the server does not start: another user could plant or read sockets there). No network
port is opened. The server is optional: when it cannot start (a planted directory, a path too long for
AF_UNIX, ...) supermem says so once on stderr and the program goes on without `supermem top`.
Each connection's peer uid is read with SO_PEERCRED and anyone but this process's
user is refused, so even a socket made reachable by mistake serves nobody else.

Protocol: the client sends one line ("snapshot\\n"); the server answers one JSON object and closes:
    {"pid", "rank", "world_size", "argv", "time_unix_s", "providers": {name: provider() or {"error": "..."}}}
Providers are plain functions returning JSON-able dicts, registered by the parts that own the data:
    control.register_provider("allocator", control.allocator_provider())   # allocated/reserved/limit
    control.register_provider("pool", pool.status)      # entries_by_state, host_bytes, link rates
    (the trace recorder registers "trace"; supermem.trace.oom.note_oom registers "ooms")
One thread serves every connection as it becomes readable or writable (a selector), and each has
REQUEST_S for its whole exchange, so a client that stalls, or sends a byte at a time, delays nobody
else and is dropped at its deadline; past MAX_CLIENTS open connections the oldest is dropped.
Providers run on that thread, so they must be thread-safe (the allocator's stats are).
A forked child owns nothing of its parent's server: it neither answers on it nor removes it at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import registry
from .log import logger

Provider = Callable[[], dict[str, Any]]

_providers: dict[str, Provider] = {}
_server: ControlServer | None = None
_failed: str | None = None  # why the server could not start (said once; not retried)
_lock = threading.Lock()
MAX_CLIENTS = 64  # connections open at once; a new one past it drops the one open longest
REQUEST_S = 2.0  # a connection's whole exchange (its request line, our answer) ends within this
_started_unix_s = time.time()
REQUEST = b"snapshot\n"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def register_provider(name: str, fn: Provider) -> None:
    """Adds (or replaces) a section of what `supermem top` shows."""
    _providers[name] = fn


def unregister_provider(name: str) -> None:
    _providers.pop(name, None)


def collect() -> dict[str, Any]:
    """What the server answers: every provider's dict (an error entry for one that fails)."""
    out: dict[str, Any] = {}
    for name, fn in list(_providers.items()):
        try:
            out[name] = fn()
        except Exception as e:  # one broken provider must not blank the whole view
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    from . import distributed

    return {
        "pid": os.getpid(),
        **distributed.info(),  # each rank serves its own socket (one per process): top tells them apart
        "argv": list(sys.argv),
        "time_unix_s": time.time(),
        "providers": out,
    }


def process_status() -> dict[str, Any]:
    """The built-in "process" provider."""
    d: dict[str, Any] = {"uptime_s": time.time() - _started_unix_s, "threads": threading.active_count()}
    try:
        import psutil

        p = psutil.Process()
        d["rss_bytes"] = p.memory_info().rss
        d["cpu_percent"] = p.cpu_percent(interval=None)
    except Exception:
        pass
    return d


def allocator_provider(allocators: list[Any] | None = None) -> Provider:
    """A provider of allocated/reserved/limit per device: for the given (device, CachingAllocator)
    pairs, or every allocator supermem.trace can discover."""

    def provide() -> dict[str, Any]:
        pairs = registry.allocators() if allocators is None else allocators
        devices = []
        for device, a in pairs:
            s = a.stats()
            devices.append(
                {
                    "device": device,
                    "name": a.device.name,
                    "total_bytes": a.device.total_bytes,
                    "limit_bytes": a.limit_bytes,
                    "allocated_bytes": s["allocated_bytes"],
                    "reserved_bytes": s["reserved_bytes"],
                    "allocated_bytes_peak": s["allocated_bytes_peak"],
                    "reserved_bytes_peak": s["reserved_bytes_peak"],
                    "num_ooms": s["num_ooms"],
                    "fragmentation": s["fragmentation"],
                }
            )
        return {"devices": devices}

    return provide


# ---------------------------------------------------------------- where sockets live


def socket_dir() -> Path:
    """The per-user directory of control sockets (not created here)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return Path(xdg) / "supermem"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / f"supermem-{os.getuid()}"


def private_dir(path: Path | None = None) -> Path:
    """`path` (default socket_dir()) as a directory only this user can enter: created 0700 if absent;
    PermissionError if it is a symlink, not a directory, someone else's, or open to group/others."""
    path = path or socket_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return checked_private(path)


def checked_private(path: Path) -> Path:
    """`path` if it is a plain directory of this user closed to others, else PermissionError: a client
    (`supermem top`) reads sockets only from such a directory, as the server writes them only there."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a plain directory: supermem will not put its socket there")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}: refusing to use it")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); make it 0700 or remove it"
        )
    return path


def socket_path(pid: int | None = None) -> Path:
    return socket_dir() / f"{os.getpid() if pid is None else pid}.sock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_sockets() -> list[tuple[int, Path]]:
    """(pid, socket) of running supermem processes of this user, most recent first; stale sockets
    (their process is gone) are removed."""
    out = []
    try:
        entries = list(checked_private(socket_dir()).glob("*.sock"))
    except FileNotFoundError:
        return []
    for p in entries:
        try:
            pid = int(p.stem)
        except ValueError:
            continue
        if _alive(pid):
            out.append((p.stat().st_mtime, pid, p))
        else:
            try:
                p.unlink()
            except OSError:
                pass
    return [(pid, p) for _, pid, p in sorted(out, reverse=True)]


# ---------------------------------------------------------------- server and client


class ControlServer:
    """Serves collect() on a unix socket to clients of uid `allowed_uid` (default: this user)."""

    def __init__(self, path: Path | None = None, allowed_uid: int | None = None):
        self.path = Path(path) if path else socket_path()
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self.refused = 0
        self.served = 0
        self._sock: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # stop() ends the select through it
        self._thread: threading.Thread | None = None

    def start(self) -> ControlServer:
        if self.path.parent == socket_dir():
            private_dir(self.path.parent)
        try:
            self.path.unlink()  # a stale socket of a dead process that had our pid
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is born 0600: no window where others could connect
        try:
            s.bind(str(self.path))
            s.listen(8)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        self._sock, self._wake = s, socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="supermem-control", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        sock, wake = self._sock, self._wake
        if sock is None or wake is None:
            return
        with selectors.DefaultSelector() as sel, wake[0], wake[1]:
            try:
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ)
                sel.register(wake[0], selectors.EVENT_READ)
            except (OSError, ValueError):  # stop() closed it before this thread ran
                return
            clients: dict[socket.socket, _Client] = {}  # oldest first
            try:
                while self._sock is sock:
                    wait_s = min((c.deadline for c in clients.values()), default=None)
                    if wait_s is not None:
                        wait_s = max(0.0, wait_s - time.monotonic())
                    for key, _ in sel.select(wait_s):
                        if key.fileobj is sock:
                            if not self._accept(sock, sel, clients):
                                return  # closed by stop()
                        elif key.fileobj in clients:
                            self._step(clients[key.fileobj], sel, clients)
                    now = time.monotonic()
                    for c in [c for c in clients.values() if c.deadline <= now]:
                        _drop(c, sel, clients)  # stalled past its deadline
            finally:
                for c in list(clients.values()):
                    _drop(c, sel, clients)

    def _accept(self, sock: socket.socket, sel: selectors.BaseSelector, clients: dict) -> bool:
        """Takes every pending connection; False when the listening socket is closed."""
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if len(clients) >= MAX_CLIENTS:
                _drop(next(iter(clients.values())), sel, clients)
            try:
                conn.setblocking(False)
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            except OSError:  # gone already
                conn.close()
                continue
            clients[conn] = _Client(conn, _CRED.unpack(cred)[1], time.monotonic() + REQUEST_S)
            sel.register(conn, selectors.EVENT_READ)

    def _step(self, c: _Client, sel: selectors.BaseSelector, clients: dict) -> None:
        """Reads the request (even when refusing: closing on unread data resets the connection), then
        writes the answer, as far as the socket takes them now."""
        try:
            if c.answer is None:
                chunk = c.conn.recv(256)
                c.request += chunk
                if chunk and not c.request.endswith(b"\n") and len(c.request) < 256:
                    return
                c.answer = self._answer(c.uid, c.request)
                sel.modify(c.conn, selectors.EVENT_WRITE)
            c.answer = c.answer[c.conn.send(c.answer) :]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the client went away
            _drop(c, sel, clients)
            return
        if not c.answer:
            _drop(c, sel, clients)

    def _answer(self, uid: int, req: bytes) -> bytes:
        if uid != self.allowed_uid:
            self.refused += 1
            return json.dumps({"error": f"refused: uid {uid} is not the owner"}).encode() + b"\n"
        if req != REQUEST:
            return json.dumps({"error": f"unknown request {req[:40]!r}"}).encode() + b"\n"
        self.served += 1
        return json.dumps(collect(), default=str).encode() + b"\n"

    def stop(self) -> None:
        """Ends the serving thread, then closes the socket: closed under a thread still setting up
        (a process that exits right after starting the server), it raised in that thread."""
        s, self._sock = self._sock, None
        if self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except OSError:  # the serving thread has ended and closed it
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        try:
            self.path.unlink()
        except (FileNotFoundError, TypeError):
            pass


class _Client:
    """One connection being served: its request so far, then what is left of its answer."""

    __slots__ = ("conn", "uid", "deadline", "request", "answer")

    def __init__(self, conn: socket.socket, uid: int, deadline: float):
        self.conn, self.uid, self.deadline = conn, uid, deadline
        self.request = b""
        self.answer: bytes | None = None


def _drop(c: _Client, sel: selectors.BaseSelector, clients: dict) -> None:
    clients.pop(c.conn, None)
    try:
        sel.unregister(c.conn)
    except (KeyError, ValueError):
        pass
    c.conn.close()


def start_server(allowed_uid: int | None = None) -> ControlServer | None:
    """Starts this process's control server once (idempotent); it stops at exit. None when it cannot
    start: the reason goes to stderr once and the program goes on without `supermem top`."""
    global _server, _failed
    with _lock:
        if _server is None and _failed is None:
            register_provider("process", process_status)
            try:
                _server = ControlServer(allowed_uid=allowed_uid).start()
            except OSError as e:  # PermissionError from private_dir, "AF_UNIX path too long", ...
                _failed = str(e)
                logger.warning("supermem: `supermem top` is off for this process: %s", e)
        return _server


def stop_server() -> None:
    global _server
    with _lock:
        if _server is not None:
            _server.stop()
            _server = None


def _forget_server_in_child() -> None:
    """After fork: the socket and its path belong to the parent. Close our copy of the descriptor
    (no shutdown: that would stop the parent's socket too) and start afresh if asked."""
    global _server, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _server is not None and _server._sock is not None:
        _server._sock.close()
        for end in _server._wake or ():
            end.close()
    _server = None


atexit.register(stop_server)
os.register_at_fork(after_in_child=_forget_server_in_child)


def query(path: Path, timeout_s: float = 3.0) -> dict[str, Any]:
    """One snapshot from the server at `path`. PermissionError if it refuses us."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        try:
            s.sendall(REQUEST)
        except OSError:
            pass  # a refusing server may have closed already; its answer is still readable
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    try:
        out = json.loads(data)
    except ValueError:
        raise ConnectionError(f"{path}: the server sent no valid answer ({len(data)} bytes)") from None
    if "error" in out and "providers" not in out:
        if str(out["error"]).startswith("refused"):
            raise PermissionError(f"{path}: {out['error']}")
        raise ConnectionError(f"{path}: {out['error']}")
    return out
