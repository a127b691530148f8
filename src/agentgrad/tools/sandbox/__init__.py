"""A fast sandbox for model-written Python: a pool of warm fork servers (see docs/sandbox.md for what is and is
not isolated, on which machine).

* `_config.py`: `SandboxConfig` (limits, isolation) and `SandboxResult` (one call).
* `_pool.py`: the host side: `SandboxPool` (thread-safe, one server per slot), `sandbox_capabilities()`.
* `_lease.py`: uids leased per pool, unique machine-wide (a lock file per block).
* `_isolation.py`: what a server does once: network/IPC namespaces, the allow-list root (`pivot_root`).
* `_seccomp.py`: the syscall filter (libseccomp) for what namespaces do not cover: keyring, unix sockets.
* `_server.py`, `_exec.py`: the fork server and what runs per call.
* `_linux.py`: ctypes system calls and the host <-> server framing.

The server modules use only the standard library: they are loaded, without this `__init__`, into a fresh
`python -I` process.
"""

from agentgrad.tools.sandbox._config import ISOLATION_MODES, SandboxConfig, SandboxResult, SandboxUnavailableError
from agentgrad.tools.sandbox._lease import UidLeaseError
from agentgrad.tools.sandbox._linux import ENV_MARKER
from agentgrad.tools.sandbox._pool import SandboxPool, sandbox_capabilities

__all__ = ["ENV_MARKER", "ISOLATION_MODES", "SandboxConfig", "SandboxPool", "SandboxResult",
           "SandboxUnavailableError", "UidLeaseError", "sandbox_capabilities"]
