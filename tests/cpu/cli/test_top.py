"""`supermem top` against a live CPU process, and the control socket's access rules."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from supermem import cli, control
from supermem import top as top_module
from supermem.units import format_bytes

CHILD = textwrap.dedent(
    """
    import json, sys
    from supermem import cli, control
    from supermem.allocator import CachingAllocator, SimulatedDevice
    from supermem.trace import oom
    a = CachingAllocator(SimulatedDevice("4GiB"), limit_bytes="1GiB")
    blocks = [a.malloc(1 << 20) for _ in range(3)] + [a.malloc(12 << 20)]
    control.register_provider("allocator", control.allocator_provider([(0, a)]))
    control.register_provider("pool", lambda: {
        "entries_by_state": {"resident": 5, "on_host": 2}, "bytes_by_state": {"on_host": 3 << 20},
        "host_bytes": 3 << 20, "host_limit_bytes": 1 << 30,
        "link": {"d2h_bytes_per_s": 12.5e9, "h2d_bytes_per_s": 11e9}})
    oom.note_oom(0, 2 << 30, "CUDA out of memory. (test)")
    srv = control.start_server()
    print(json.dumps({"socket": str(srv.path), **a.stats()}), flush=True)
    sys.stdin.read()  # live until the test closes our stdin
    """
)


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("xdg")
    os.chmod(d, 0o700)
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_RUNTIME_DIR", str(d))  # our own socket directory: other sessions' sockets stay out
    yield d
    mp.undo()


def start_child():
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return p, json.loads(p.stdout.readline())


def stop_child(p):
    if p.poll() is None:
        p.stdin.close()
        p.wait(timeout=30)


@pytest.fixture(scope="module")
def child(runtime_dir):
    p, info = start_child()
    yield p, info
    stop_child(p)


def top(*args):
    return subprocess.run(
        [sys.executable, "-m", "supermem", "top", *args], capture_output=True, text=True, timeout=60
    )


def top_here(capsys, *args):
    """`supermem top` in this process (the client side; the server is the child)."""
    rc = cli.main(["top", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_top_shows_a_live_process(child, runtime_dir):
    p, info = child
    r = top(str(p.pid), "--once")  # once as a real command
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"pid {p.pid}" in out
    dev = next(line for line in out.splitlines() if line.startswith("0 sim"))
    assert format_bytes(info["allocated_bytes"]) in dev and info["allocated_bytes"] == 15 << 20
    assert format_bytes(info["reserved_bytes"]) in dev
    assert "1.00 GiB" in dev  # the limit
    assert "resident 5" in out and "on_host 2 (3.00 MiB)" in out
    assert "3.00 MiB on host of 1.00 GiB" in out
    assert "d2h 12.5 GB/s" in out and "h2d 11.0 GB/s" in out
    assert "OOMS    1" in out and "asked 2.00 GiB" in out
    # the socket is private: its directory 0700, the socket 0600, both ours
    sock = info["socket"]
    assert os.path.dirname(sock) == str(runtime_dir / "supermem")
    assert os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
    assert os.stat(sock).st_mode & 0o777 == 0o600


def test_top_without_pid_finds_the_process_and_json_has_every_provider(child, capsys):
    p, _ = child
    rc, out, err = top_here(capsys, "--once")
    assert rc == 0 and f"pid {p.pid}" in out, err
    rc, out, _ = top_here(capsys, "--json")
    snap = json.loads(out)
    assert snap["pid"] == p.pid
    assert set(snap["providers"]) == {"process", "allocator", "pool", "ooms"}
    assert snap["providers"]["process"]["rss_bytes"] > 0


def test_live_mode_redraws_until_interrupted(child):
    p, _ = child
    q = subprocess.Popen(
        [sys.executable, "-m", "supermem", "top", str(p.pid), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    first = ""  # its first frame, before Ctrl-C (one at start-up, on a loaded machine, could be lost there)
    while f"pid {p.pid}" not in first:
        line = q.stdout.readline()
        if not line:
            break
        first += line
    time.sleep(0.5)  # more frames
    q.send_signal(2)  # Ctrl-C
    out, _ = q.communicate(timeout=30)
    out = first + out
    assert q.returncode == 0
    assert out.count("\x1b[H\x1b[2J") >= 2 and out.count(f"pid {p.pid}") >= 2


def test_socket_goes_away_with_the_process(runtime_dir, child, capsys):
    p, info = start_child()  # a second process: the most recent one is the default
    rc, out, _ = top_here(capsys, "--once")
    assert rc == 0 and f"pid {p.pid}" in out
    stop_child(p)
    assert not os.path.exists(info["socket"])
    rc, _, err = top_here(capsys, str(p.pid), "--once")
    assert rc == 2 and "no supermem control socket" in err
    other, _ = child
    stop_child(other)
    rc, _, err = top_here(capsys, "--once")
    assert rc == 2 and "no running supermem process" in err


def test_other_users_are_refused(tmp_path):
    srv = control.ControlServer(tmp_path / "t.sock", allowed_uid=os.getuid() + 1).start()
    try:
        with pytest.raises(PermissionError, match="refused"):
            control.query(srv.path)
        assert srv.refused == 1 and srv.served == 0
    finally:
        srv.stop()
    srv = control.ControlServer(tmp_path / "u.sock").start()
    try:
        assert control.query(srv.path)["pid"] == os.getpid()
        with socket.socket(socket.AF_UNIX) as s:  # a request that is not the protocol's
            s.connect(str(srv.path))
            s.sendall(b"GET / HTTP/1.0\n")
            assert b"unknown request" in s.recv(1000)
    finally:
        srv.stop()


def test_a_server_stopped_as_soon_as_it_starts_ends_quietly(tmp_path, monkeypatch):
    """A program that starts the server and exits at once stops it at exit, maybe before its thread
    ran: that thread must neither raise nor outlive stop()."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    for i in range(200):
        srv = control.ControlServer(tmp_path / f"q{i}.sock").start()
        srv.stop()
        assert not srv._thread.is_alive() and not srv.path.exists()
    assert raised == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_real_other_user_is_refused_by_peer_credentials():
    d = Path(tempfile.mkdtemp(prefix="supermem-test-"))  # under /tmp, reachable by "nobody"
    os.chmod(d, 0o755)
    srv = control.ControlServer(d / "s.sock").start()
    os.chmod(srv.path, 0o666)  # as if the file mode had been got wrong: the uid check must still hold
    try:
        pid = os.fork()
        if pid == 0:  # the child becomes user "nobody" and asks
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                control.query(srv.path)
                code = 1  # answered: the check failed
            except PermissionError as e:
                code = 0 if "refused: uid 65534" in str(e) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert srv.refused == 1 and srv.served == 0
    finally:
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)


def test_socket_directory_must_be_private(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        control.private_dir(d)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="not a plain directory"):
        control.private_dir(link)
    fresh = control.private_dir(tmp_path / "fresh")
    assert os.stat(fresh).st_mode & 0o777 == 0o700


def test_a_failing_provider_does_not_blank_the_view():
    control.register_provider("broken", lambda: 1 / 0)
    try:
        snap = control.collect()
        assert snap["providers"]["broken"] == {"error": "ZeroDivisionError: division by zero"}
    finally:
        control.unregister_provider("broken")


def test_render_shows_every_section():
    snap = {
        "pid": 42,
        "argv": ["train.py"],
        "time_unix_s": 0,
        "providers": {
            "trace": {"recording_s": 12, "devices": [0], "pool_events": 7, "dropped_events": 0},
            "mystery": {"x": 1},
        },
    }
    text = top_module.render(snap)
    assert "pid 42  train.py" in text
    assert "no provider (supermem's allocator is not installed" in text
    assert "TRACE   recording 12s, devices [0], pool events 7, dropped 0" in text
    assert 'MYSTERY {"x": 1}' in text and "OOMS    0" in text


def test_render_shows_fragmentation_at_the_peak_and_expandable_segments():
    device = {"device": 0, "name": "sim", "total_bytes": 1 << 30, "limit_bytes": 0, "allocated_bytes": 0}
    device.update(reserved_bytes=6 << 20, reserved_bytes_peak=21 << 20, peak_unallocated_bytes=1 << 20)
    device.update(peak_reserved_ratio=1.05, expandable_segments=True, address_space_bytes=9 << 30)
    text = top_module.render({"pid": 1, "providers": {"allocator": {"devices": [device]}}})
    assert "unallocated at peak 1.00 MiB (reserved / allocated 1.050)" in text
    assert "expandable: 6.00 MiB mapped in 9.00 GiB of address space" in text


# ---------------------------------------------------------------- the server is optional (issue 8.10, 8.13)


@pytest.fixture
def fresh_server(tmp_path, monkeypatch):
    """No server yet, sockets under tmp_path/tmp (as TMPDIR would give) and the failure not yet said."""
    control.stop_server()
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(control, "_failed", None)
    yield tmp_path / "tmp" / f"supermem-{os.getuid()}"
    control.stop_server()


def _plant(kind: str, where: Path) -> None:
    if kind == "mode 777":
        where.mkdir()
        os.chmod(where, 0o777)
    elif kind == "symlink":
        (where.parent / "elsewhere").mkdir(mode=0o700)
        where.symlink_to(where.parent / "elsewhere")
    elif kind == "file":
        where.write_text("")
    elif kind == "other owner":
        if os.getuid() != 0:
            pytest.skip("needs root to make a directory another user's")
        where.mkdir(mode=0o700)
        os.chown(where, 65534, 65534)


PLANTED = ["mode 777", "symlink", "file", "other owner"]


@pytest.mark.parametrize("kind", PLANTED)
def test_a_planted_socket_directory_turns_the_server_off_with_one_warning(kind, fresh_server, caplog):
    _plant(kind, fresh_server)
    assert control.start_server() is None and control.start_server() is None
    said = [r.getMessage() for r in caplog.records if r.name == "supermem" and r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith("supermem: `supermem top` is off"), said
    assert str(fresh_server) in said[0] and "Traceback" not in caplog.text


def test_a_socket_path_too_long_for_af_unix_turns_the_server_off(fresh_server, monkeypatch, caplog):
    deep = fresh_server.parent / ("d" * 200)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert control.start_server() is None
    assert "supermem: `supermem top` is off" in caplog.text


@pytest.mark.parametrize("kind", [*PLANTED, "long TMPDIR"])
def test_pool_install_and_import_torch_go_on_without_the_server(kind, tmp_path):
    tmp = tmp_path / ("d" * 200 if kind == "long TMPDIR" else "tmp")
    tmp.mkdir()
    if kind != "long TMPDIR":
        _plant(kind, tmp / f"supermem-{os.getuid()}")
    code = textwrap.dedent(
        """
        import supermem
        supermem.install()
        import torch
        p = supermem.pool(budget="1GiB")
        x = torch.ones(1000, requires_grad=True)
        with p:
            (x * x).sum().backward()
        print("ok", float(x.grad.sum()))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPERMEM", "XDG_RUNTIME_DIR"))}
    env.update(TMPDIR=str(tmp), SUPERMEM="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "2000.0"], r.stderr
    assert r.stderr.count("`supermem top` is off") == 1, r.stderr


def test_a_slow_client_does_not_block_others(tmp_path):
    srv = control.ControlServer(tmp_path / "s.sock").start()
    silent = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    try:
        for s in silent:  # connect and never send: the server must not wait on them in turn
            s.connect(str(srv.path))
        t0 = time.monotonic()
        assert control.query(srv.path, timeout_s=1.0)["pid"] == os.getpid()
        assert time.monotonic() - t0 < 1.0
    finally:
        for s in silent:
            s.close()
        srv.stop()


def test_clients_sending_a_byte_at_a_time_neither_block_top_nor_stay(tmp_path):
    """Ten slow clients of this user, a byte each every 1.5 s (under a per-byte timeout of 2 s): `top`
    is answered at once all along, and each slow one is dropped once its whole exchange passes
    REQUEST_S (before: they took all 8 slots and top's connection was reset)."""
    srv = control.ControlServer(tmp_path / "s.sock").start()
    slow = [socket.socket(socket.AF_UNIX) for _ in range(10)]
    try:
        for s in slow:
            s.connect(str(srv.path))
            s.settimeout(0.05)
        t0 = time.monotonic()
        dropped_s: dict[int, float] = {}
        while time.monotonic() - t0 < control.REQUEST_S + 2.5:
            for i, s in enumerate(slow):
                if i in dropped_s:
                    continue
                try:
                    s.send(b"s")
                    if s.recv(100) == b"":
                        dropped_s[i] = time.monotonic() - t0
                except TimeoutError:
                    pass
                except OSError:  # reset: the server closed on our unread byte
                    dropped_s[i] = time.monotonic() - t0
            t = time.monotonic()
            assert control.query(srv.path, timeout_s=1.0)["pid"] == os.getpid()
            assert time.monotonic() - t < 0.5
            time.sleep(1.5)
        assert len(dropped_s) == len(slow)
        assert all(control.REQUEST_S - 0.5 < s < control.REQUEST_S + 2.5 for s in dropped_s.values()), (
            dropped_s
        )
    finally:
        for s in slow:
            s.close()
        srv.stop()


def test_past_max_clients_the_oldest_connection_makes_room(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "MAX_CLIENTS", 4)
    srv = control.ControlServer(tmp_path / "m.sock").start()
    silent = [socket.socket(socket.AF_UNIX) for _ in range(6)]
    try:
        for s in silent:
            s.connect(str(srv.path))
            time.sleep(0.05)  # accepted one by one, oldest first
        assert control.query(srv.path, timeout_s=1.0)["pid"] == os.getpid()
        silent[0].settimeout(1.0)
        assert silent[0].recv(100) == b""  # dropped to make room
        silent[-1].sendall(control.REQUEST)
        silent[-1].settimeout(1.0)
        assert b'"pid"' in silent[-1].recv(1 << 16)  # the newest is served
    finally:
        for s in silent:
            s.close()
        srv.stop()
    srv._thread.join(2.0)
    assert not srv._thread.is_alive()  # stop() ends the serving thread


def test_a_forked_child_leaves_the_parents_server_alone(tmp_path):
    code = textwrap.dedent(
        """
        import os, sys
        from supermem import control
        srv = control.start_server()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit handlers run in the child
        os.waitpid(pid, 0)
        print(srv.path.exists(), control.query(srv.path)["pid"] == os.getpid())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPERMEM", "XDG_RUNTIME_DIR"))}
    env["TMPDIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stdout + r.stderr


def test_top_reads_no_socket_from_a_directory_others_can_write(tmp_path, monkeypatch, capsys):
    """A directory open to other users may hold their sockets (and feed top their data): top refuses it,
    and removes nothing from it."""
    planted = tmp_path / "supermem"
    planted.mkdir()
    os.chmod(planted, 0o777)
    stale = planted / "999999999.sock"  # no such process: a private directory's stale socket is removed
    stale.write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    os.chmod(tmp_path, 0o700)
    assert cli.main(["top", "--once"]) == 2
    assert "open to other users" in capsys.readouterr().err
    assert stale.exists()
