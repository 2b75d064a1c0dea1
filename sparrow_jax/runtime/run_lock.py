"""One trainer per run directory: an exclusive lock held for the whole run.

Two `sparrow train` processes on one `run_dir` overwrite each other: both write every step's
checkpoint, the second replaces `metrics.jsonl` while the first keeps appending to the unlinked
file, and one deletes the other's in-flight checkpoint temp directory. So process 0 of a run takes
`run_dir/sparrow.lock` before anything heavy loads, and a second trainer stops at once with a
message naming the holder.

Mechanism: an advisory `fcntl.flock` on the run directory itself, held through an open file
descriptor, and one on the lock file (the kernel drops both when the holder dies, even by
SIGKILL, so a crashed run never blocks the next one); the holder's host, pid and start time are
written into the file for the message. The directory lock is what holds: a lock file deleted by
hand is only a new inode to the next process, which would lock it freely, but the directory's
inode stays (issue #45: two trainers then both ran and interleaved `metrics.jsonl`). The file is
never deleted by sparrow: on release it is emptied. A non-empty lock file found unlocked is a
stale lock left by a process that died; it is taken over with a warning (on the same host the
dead pid is confirmed).

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
        self._dir_fd: int | None = None

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
        dir_fd = self._lock_directory()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if dir_fd == -1:        # the directory is locked by another trainer
                raise BlockingIOError
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            if dir_fd not in (None, -1):
                os.close(dir_fd)
            who = _describe(holder) if holder else "holder unknown: its lock file was deleted"
            raise RunError(
                f"run directory {self.run_dir} is in use by another sparrow train ({who}; "
                f"lock file {self.path}). "
                f"Two trainers on one run directory overwrite each other's checkpoints and "
                f"metrics: wait for it to finish, stop it, or use another TrainConfig.run_dir."
            ) from None
        except OSError as e:
            # A file system without locks (some FUSE mounts): training there must stay possible.
            os.close(fd)
            if dir_fd not in (None, -1):
                os.close(dir_fd)
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
        self._fd, self._dir_fd = fd, dir_fd
        return self

    def _lock_directory(self) -> int | None:
        """The run directory's descriptor, locked; -1 when another process holds it; None
        where directories cannot be locked (the lock file alone then, as before)."""
        try:
            dir_fd = os.open(self.run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            log.debug("cannot open %s for locking: %s", self.run_dir, e)
            return None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(dir_fd)
            return -1
        except OSError as e:       # e.g. NFS: flock on a read-only descriptor
            os.close(dir_fd)
            log.debug("cannot lock the directory %s: %s", self.run_dir, e)
            return None
        return dir_fd

    def release(self) -> None:
        """Empties the lock file (a clean exit leaves no stale holder) and unlocks it."""
        fd, self._fd = self._fd, None
        dir_fd, self._dir_fd = self._dir_fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            log.debug("could not empty %s", self.path, exc_info=True)
        finally:
            os.close(fd)     # drops the flock
            if dir_fd is not None:
                os.close(dir_fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
