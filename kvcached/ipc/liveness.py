"""Whether the worker process behind a connection still exists, immune to pid reuse.

The coordinator learns a worker's pid from SO_PEERCRED when it connects. A bare
pid is not enough to say later that the worker died (the pid may belong to a
new process by then), so ``ProcessHandle`` pins that very process:

  pidfd (Linux >= 5.3)  ``os.pidfd_open``; it becomes readable once the process
                        has exited (also while it is an unreaped zombie), and it
                        can sit in the same poll() as the socket (``fd``).
  /proc start time      fallback where pidfd_open is missing or refused (old
                        kernels, seccomp): the process is gone when
                        /proc/<pid>/stat is, when it is a zombie, or when its
                        start time differs (the pid was reused).

Without either (not Linux) ``exited`` is always False: the coordinator then only
knows a death by the socket (EOF, refused) and waits out its timeouts as before.
A stopped (SIGSTOP) or busy process is alive: only exit counts.
"""

from __future__ import annotations

import os
import select
from typing import Optional


def _stat_fields(pid: int) -> Optional[list]:
    """Fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after its last ")".
    return data[data.rfind(b")") + 2 :].split()


def _start_time(pid: int) -> Optional[bytes]:
    fields = _stat_fields(pid)
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return fields[19]  # field 22, starttime in clock ticks since boot


class ProcessHandle:
    """One process, by pidfd or by (pid, start time). ``pid`` <= 0: not visible here."""

    def __init__(self, pid: int) -> None:
        self.pid = int(pid)
        self.fd: Optional[int] = None  # the pidfd, pollable; None on the /proc fallback
        self._start: Optional[bytes] = None
        self._gone = False
        if self.pid <= 0:  # SO_PEERCRED gives 0 for a process outside our pid namespace
            return
        try:
            self.fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError) as e:
            if isinstance(e, ProcessLookupError):
                self._gone = True
                return
            self._start = _start_time(self.pid)
            self._gone = self._start is None and os.path.isdir("/proc/self")

    @property
    def known(self) -> bool:
        """Whether ``exited`` can tell anything (False: pid not visible, no pidfd, no /proc)."""
        return self._gone or self.fd is not None or self._start is not None

    def exited(self) -> bool:
        """True once the process has ended. Never blocks."""
        if self._gone:
            return True
        if self.fd is not None:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            self._gone = bool(p.poll(0))
        elif self._start is not None:
            self._gone = _start_time(self.pid) != self._start
        return self._gone

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
