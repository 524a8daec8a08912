"""The engine core in a process of its own (`--engine-process`).

The server's process keeps HTTP, JSON, tokenization, chat templates, grammar checks (a schema the
engine cannot follow is a 400 before anything is sent), detokenization and stop strings, SSE and
/metrics exposition. A child process (spawned, like the tensor-parallel ranks) runs the EngineCore:
scheduler, model step, sampling and grammar masks, and with `-tp N` the rank-0 role (it spawns the
other ranks itself). They talk over one multiprocessing pipe, in the messages of engine/wire.py:

    server -> engine   AddRequest, Abort (the client left), Finish (a stop string matched in the
                       text: the engine counts the request finished with reason "stop"), Scrape
                       (the engine answers with its registry's text), Stop (the server drained)
    engine -> server   Ready(CoreInfo) | StartFailed(exception)   at startup
                       Outputs: one per step, every request's new tokens in it (WireOutput), and
                       the queues' sizes
                       MetricsPage(scrape id, text)
                       Died(message): a step failed or a rank died; the process then exits 1

The Prometheus registry stays where it is updated, in the engine process; a scrape asks it for a
text snapshot through the pipe, after the commands sent before it (so a request the server has
finished is counted). Arrival times are the server's `time.monotonic()`, the same clock in both
processes. The engine process ignores SIGINT and SIGTERM (the server drains, then sends `stop`)
and exits when the server's end of the pipe closes.

Because the server detokenizes, a request that ends on a stop string may have computed a token or
two past it by the time the engine hears of it: those are dropped (vLLM's API server does the
same), but they appear in the engine's token counters and latency histograms; and one whose stop
string is completed by the token that also ends it (max_tokens, EOS) answers "stop" but is counted
under the engine's own reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import Delivery, EngineClient, EngineCore, EngineDeadError, EngineLoop
from superinfer.engine.gc_freeze import freeze_startup_heap
from superinfer.engine.grammar import GrammarCompiler
from superinfer.engine.model.config import ModelConfig
from superinfer.engine.output import RequestOutput, TextStream
from superinfer.engine.slo_classes import SLOClass
from superinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from superinfer.engine.wire import (
    Command,
    Died,
    Finish,
    MetricsPage,
    Outputs,
    Ready,
    Scrape,
    StartFailed,
    Stop,
    WireOutput,
)

log = logging.getLogger("superinfer.engine")

STOP_TIMEOUT_S = 60.0  # a stopping engine finishes its step, then its ranks; past this it is killed
METRICS_TIMEOUT_S = 10.0  # a scrape waits this long for the engine (it answers between steps)


def to_wire(out: RequestOutput) -> WireOutput:
    return (
        out.token_ids,
        out.logprobs,
        out.finished,
        out.finish_reason,
        out.num_prompt_tokens,
        out.num_output_tokens,
        out.num_cached_tokens,
        out.prompt_logprobs,
    )


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know of the engine core, sent once it is built."""

    max_model_len: int
    model_config: ModelConfig
    tokenizer_dir: Path | None


class CoreView:
    """The part of an EngineCore the HTTP server reads, for a core in another process: limits,
    the model's config, the SLO classes, and its own tokenizer and grammar compiler."""

    def __init__(self, config: EngineConfig, info: CoreInfo) -> None:
        self.config = config
        self.max_model_len = info.max_model_len
        self.model_config = info.model_config
        self.slo_classes: dict[str, SLOClass] = config.slo_class_table()
        self.tokenizer = Tokenizer.from_dir(info.tokenizer_dir) if info.tokenizer_dir else None
        self.grammars = GrammarCompiler(self.tokenizer, info.model_config.vocab_size) if self.tokenizer else None
        self.clock = time.monotonic


def picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclass
class _Stream:
    outputs: asyncio.Queue[RequestOutput | BaseException]
    text: TextStream


class ProcessEngine(EngineClient):
    """AsyncEngine's interface with the EngineCore in a child process: `generate` streams a
    request's outputs, detokenized here."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core: CoreView | None = None
        self._proc: Any = None
        self._pipe: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._counts = (0, 0, 0)  # running, waiting, rotary, as of the engine's last step
        self._scrapes: dict[int, asyncio.Future[bytes]] = {}
        self._scrape_ids = itertools.count()
        self._last_metrics = b""
        self._stopping = False
        self.error: BaseException | None = None
        self.died = asyncio.Event()

    @property
    def num_live(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Live requests that are neither running nor parked in the CPU tier (as of the last step)."""
        running, _, rotary = self._counts
        return self.num_live - running - rotary

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and wait until its core is built (raises what building it raised)."""
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=_engine_main, args=(self.config, there, level), name="superinfer-engine")
        self._proc.start()
        there.close()
        self._pipe = here
        try:
            info = await asyncio.to_thread(self._handshake)
            self.core = await asyncio.to_thread(CoreView, self.config, info)
        except BaseException:
            await self.stop(timeout_s=5.0)
            raise
        threading.Thread(target=self._read, name="superinfer-engine-reader", daemon=True).start()

    def _handshake(self) -> CoreInfo:
        assert self._pipe is not None
        wait([self._pipe, self._proc.sentinel])
        try:
            message = self._pipe.recv()
        except (EOFError, OSError):
            self._proc.join(5.0)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while starting") from None
        if isinstance(message, StartFailed):
            raise message.error
        return message.info

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop the engine process after its current step (killed past `timeout_s`, default
        STOP_TIMEOUT_S): it stops its tensor-parallel ranks first."""
        if self._proc is None:
            return
        self._stopping = True
        self._send(Stop())
        await asyncio.to_thread(self._proc.join, STOP_TIMEOUT_S if timeout_s is None else timeout_s)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout_s or STOP_TIMEOUT_S)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join)
        if self._pipe is not None:
            self._pipe.close()
        self._proc = None

    def _fail_live(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.outputs.put_nowait(EngineDeadError(f"the engine failed: {exc}"))
            self._streams.pop(rid, None)
        for scrape in self._scrapes.values():
            if not scrape.done():
                scrape.set_result(self._last_metrics)
        self.died.set()

    def _send(self, message: Command) -> None:
        with contextlib.suppress(OSError, ValueError):  # the engine is gone: the reader reports it
            self._pipe.send(message)  # type: ignore[union-attr]

    # --- the engine's messages, on a reader thread, then on the event loop -------------------------
    def _read(self) -> None:
        assert self._pipe is not None and self._loop is not None
        while True:
            try:
                message = self._pipe.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Died):
                self.fail(RuntimeError(message.message))
            else:
                self._loop.call_soon_threadsafe(self._on_message, message)
        if not self._stopping:
            proc = self._proc
            if proc is not None:
                proc.join(1.0)
            code = proc.exitcode if proc is not None else None
            self.fail(RuntimeError(f"the engine process exited (code {code})"))

    def _on_message(self, message: Outputs | MetricsPage) -> None:
        if isinstance(message, Outputs):
            self._counts = message.counts
            self._dispatch(message.items)
        else:
            scrape = self._scrapes.get(message.scrape_id)
            if scrape is not None and not scrape.done():
                scrape.set_result(message.text)

    def _dispatch(self, items: list[tuple[str, WireOutput | BaseException]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # left, or already finished on a stop string
            if isinstance(item, BaseException):
                stream.outputs.put_nowait(item)
                continue
            token_ids, logprobs, finished, reason, n_prompt, n_output, n_cached, prompt_lps = item
            text = stream.text
            for i, token in enumerate(token_ids):
                text.feed(token, last=finished and i == len(token_ids) - 1)
            if text.stopped:  # a stop string matched (also on the very last token): the engine ends it too
                if not finished:
                    self._send(Finish(rid))
                finished, reason = True, "stop"
            if finished:
                del self._streams[rid]
            text_delta = text.take(finished)
            stream.outputs.put_nowait(
                RequestOutput(  # (positional: see RequestOutput)
                    rid, text_delta, token_ids, logprobs, finished, reason, n_prompt, n_output, n_cached, prompt_lps
                )
            )

    # --- requests --------------------------------------------------------------------------------
    async def metrics_text(self) -> bytes:
        """The engine's /metrics page, asked of the engine process (its last page once it is dead)."""
        if self.error is not None or self._loop is None:
            return self._last_metrics
        scrape_id = next(self._scrape_ids)
        scrape = self._scrapes[scrape_id] = self._loop.create_future()
        self._send(Scrape(scrape_id))
        try:
            self._last_metrics = await asyncio.wait_for(scrape, METRICS_TIMEOUT_S)
        finally:
            self._scrapes.pop(scrape_id, None)
        return self._last_metrics

    def _open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        tokenizer = self.core.tokenizer if self.core is not None else None
        skip = sampling.skip_special_tokens
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip) if tokenizer else None
        stream = _Stream(asyncio.Queue(), TextStream(detok, sampling.stop, sampling.include_stop_str_in_output))
        self._streams[request_id] = stream
        return stream.outputs


# --- the engine process ------------------------------------------------------------------------------
class _EngineProcess:
    """The child's side: the EngineLoop on the main thread, a thread that feeds it the server's
    commands, and the pipe back (one message per step)."""

    def __init__(self, core: EngineCore, pipe: Connection) -> None:
        self.core = core
        self.pipe = pipe
        self._send_lock = threading.Lock()
        self.failed = False
        self.loop = EngineLoop(core, self._deliver, self._fail, on_scrape=self._metrics)

    def send(self, message: Ready | StartFailed | Outputs | MetricsPage | Died) -> None:
        with self._send_lock:
            self.pipe.send(message)

    def run(self) -> None:
        threading.Thread(target=self._receive, name="superinfer-engine-commands", daemon=True).start()
        if self.core.workers is not None:
            self.core.workers.watch(self._fail)
        self.loop.run()

    def _receive(self) -> None:
        commands = self.loop.commands
        while True:
            try:
                message = self.pipe.recv()
            except (EOFError, OSError):  # the server is gone
                commands.put(Stop())
                return
            commands.put(message)
            if type(message) is Stop:
                return

    def _deliver(self, items: Delivery) -> None:
        scheduler = self.core.scheduler
        wire = [(rid, item if isinstance(item, BaseException) else to_wire(item)) for rid, item in items]
        counts = (scheduler.num_running, scheduler.num_waiting, scheduler.num_rotary)
        self.send(Outputs(wire, counts))

    def _metrics(self, command: Scrape) -> None:
        self.send(MetricsPage(command.scrape_id, self.core.metrics.render()))

    def _fail(self, exc: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        with contextlib.suppress(OSError):
            self.send(Died(str(exc)))
        self.loop.commands.put(Stop())  # a rank died while the loop waits for commands


def _engine_main(config: EngineConfig, pipe: Connection, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        core = EngineCore(config, detokenize=False)
    except BaseException as exc:
        if isinstance(exc, (ValueError, FileNotFoundError)):  # the configuration's: the CLI says it in a line
            log.debug("the engine failed to start", exc_info=True)
        else:
            log.exception("the engine failed to start")
        with contextlib.suppress(OSError):
            pipe.send(StartFailed(picklable(exc)))
        raise SystemExit(1) from None
    child = _EngineProcess(core, pipe)
    freeze_startup_heap("engine process")
    try:
        child.send(Ready(CoreInfo(core.max_model_len, core.model_config, core.tokenizer_dir)))
        child.run()
    except BaseException as exc:
        log.exception("the engine process failed")
        child._fail(exc)
    finally:
        core.close()
    if child.failed:
        raise SystemExit(1)
