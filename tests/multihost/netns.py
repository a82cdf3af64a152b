"""Two hosts on one machine: a network namespace each, joined by a veth pair.

    host a: netns dt<pid>x<n>a, 192.0.2.1 <--- veth ---> 192.0.2.2, netns dt<pid>x<n>b: host b

Both hosts see the same filesystem, as cluster nodes sharing a network filesystem do, so
a run directory and a data cache can be shared. The link uses TEST-NET-1 (RFC 5737)
addresses and nothing else is routed: no traffic leaves the two namespaces. Names carry
the pid and a counter, so parallel runs do not clash. Needs root and iproute2;
:func:`netns_unavailable` says why a machine cannot run it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

# Linux retransmits unacknowledged data 15 times (about 15 minutes) before it fails a
# connection whose peer vanished. torch's rendezvous store client has no timeout of its
# own once a store wait has timed out (TCPStore::doWait sends CANCEL_WAIT, then recv()s
# with none), so the elastic agent of a host cut off from the store blocks that long.
# 5 retransmissions fail such a connection after 12.6 s. A per-namespace sysctl: the
# machine's own setting is untouched.
DEAD_PEER_TCP_RETRIES = 5

_pair_ids = itertools.count()


class NetnsUnavailable(Exception):
    """This machine cannot create network namespaces or veth pairs (the reason)."""


def netns_unavailable() -> str | None:
    """Why two namespaced hosts cannot be made here, or None if they may be."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, ["ip", *args], proc.stdout,
                                            proc.stderr)
    return proc


def _try_ip(*args: str) -> None:
    """An ip command whose failure means this machine lacks the privilege or support."""
    proc = _ip(*args, check=False)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


@dataclass(frozen=True, kw_only=True)
class Host:
    """One end of the link: its namespace, its veth end's name and its address."""

    netns: str
    ifname: str
    addr: str

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host's namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], **kwargs)

    def set_link(self, up: bool) -> None:
        _ip("-n", self.netns, "link", "set", self.ifname, "up" if up else "down")

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


class HostPair:
    """Hosts ``a`` (192.0.2.1) and ``b`` (192.0.2.2). :meth:`create` builds them;
    :meth:`destroy` removes them and ends every process left inside, whatever state
    :meth:`create` or the test reached."""

    def __init__(self) -> None:
        prefix = f"dt{os.getpid():x}x{next(_pair_ids)}"  # ifnames stay under 16 chars
        self.a = Host(netns=f"{prefix}a", ifname=f"{prefix}a", addr="192.0.2.1")
        self.b = Host(netns=f"{prefix}b", ifname=f"{prefix}b", addr="192.0.2.2")
        self._made: list[Host] = []

    def create(self) -> None:
        """Raises NetnsUnavailable where namespaces or veth pairs cannot be made."""
        for host in (self.a, self.b):
            _try_ip("netns", "add", host.netns)
            self._made.append(host)
        _try_ip("link", "add", self.a.ifname, "type", "veth", "peer", "name", self.b.ifname)
        for host in (self.a, self.b):
            self._configure(host)

    def _configure(self, host: Host) -> None:
        _ip("link", "set", host.ifname, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("-n", host.netns, "link", "set", host.ifname, "up")
        write = (f"open('/proc/sys/net/ipv4/tcp_retries2', 'w')"
                 f".write('{DEAD_PEER_TCP_RETRIES}')")
        subprocess.run(["ip", "netns", "exec", host.netns, sys.executable, "-c", write],
                       check=True, capture_output=True, timeout=30)

    def destroy(self) -> None:
        for host in self._made:
            self._end_processes(host)
            _ip("netns", "delete", host.netns, check=False)  # takes its veth end along
        self._made.clear()
        for host in (self.a, self.b):  # a veth end that never reached its namespace
            if _ip("link", "show", host.ifname, check=False).returncode == 0:
                _ip("link", "delete", host.ifname, check=False)

    @staticmethod
    def _end_processes(host: Host, wait_s: float = 10.0) -> None:
        # only processes a test started run inside these namespaces; a torch worker
        # lives in its own session, so a process group kill would miss it
        for pid in host.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
