"""One trainer per run directory: an exclusive lock held for the whole run.

Two `sparrow train` processes on one `run_dir` overwrite each other: both write every step's
checkpoint, the second replaces `metrics.jsonl` while the first keeps appending to the unlinked
file, and one deletes the other's in-flight checkpoint temp directory. So process 0 of a run takes
`run_dir/sparrow.lock` before anything heavy loads, and a second trainer stops at once with a
message naming the holder.

Mechanism: an advisory `fcntl.flock` on the lock file (the kernel drops it when the holder dies,
even by SIGKILL, so a crashed run never blocks the next one), and the holder's host, pid and
start time written into the file for the message. The file is never deleted (deleting it would
let a waiting process lock the old inode while a new one locks a new file): on release it is
emptied. A non-empty lock file found unlocked is a stale lock left by a process that died; it is
taken over with a warning (on the same host the dead pid is confirmed).

Run directories on object storage (`gs://...`) have no locks; the lock is skipped there, and on
a file system that refuses `flock` (some FUSE mounts) with a warning.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from typing import Any

from sparrow_jax.runtime.faults import RunError
from sparrow_jax.runtime.run_files import is_uri

log = logging.getLogger(__name__)

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = "sparrow.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, another user's
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
            f"{holder.get('started', '?')}")


class RunLock:
    """The exclusive lock of a local run directory; ``acquire()`` raises RunError naming the
    holder when another process has it. Use as a context manager or call ``release()``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self._fd: int | None = None

    def _read(self, fd: int) -> dict[str, Any]:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
        if not raw:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            return {"host": "?", "pid": "?", "started": f"? (unreadable lock file: {raw[:80]!r})"}
        return data if isinstance(data, dict) else {}

    def acquire(self) -> "RunLock":
        if is_uri(self.run_dir) or self._fd is not None:
            return self
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            raise RunError(
                f"run directory {self.run_dir} is in use by another sparrow train ("
                f"{_describe(holder) if holder else 'holder unknown'}; lock file {self.path}). "
                f"Two trainers on one run directory overwrite each other's checkpoints and "
                f"metrics: wait for it to finish, stop it, or use another TrainConfig.run_dir."
            ) from None
        except OSError as e:
            # A file system without locks (some FUSE mounts): training there must stay possible.
            os.close(fd)
            log.warning("cannot lock run directory %s (%s): its file system does not support "
                        "locks, so a second trainer on it would not be detected", self.run_dir,
                        e.strerror or e)
            return self
        previous = self._read(fd)
        if previous:
            same_host = previous.get("host") == socket.gethostname()
            pid = previous.get("pid")
            dead = (" (that process is gone)" if same_host and isinstance(pid, int)
                    and not _pid_alive(pid) else "")
            log.warning("run directory %s: taking over the stale lock of a trainer that did not "
                        "release it (%s)%s", self.run_dir, _describe(previous), dead)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Empties the lock file (a clean exit leaves no stale holder) and unlocks it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            log.debug("could not empty %s", self.path, exc_info=True)
        finally:
            os.close(fd)     # drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
