"""The holes an attacker found in the privileged (root, namespaces) sandbox, each asserted closed, in real pools:
SysV IPC, uids shared between pools, unix sockets bound to host paths, a deny-list filesystem, the per-uid
keyring; then 1,000 calls back to back, counting what they leave behind. And what the unprivileged (userns) mode
holds. Each test says what the machine must give; without it the test skips (CI runs as root and gives it all).
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_sandbox import _processes_of_uids, _processes_with_token, leftovers

from agentgrad.tools.sandbox import SandboxConfig, SandboxPool

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the privileged (namespaces) mode needs root")]

IPC_CREAT, IPC_RMID, SHM_RDONLY = 0o1000, 0, 0o10000
KEY_SPEC_USER_KEYRING = -4
# (add_key, request_key) syscall numbers: glibc has no wrappers (they live in libkeyutils)
_KEY_SYSCALLS = {"x86_64": (248, 249), "aarch64": (217, 218)}
ADD_KEY, REQUEST_KEY = _KEY_SYSCALLS.get(os.uname().machine, (-1, -1))


def run_ok(pool: SandboxPool, code: str, timeout_s: float = 5.0) -> str:
    r = pool.run(code, timeout_s=timeout_s)
    assert r.ok, r
    return r.stdout


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(SandboxConfig(timeout_s=5.0, memory_mb=512, max_procs=16), size=1) as p:
        caps = p.capabilities()
        if caps["mode"] != "namespaces":
            pytest.skip(f"no namespaces here: {caps['warnings']}")
        yield p


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    return libc


def _ipc_ids(kind: str) -> list[str]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return [line.split()[1] for line in f.readlines()[1:]]


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


# ---- 1. IPC ---------------------------------------------------------------------------------------------------


def test_host_shared_memory_is_invisible(pool):
    libc, secret, key = _libc(), uuid.uuid4().hex.encode(), 0x4A6E0000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, IPC_CREAT | 0o644)
    assert shmid >= 0
    try:
        addr = libc.shmat(shmid, None, 0)
        ctypes.memmove(addr, secret, len(secret))
        libc.shmdt(ctypes.c_void_p(addr))
        code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
                f"print(open('/proc/sysvipc/shm').read().count('\\n') - 1, libc.shmget({key}, 0, 0),"
                f" libc.shmat({shmid}, None, {SHM_RDONLY}))")
        out = run_ok(pool, code).split()
        assert out == ["0", "-1", str(2**64 - 1)], out  # no segment listed, the key unknown, shmat(id) fails
    finally:
        libc.shmctl(shmid, IPC_RMID, None)


def test_shared_memory_dies_with_the_call(pool):
    """Five detached 32 MiB segments, touched, never removed: gone when the call returns (the call's IPC
    namespace goes with its last process), and the next call on the same server starts with none."""
    before = _shmem_kib()
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "libc.shmdt.argtypes = [ctypes.c_void_p]\n"
            "for i in range(5):\n"
            f"    sid = libc.shmget(0, 32 << 20, {IPC_CREAT} | 0o600)\n"
            "    addr = libc.shmat(sid, None, 0)\n"
            "    ctypes.memset(addr, 1, 32 << 20)\n"
            "    libc.shmdt(ctypes.c_void_p(addr))\n"
            "print(open('/proc/sysvipc/shm').read().count('\\n') - 1)")
    assert run_ok(pool, code, timeout_s=30.0).strip() == "5"
    assert run_ok(pool, "print(open('/proc/sysvipc/shm').read().count('\\n') - 1)").strip() == "0"
    for _ in range(50):  # freeing is deferred to a kernel worker
        if _shmem_kib() - before < 80 * 1024:
            break
        time.sleep(0.1)
    assert _shmem_kib() - before < 80 * 1024, "160 MiB of shared memory outlived the call"


# ---- 2. uids --------------------------------------------------------------------------------------------------


def test_pools_lease_disjoint_uids_across_processes(pool):
    """Another process's pool (alive meanwhile) and a second pool here: three disjoint leases."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom agentgrad.tools.sandbox import SandboxPool\n"
         "p = SandboxPool(size=3)\nprint(*p.uids, flush=True)\nsys.stdin.read()\np.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = set(map(int, other.stdout.readline().split()))
        with SandboxPool(SandboxConfig(timeout_s=5.0), size=2) as second:
            mine, second_uids = set(pool.uids), set(second.uids)
            assert len(theirs) == 3 and len(second_uids) == 2
            assert not (mine & second_uids) and not (mine & theirs) and not (second_uids & theirs)
            assert run_ok(second, "import os\nprint(os.getuid())").strip() == str(second.uids[0])
    finally:
        other.communicate("", timeout=60)
    assert other.returncode == 0


def test_one_pool_cannot_touch_another_pools_process(pool):
    secret = uuid.uuid4().hex
    with SandboxPool(SandboxConfig(timeout_s=8.0), size=1) as victim:
        victim.warmup()
        t = threading.Thread(target=victim.run, args=(f"import time\nSECRET = {secret!r}\ntime.sleep(4)",))
        t.start()
        try:
            for _ in range(100):
                pids = _processes_of_uids({victim.uids[0]})
                if pids:
                    break
                time.sleep(0.05)
            assert pids, "the victim's call never started"
            code = (f"import os\nfor pid in {pids}:\n"
                    "    for what in ('environ', 'cmdline', 'mem'):\n"
                    "        try:\n"
                    "            print(open(f'/proc/{pid}/{what}', 'rb').read(4096))\n"
                    "        except OSError as exc:\n"
                    "            print(type(exc).__name__)\n"
                    "    try:\n"
                    "        os.kill(pid, 0)\n"
                    "        print('SIGNALABLE')\n"
                    "    except OSError as exc:\n"
                    "        print(type(exc).__name__)\n")
            out = run_ok(pool, code)
            assert secret not in out and "SIGNALABLE" not in out
            assert set(out.split()) <= {"FileNotFoundError", "ProcessLookupError"}, out
        finally:
            t.join()


def test_another_pools_process_limit_does_not_starve_this_one(pool):
    """A call holding every process its uid may have does not make another pool's fork fail."""
    with SandboxPool(SandboxConfig(timeout_s=8.0, max_procs=8), size=1) as hog:
        hog.warmup()
        code = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
                "        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    n += 1\n"
                "print(n, flush=True)\ntime.sleep(3)")
        t = threading.Thread(target=hog.run, args=(code,))
        t.start()
        try:
            time.sleep(1.0)
            out = run_ok(pool, "import os\nkids = [os.fork() for _ in range(4)]\n"
                               "[os._exit(0) for k in kids if k == 0]\n[os.waitpid(k, 0) for k in kids]\nprint('ok')")
            assert out.strip() == "ok"
        finally:
            t.join()


# ---- 3, 4. sockets and files of the host ------------------------------------------------------------------------


@pytest.fixture()
def host_dir():
    """A world-readable directory where a careless host keeps things (/var/lib, as in the report)."""
    path = Path("/var/lib") / f"agentgrad-sandbox-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def test_unix_socket_on_a_host_path_is_unreachable(host_dir):
    sock_path = host_dir / "service.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    os.chmod(sock_path, 0o777)
    listener.listen(1)
    listener.setblocking(False)
    code = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(sock_path)!r})\nprint('CONNECTED')")
    try:
        # Absent from the allow-list root, and refused by the syscall filter even where the path is visible.
        for extra in ((), (str(host_dir),)):
            with SandboxPool(SandboxConfig(timeout_s=5.0, readonly_paths=extra), size=1) as p:
                r = p.run(code)
                assert not r.ok and "CONNECTED" not in r.stdout
                assert "PermissionError" in r.stderr or "FileNotFoundError" in r.stderr, r.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_filesystem_is_an_allow_list(pool, host_dir):
    secret = uuid.uuid4().hex
    (host_dir / "data.txt").write_text(secret)
    os.chmod(host_dir / "data.txt", 0o644)
    r = pool.run(f"print(open({str(host_dir / 'data.txt')!r}).read())")
    assert not r.ok and secret not in r.stdout and "FileNotFoundError" in r.stderr
    top = set(run_ok(pool, "import os\nprint(*os.listdir('/'))").split())
    prefixes = {p.split("/")[1] for p in pool.capabilities()["visible_paths"]}
    assert top <= prefixes | {"dev", "proc", "tmp"}, top
    for absent in ("var", "sys", "home", "run", "srv", "mnt", "opt", "boot"):
        assert absent not in top or absent in prefixes
    with SandboxPool(SandboxConfig(timeout_s=5.0, readonly_paths=(str(host_dir),)), size=1) as p:
        assert run_ok(p, f"print(open({str(host_dir / 'data.txt')!r}).read())").strip() == secret
        r = p.run(f"open({str(host_dir / 'new.txt')!r}, 'w')")
        assert not r.ok and ("Read-only" in r.stderr or "PermissionError" in r.stderr), r.stderr
    assert not (host_dir / "new.txt").exists()


# ---- 5. keyring ------------------------------------------------------------------------------------------------

_ADD_KEY = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "ret = libc.syscall({nr}, b'user', b'agentgrad-test', {secret!r}, {size}, {ring})\n"
            "print(ret, os.strerror(ctypes.get_errno()) if ret < 0 else '')")


def _key_users() -> set[int]:
    with open("/proc/key-users") as f:
        return {int(line.split(":")[0]) for line in f if line.strip()}


@pytest.mark.skipif(ADD_KEY < 0, reason="keyring syscall numbers known for x86_64 and aarch64 only")
def test_keyring_is_refused_and_nothing_survives_the_call(pool):
    secret = uuid.uuid4().hex.encode()
    out = run_ok(pool, _ADD_KEY.format(nr=ADD_KEY, secret=secret, size=len(secret), ring=KEY_SPEC_USER_KEYRING))
    assert out.split()[0] == "-1" and "not permitted" in out, out
    r = pool.run("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 f"print(libc.syscall({REQUEST_KEY}, b'user', b'agentgrad-test', None, 0))")
    assert r.stdout.split() == ["-1"] and secret.decode() not in r.stdout
    assert not _key_users() & set(pool.uids)


# ---- back to back ----------------------------------------------------------------------------------------------


def test_a_thousand_calls_leave_no_ipc_object_process_or_key():
    host_ipc = {kind: _ipc_ids(kind) for kind in ("shm", "sem", "msg")}
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"libc.shmget(0, 4096, {IPC_CREAT} | 0o600)\nlibc.semget(0, 1, {IPC_CREAT} | 0o600)\n"
            f"libc.msgget(0, {IPC_CREAT} | 0o600)\n"
            f"libc.syscall({ADD_KEY}, b'user', b'k', b'v', 1, {KEY_SPEC_USER_KEYRING})\n"
            "if os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\n"
            "print(sum(open(f'/proc/sysvipc/{k}').read().count(chr(10)) - 1 for k in ('shm', 'sem', 'msg')))")
    with SandboxPool(SandboxConfig(timeout_s=5.0), size=1) as p:
        p.warmup()
        counts = [p.run(code).stdout.strip() for _ in range(1000)]
        assert counts == ["3"] * 1000  # each call starts with an empty IPC namespace (and leaves 3 in it)
        assert leftovers(p) == [] and _processes_of_uids(set(p.uids)) == []
        assert not _key_users() & set(p.uids)
    assert {kind: _ipc_ids(kind) for kind in ("shm", "sem", "msg")} == host_ipc
    assert _processes_with_token(p.token) == []


# ---- the unprivileged mode (forced as root) --------------------------------------------------------------------


def test_user_namespace_mode_closes_the_same_holes(host_dir):
    secret = uuid.uuid4().hex
    (host_dir / "data.txt").write_text(secret)
    with SandboxPool(SandboxConfig(timeout_s=5.0, isolation="userns"), size=1) as p:
        caps = p.capabilities()
        if caps["mode"] != "userns":
            pytest.skip(f"user namespaces unavailable: {caps['warnings']}")
        assert caps["ipc_isolated"] and caps["filesystem_isolated"] and caps["syscall_filter"]
        assert caps["proc"].startswith("this call's PID namespace")
        r = p.run(f"print(open({str(host_dir / 'data.txt')!r}).read())")
        assert "FileNotFoundError" in r.stderr and secret not in r.stdout
        assert run_ok(p, "print(open('/proc/sysvipc/shm').read().count('\\n') - 1)").strip() == "0"
        out = run_ok(p, _ADD_KEY.format(nr=ADD_KEY, secret=b"x", size=1, ring=KEY_SPEC_USER_KEYRING))
        assert out.split()[0] == "-1"
        r = p.run("import socket\nsocket.socket(socket.AF_UNIX)")
        assert "PermissionError" in r.stderr
        out = run_ok(p, "import os\nprint(sorted(int(x) for x in os.listdir('/proc') if x.isdigit()))")
        assert out.strip() == "[1, 2]", out  # the call's init and the code itself: nothing of other calls
