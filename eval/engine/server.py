"""A serving engine's server process: ports, start in its own process group, health, stop, the log's tail.

Every server runs in its own process group and is stopped with SIGTERM, then SIGKILL after a timeout, on every
way out (an error, Ctrl-C, SIGTERM to specdec, specdec's own death); its log is kept beside the report.
A server that takes an API key (`api_key_env`) gets a random one of its own and answers only requests that carry
it: another local user cannot use it while it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from specdec.eval.engine.client import HOST, Request, http_get, run_requests

log = logging.getLogger(__name__)

_ERROR_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?(?:[\w.]+(?:Error|Exception)|error)\b[:,].*", re.IGNORECASE)


class EngineError(ValueError):
    """A fault of the engine run; the message says what happened and what to do (CLI exit code 2)."""


class ServerDied(EngineError):
    """The server process exited while it was being measured."""


def port_is_free(port: int, host: str = HOST) -> bool:
    """Whether nothing listens on host:port (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A port the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """preexec_fn: the server gets SIGTERM if specdec dies without stopping it (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 25, width: int = 400, engine: str = "the engine") -> str:
    """The end of a server log (route listings left out, long lines cut), its last error first."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line if len(line) <= width else line[:width] + " ..." for line in text
            if "Route: " not in line and line.strip()]
    said = []
    errors = [i for i, line in enumerate(kept) if _ERROR_LINE.match(line)]
    if errors:  # the error line and its indented details (pydantic puts the reason on the next line)
        i = errors[-1]
        said = [kept[i].strip()] + [x.strip() for x in kept[i + 1: i + 4] if x[:1].isspace()]
    head = [f"{engine} says: " + " / ".join(said)] if said else []
    return "\n".join(head + ["--- end of the server log ---"] + kept[-lines:])


class Server:
    """One server process group of an engine in one mode: start, wait until healthy, generate, stop (SIGTERM,
    then SIGKILL). `engine` names it in messages, `key_prefix` its settings (e.g. vllm_ -> vllm_port).
    An engine subclasses it to read its speculative counters (`counters`)."""

    # The variable the engine reads its required API key from (None: it takes none). The key goes in the
    # environment, not the command line, which `ps` shows to other users and the log and the report record.
    api_key_env: str | None = None

    def __init__(self, label: str, command: list[str], port: int, log_path: Path, env: dict[str, str],
                 stop_timeout: float = 30.0, engine: str = "engine", key_prefix: str = ""):
        self.label, self.command, self.port, self.log_path = label, command, port, log_path
        self.env, self.stop_timeout, self.engine, self.key_prefix = env, stop_timeout, engine, key_prefix
        self.api_key = secrets.token_urlsafe(32) if self.api_key_env else None  # this server's, sent as a bearer
        if self.api_key:
            self.env = {**env, self.api_key_env: self.api_key}
        self.proc: subprocess.Popen | None = None
        self.started_at = self.ready_s = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Launch the server in a new process group, its output going to its log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as out:
            out.write("$ " + " ".join(self.command) + "\n")
            out.flush()
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(self.log_path.parent), start_new_session=True,
                                         preexec_fn=_die_with_parent())
        self.started_at = time.perf_counter()
        log.info("%s %s server starting on port %d (pid %d, log %s)", self.engine, self.label, self.port,
                 self.proc.pid, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_ready(self, timeout: float) -> bool:
        """One look: True once /health answers 200; EngineError with the log's tail if the process exited or
        `timeout` seconds passed since the start."""
        assert self.proc is not None and self.started_at is not None
        if self.ready_s is not None:
            return True
        if not self.alive():
            raise EngineError(self.failure(f"exited with code {self.proc.returncode} before it was ready"))
        try:
            if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                self.ready_s = time.perf_counter() - self.started_at
                log.info("%s %s server ready after %.1f s", self.engine, self.label, self.ready_s)
                return True
        except OSError:
            pass
        if time.perf_counter() - self.started_at > timeout:
            raise EngineError(self.failure(f"was not ready within {timeout:.0f} s ({self.key_prefix}startup_timeout)"))
        return False

    def generate(self, prompts: Sequence[list[int]], body: dict, concurrency: int, timeout: float,
                 seeds: Sequence[int | None] | None = None, progress=None) -> tuple[list[Request], float]:
        """Every prompt completed by `concurrency` closed-loop clients: (requests in prompt order, wall seconds)."""
        return run_requests(self.port, prompts, body, concurrency, timeout, seeds, progress,
                            timeout_key=f"{self.key_prefix}request_timeout", api_key=self.api_key)

    def counters(self, k: int) -> dict:
        """The engine's speculative counters now: drafts, draft_tokens, accepted, accepted_per_pos (k values),
        generation_tokens (each engine reads its own)."""
        raise NotImplementedError(f"{type(self).__name__} reads no speculative counters")

    def failure(self, what: str) -> str:
        """A message saying what the server did, with its log's tail (and the fix for a taken port)."""
        tail = log_tail(self.log_path, engine=self.engine)
        hint = ""
        if "Address already in use" in tail or "Errno 98" in tail:
            hint = (f"\nPort {self.port} is taken: leave {self.key_prefix}port unset (a free port is picked) or pick "
                    "another.")
        return f"the {self.engine} {self.label} server {what}. Its log: {self.log_path}\n{tail}{hint}"

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after stop_timeout; never leaves its children behind."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(pgid, wait=min(wait, 5.0)):
                return
        log.warning("%s %s server group %d still had processes after SIGKILL", self.engine, self.label, pgid)

    def peak_rss_mb(self) -> float | None:
        """Sum of the peak resident memory (VmHWM) of the server's processes (Linux), or None."""
        if not self.alive():
            return None
        total, found = 0.0, False
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
                if os.getpgid(int(status.parent.name)) != self.proc.pid:
                    continue
            except (OSError, ValueError):
                continue
            match = re.search(r"VmHWM:\s+(\d+) kB", text)
            if match:
                total, found = total + int(match.group(1)) / 1024.0, True
        return total if found else None

    def summary(self) -> dict:
        """The report's record of this server (read before it stops)."""
        return {"port": self.port, "log": self.log_path.name, "ready_s": self.ready_s,
                "peak_rss_mb": self.peak_rss_mb(), "alive_at_end": self.alive(), "command": self.command}


def _group_alive(pgid: int, wait: float) -> bool:
    """Whether any process of the group is still there after up to `wait` seconds."""
    deadline = time.perf_counter() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        if time.perf_counter() >= deadline:
            return True
        time.sleep(0.1)


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM to specdec unwinds like Ctrl-C, so that the servers' `finally` stops them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def running(servers: Sequence[Server], timeout: float) -> Iterator[None]:
    """Start the servers together, wait until each is healthy, and stop every one of them on the way out."""
    with _terminate_on_sigterm():
        try:
            for s in servers:
                s.start()
            # Poll them all, so that the first one to fail is reported at once.
            while not all([s.poll_ready(timeout) for s in servers]):
                time.sleep(0.5)
            yield
        finally:
            for s in servers:
                s.stop()
