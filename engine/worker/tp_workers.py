"""Tensor-parallel ranks as processes: rank 0 is the engine's own process, ranks 1..N-1 are
worker processes it spawns (`Workers`).

The collectives inside the model (sharding.py) run over torch.distributed: gloo on the CPU, NCCL on
GPUs (one GPU per rank), rendezvous through a TCP store on a free localhost port. Everything else
goes over one pipe per worker: the startup handshake (each rank sizes its KV pool, rank 0 picks
the smallest), then every StepPlan, pickled. Rank 0's scheduler makes each plan; `Workers.submit`
sends it to the workers before rank 0 runs it, and each worker runs the same plan on its share: the
same block copies between its own KV tiers (block ids are the same on every rank) and the same
forward, whose collectives keep the ranks in step. Rank 0 samples and broadcasts the tokens (the
next plan's placeholders need them everywhere).

The scheduler's fences (which unfinished step an op must wait for) follow rank 0's progress: with
each plan goes the last step rank 0 has collected, and a worker collects that far before running
the plan, so an op that rank 0 may start without waiting has nothing to wait for on a worker either.

Failures: a dead worker closes its pipe and its gloo connections, so rank 0's next send or
collective raises; and a thread watches the workers' process sentinels and reports a death at once,
also while the engine is idle or blocked on a device. Workers ignore SIGINT and SIGTERM (the engine
drains, then stops them) and exit when rank 0's end of the pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.gc_freeze import freeze_startup_heap
from superinfer.engine.model.sharding import TensorParallel
from superinfer.engine.worker.rank_share import kv_block_bytes, load_shard, make_runner, num_kv_blocks, resolve_device
from superinfer.engine.worker.runner import ModelRunner, SubmittedStep

log = logging.getLogger("superinfer.parallel")

HOST = "127.0.0.1"
# A collective waits this long for a slow rank before it fails (ranks run the same work, so they
# only wait for each other's skew; a dead rank is noticed at once by its sentinel or socket).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STOP_TIMEOUT_S = 10.0


class WorkerDied(RuntimeError):
    pass


def join_group(device: torch.device, rank: int, size: int, store: dist.Store) -> TensorParallel:
    """Join the ranks' default process group (gloo on the CPU, NCCL on GPUs)."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process: one at a time")
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **extra)
    return TensorParallel(rank, size)


def wire_plan(plan: StepPlan) -> StepPlan:
    """The plan as the workers need it: prompts only where prompt logprobs are computed."""
    seqs = [s if s.sampling.prompt_logprobs is not None else replace(s, prompt_token_ids=()) for s in plan.seqs]
    decodes = replace(plan.decodes, prompt_token_ids=[()] * len(plan.decodes))  # a decode scores no prompt
    return replace(plan, seqs=seqs, decodes=decodes)


class Workers:
    """Ranks 1..N-1 of a tensor-parallel engine, seen from rank 0."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size = size
        self.store = dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Connection] = []
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(config, rank, size, self.store.port, there, level),
                name=f"superinfer-tp{rank}",
                daemon=True,
            )
            proc.start()
            there.close()
            self.procs.append(proc)
            self.pipes.append(here)
        self._collected = 0  # the newest step rank 0 has collected
        self._closing = False

    # --- startup -------------------------------------------------------------------------------
    def join(self, device: torch.device) -> TensorParallel:
        """Rank 0 joins the process group once every worker has started."""
        self.receive("started")
        return join_group(device, 0, self.size, self.store)

    def receive(self, kind: str) -> list[tuple]:
        """One `kind` message from every worker, in rank order; raises as soon as one fails or dies."""
        replies: dict[int, tuple] = {}
        while len(replies) < len(self.procs):
            ranks = enumerate(zip(self.pipes, self.procs, strict=True), start=1)
            waiting = [(rank, pipe, proc) for rank, (pipe, proc) in ranks if rank not in replies]
            ready = wait([pipe for _, pipe, _ in waiting] + [proc.sentinel for _, _, proc in waiting])
            for rank, pipe, proc in waiting:
                if pipe.poll():  # before the sentinel: a failing worker says why, then exits
                    replies[rank] = self._message(rank, pipe, proc, kind)
                elif proc.sentinel in ready:
                    proc.join(1.0)
                    raise WorkerDied(f"tensor-parallel rank {rank} exited with code {proc.exitcode}")
        return [replies[r] for r in sorted(replies)]

    @staticmethod
    def _message(rank: int, pipe: Connection, proc: Any, kind: str) -> tuple:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            proc.join(1.0)
            raise WorkerDied(f"tensor-parallel rank {rank} exited with code {proc.exitcode}") from None
        if message[0] == "error":
            raise WorkerDied(f"tensor-parallel rank {rank} failed:\n{message[1]}")
        if message[0] != kind:
            raise RuntimeError(f"tensor-parallel rank {rank} sent {message[0]!r}, expected {kind!r}")
        return message[1:]

    def send(self, *message: Any) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    # --- steps ---------------------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> None:
        """Send a plan rank 0 is about to run (and how far rank 0 has collected)."""
        try:
            self.send("step", wire_plan(plan), self._collected)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise WorkerDied(f"a tensor-parallel worker is gone: {exc}") from exc

    def collected(self, step_id: int) -> None:
        self._collected = max(self._collected, step_id)

    # --- failure and shutdown ------------------------------------------------------------------
    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Call `on_death` (on a thread of its own) if a worker exits before `close`."""

        def run() -> None:
            wait([p.sentinel for p in self.procs])
            if not self._closing:
                log.error("tensor-parallel worker died: %s", self._dead())
                on_death(WorkerDied(f"tensor-parallel worker died: {self._dead()}"))

        threading.Thread(target=run, name="superinfer-tp-watch", daemon=True).start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def check(self, error: BaseException, grace_s: float = 1.0) -> None:
        """Raise WorkerDied (from `error`) if a worker has died, allowing `grace_s` for its exit
        to show: a failed collective or send usually means a rank is gone, and that is the news."""
        wait([p.sentinel for p in self.procs], grace_s)
        dead = self._dead()
        if dead:
            raise WorkerDied(f"tensor-parallel worker died: {dead}") from error

    def _dead(self) -> str:
        """The workers that have exited, with their exit codes ("" if none)."""
        ended = wait([p.sentinel for p in self.procs], 0)
        dead = []
        for rank, proc in enumerate(self.procs, 1):
            if proc.sentinel in ended:
                proc.join(1.0)  # reaped: its exit code is known
                dead.append(f"rank {rank} (exit code {proc.exitcode})")
        return ", ".join(dead)

    def close(self) -> None:
        """Stop the workers (they finish the steps they have), then leave the process group."""
        if self._closing:
            return
        self._closing = True
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # already gone
                pipe.send(("stop",))
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                log.warning("tensor-parallel worker %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join()
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- a worker process ------------------------------------------------------------------------------
def _worker_main(config: EngineConfig, rank: int, size: int, port: int, pipe: Connection, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    try:
        device = resolve_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pipe.send(("started",))
        store = dist.TCPStore(HOST, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        tp = join_group(device, rank, size, store)
        loaded = load_shard(config, device, tp)
        pipe.send(("loaded", num_kv_blocks(config, loaded, kv_block_bytes(loaded, config.block_size), device)))
        message = pipe.recv()
        if message[0] == "stop":  # rank 0 failed to start
            return
        _, num_blocks, num_cpu_blocks = message
        runner, memory = make_runner(config, loaded, device, num_blocks, num_cpu_blocks)
        freeze_startup_heap(f"rank {rank}")
        pipe.send(("ready", memory))
        serve_plans(runner, pipe)
    except EOFError:
        log.info("rank 0 is gone: exiting")
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_plans(runner: ModelRunner, pipe: Connection) -> None:
    """Run rank 0's plans until it says stop."""
    in_flight: deque[SubmittedStep] = deque()
    while True:
        message = pipe.recv()
        if message[0] == "stop":
            break
        _, plan, collected = message
        while in_flight and in_flight[0].plan.step_id <= collected:
            runner.collect(in_flight.popleft())
        in_flight.append(runner.submit(plan))
    while in_flight:
        runner.collect(in_flight.popleft())
