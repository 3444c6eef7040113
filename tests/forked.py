"""A child process forked from the test's own process, for tests that need several processes
racing (saves killed mid-write, writers sharing a store) but not a fresh interpreter.

A new interpreter pays for importing torch, transformers and kvcache again (5-8 s on the 2-core
machines); a fork starts in milliseconds with everything imported. The child runs ``fn(*args)``
with its stdout and stderr on pipes, exits 0 (or 1 with the traceback on stderr, or a
``SystemExit``'s code) without running this process's exit handlers, and is used as a
``subprocess.Popen``: ``stdout``, ``communicate``, ``wait``, ``send_signal``, ``returncode``.

Tests that check what a fresh process sees (imports, registration, the CLI's start) keep
``subprocess``. So do those that measure a process's peak memory: a child's high-water mark starts
at its parent's.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable


class Forked:
    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                fn(*args)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported on stderr, as an interpreter would
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = os.fdopen(out_r, "r")
        self._err = os.fdopen(err_r, "r")
        self._err_text: list[str] = []
        # stderr drains on a thread, so a child writing much to it never blocks on a full pipe
        self._drain = threading.Thread(target=lambda: self._err_text.append(self._err.read()), daemon=True)
        self._drain.start()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: the signal that ended it); past ``timeout`` the child is
        killed (its code kept) and ``TimeoutError`` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG if deadline is not None else 0)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                self.kill()
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
                raise TimeoutError(f"forked child {self.pid} ran past {timeout} s")
            else:
                time.sleep(0.01)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the child wrote to stdout and stderr, once it has exited."""
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.stdout.read()), daemon=True)
        reader.start()
        self.wait(timeout)
        reader.join()
        self._drain.join()
        self.stdout.close()
        self._err.close()
        return "".join(got), "".join(self._err_text)
