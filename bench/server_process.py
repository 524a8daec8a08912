"""A model server as a real subprocess on 127.0.0.1: start it, wait until it answers, stop it.

The server runs in its own session (process group), so stopping it also stops the workers it
spawned (vLLM runs its engine in a child process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from superinfer.bench.peer_settings import ServerCommand
from superinfer.engine.contract import HEALTH_PATH, MODELS_PATH

READY_PATHS = (HEALTH_PATH, MODELS_PATH)  # vLLM and ours answer both once serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of `pid` itself, and of it with every live descendant
    (from /proc; Linux only). A process that is gone counts 0."""
    tick = os.sysconf("SC_CLK_TCK")
    usage: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        usage[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, (pp, _) in usage.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier += children
    own = usage.get(pid, (0, 0.0))[1]
    return own, sum(usage[p][1] for p in tree if p in usage)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start(cmd: ServerCommand, log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **cmd.env},
            cwd=log_path.parent,  # not the repo root, whose operator/ would shadow the stdlib module
            start_new_session=True,
        )


async def answers(http: aiohttp.ClientSession, url: str) -> bool:
    for path in READY_PATHS:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return True
    return False


async def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> float:
    """Poll until the server answers; seconds it took. Fails at once if the process exits."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while not await answers(http, url):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; {log_path}:\n{log_tail(log_path)}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"server not ready after {timeout_s:.0f} s; {log_path}:\n{log_tail(log_path)}")
            await asyncio.sleep(0.5)
    return time.monotonic() - t0


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # workers left behind by a server that exited on its own
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Launch:
    cmd: ServerCommand
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serving(
    launches: Sequence[Launch], timeout_s: float, procs: list[subprocess.Popen] | None = None
) -> AsyncIterator[list[str]]:
    """Start every server at once, yield their base URLs once all answer, stop them all on exit.
    `procs`, if given, receives the server processes (in the order of `launches`)."""
    procs = procs if procs is not None else []
    try:
        for launch in launches:
            procs.append(start(launch.cmd, launch.log_path))
        ready = (wait_ready(p, x.url, x.log_path, timeout_s) for p, x in zip(procs, launches, strict=True))
        await asyncio.gather(*ready)
        yield [x.url for x in launches]
    finally:
        for proc in procs:
            stop(proc)
