"""EngineCore (the step loop) and AsyncEngine (the core on its own thread).

EngineCore owns the model, the KV cache tensor, the scheduler and the runner:
    schedule -> StepPlan -> runner.submit -> runner.collect -> scheduler.update -> RequestOutputs.
With async scheduling (default on CUDA) each step() schedules and submits step t+1 before it
collects step t, so the host's scheduling and bookkeeping overlap the device's work.
AsyncEngine runs that loop on a dedicated thread so the HTTP event loop never waits on a model
step; requests and aborts go in through a queue, outputs come back through asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.contract import DEFAULT_SLO_CLASS, PRIORITY_MAX, PRIORITY_MIN
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.policies import RotaryParams, make_policy
from superinfer.engine.core.request import FinishReason, Request, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig
from superinfer.engine.grammar import GrammarCompiler
from superinfer.engine.metrics import EngineMetrics
from superinfer.engine.model.loader import model_config
from superinfer.engine.model.sharding import TensorParallel, check_fits
from superinfer.engine.output import RequestOutput, TextStream
from superinfer.engine.slo import SLO
from superinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from superinfer.engine.wire import Abort, AddRequest, Command, Finish, Scrape, Stop
from superinfer.engine.worker.host_memory import (
    HOST_FRACTION,
    MAX_HOST_FRACTION,
    available_host_bytes,
    default_tier_bytes,
    require_host_bytes,
)
from superinfer.engine.worker.rank_share import kv_block_bytes, load_shard, make_runner, num_kv_blocks, resolve_device
from superinfer.engine.worker.runner import StepOutput, SubmittedStep, TokenLogprob
from superinfer.engine.worker.streams import Streams
from superinfer.engine.worker.tp_workers import Workers

log = logging.getLogger("superinfer.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(model_dtype, torch.bfloat16)


CPU_MODEL_TIER_BYTES = 4 << 30


def num_cpu_tier_blocks(
    config: EngineConfig, block_bytes: int, num_gpu_blocks: int, device: torch.device, ranks: int = 1
) -> int:
    """Blocks of the CPU tier (of each rank's, `block_bytes` each): the overrides, else (policies
    that rotate) a share of the host's available memory, at least the GPU pool's size when memory
    allows (see default_tier_bytes). With the model on the CPU the "GPU pool" is host memory too:
    the tier defaults to 4 GiB (the pool's size if larger), at most a quarter of the available
    memory over all ranks; its pages are only committed as blocks are written."""
    if config.num_cpu_blocks is not None or config.cpu_kv_gib is not None:
        if config.num_cpu_blocks is not None:
            blocks, flag = config.num_cpu_blocks, "--num-cpu-blocks"
        else:
            blocks, flag = int(config.cpu_kv_gib * (1 << 30)) // block_bytes, "--cpu-kv-gib"
        what = f"{flag} (the CPU KV tier of {ranks} ranks)" if ranks > 1 else f"{flag} (the CPU KV tier)"
        require_host_bytes(what, blocks * block_bytes * ranks)
        if blocks and config.policy == "fcfs":
            log.warning("%s: the CPU KV tier is unused with --policy fcfs (it never rotates)", flag)
        return blocks
    if config.policy == "fcfs":
        return 0  # fcfs never rotates
    available, pool = available_host_bytes(), num_gpu_blocks * block_bytes
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        tier = default_tier_bytes(available, pool, gpus)
        rule = f"max({HOST_FRACTION:g} x share, min(pool, {MAX_HOST_FRACTION:g} x share)), share over {gpus} GPU(s)"
    else:  # pool and tier share the host: a rotation tier several times a small pool, within reason
        tier = min(max(pool, CPU_MODEL_TIER_BYTES), available // (4 * ranks))
        rule = "min(max(pool, 4 GiB), available / 4)" + (f" / {ranks} ranks" if ranks > 1 else "")
    log.info(
        "CPU KV tier sized automatically (--cpu-kv-gib overrides): %.2f GiB from %.2f GiB of available host "
        "memory and a %.2f GiB KV pool: %s",
        tier / 2**30,
        available / 2**30,
        pool / 2**30,
        rule,
    )
    return tier // block_bytes


@dataclass
class _Live:
    stream: TextStream
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by prompt position


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        streams: Streams | None = None,
        detokenize: bool = True,
    ) -> None:
        """`streams`: where device work runs (default: CUDA streams on a GPU, at once on the host).
        With --tensor-parallel-size N > 1 the other N - 1 ranks start in worker processes of their
        own (worker/tp_workers.py); `close` stops them. `detokenize=False`: outputs carry tokens and
        no text, and stop strings are not watched (the engine process leaves both to the server,
        which ends a request on a stop string with `finish`)."""
        self.config = config
        self.clock = clock
        self.detokenize = detokenize
        self.device = resolve_device(config.device)
        self.workers: Workers | None = None
        size = config.tensor_parallel_size
        if size > 1:  # the config first: a model that cannot be split fails before any process starts
            check_fits(model_config(config.model, config.revision, config.download_dir, config.offline), size)
            resolve_device(config.device, size - 1)  # on CUDA: a GPU for every rank
            self.workers = Workers(config, size)
        try:
            self._build(config, clock, streams)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, clock: Callable[[], float], streams: Streams | None) -> None:
        tp = self.workers.join(self.device) if self.workers is not None else TensorParallel()
        loaded = load_shard(config, self.device, tp)
        mc = self.model_config = loaded.config
        self.model_path = loaded.path
        self.tokenizer_dir = loaded.tokenizer_dir
        self.dtype = next(loaded.model.parameters()).dtype
        self.tokenizer = Tokenizer.from_dir(loaded.tokenizer_dir) if loaded.tokenizer_dir else None
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_ids)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.max_model_len} is longer than this model's context "
                f"(max_position_embeddings {mc.max_position_embeddings})"
            )

        bs = config.block_size
        block_bytes = kv_block_bytes(loaded, bs)
        num_blocks = num_kv_blocks(config, loaded, block_bytes, self.device)
        if self.workers is not None:  # the same block ids on every rank: the smallest pool
            num_blocks = min(num_blocks, *(blocks for (blocks,) in self.workers.receive("loaded")))
        num_cpu_blocks = num_cpu_tier_blocks(config, block_bytes, num_blocks, self.device, tp.size)
        if self.workers is not None:
            self.workers.send("cache", num_blocks, num_cpu_blocks)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size) if self.tokenizer else None
        self.runner, memory = make_runner(
            config, loaded, self.device, num_blocks, num_cpu_blocks, streams, self.grammars
        )
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
            if config.piecewise_graphs:
                self.runner.capture_piecewise_graphs(config.max_num_batched_tokens)
        if self.device.type == "cuda" and tp.size == 1:  # (ranks would all have to run it)
            self.runner.warm_up()
        ranks = [memory]
        if self.workers is not None:
            ranks += [m for (m,) in self.workers.receive("ready")]
        log.info("memory per rank: %s", "; ".join(m.describe() for m in ranks))
        if config.policy != "fcfs" and num_cpu_blocks < num_blocks:
            log.warning(
                "the CPU KV tier (%d blocks) is smaller than the GPU KV pool (%d blocks): when it is full, "
                'rotation falls back to recompute, counted in preemptions{mode="recompute", reason="cpu_full"}',
                num_cpu_blocks,
                num_blocks,
            )
        self.block_bytes = block_bytes * tp.size  # a block's bytes over all ranks (what its copies move)
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, num_cpu_blocks)
        rotary = RotaryParams(
            config.rotary_alpha,
            config.rotary_beta_f,
            config.rotary_beta_b,
            config.transfer_budget_blocks,
            min_residency_s=config.rotary_min_residency_ms / 1000.0,
            slo_admission=config.slo_admission,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.transfer_budget_blocks,
                config.write_through,
            ),
            self.kv,
            make_policy(config.policy, rotary, num_blocks),
            clock,
        )
        if num_cpu_blocks and config.transfer_budget_blocks < self.kv.blocks_for(self.max_model_len):
            log.warning(
                "--transfer-budget-blocks %d is smaller than one full-length request (%d blocks): "
                "such requests come back from the CPU tier by recompute",
                config.transfer_budget_blocks,
                self.kv.blocks_for(self.max_model_len),
            )
        self.default_slo = config.default_slo
        self.slo_classes = config.slo_class_table()
        self.metrics = EngineMetrics(
            config.model_name,
            self.default_slo,
            classes={name: cls.slo for name, cls in self.slo_classes.items()},
            vllm_compat=config.metrics_compat == "vllm",
            info={
                "policy": config.policy,
                "device": str(self.device),
                "dtype": str(self.dtype).split(".")[-1],
                "block_size": str(bs),
                "num_gpu_blocks": str(num_blocks),
                "num_cpu_blocks": str(num_cpu_blocks),
                "architecture": mc.architecture,
                "tensor_parallel_size": str(tp.size),
                "kv_copy_out": self.runner.duplex.methods["out"],  # as measured at startup (rank 0's)
                "kv_copy_in": self.runner.duplex.methods["in"],
            },
        )
        self._live: dict[str, _Live] = {}
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._in_flight: SubmittedStep | None = None
        log.info(
            "engine ready: %s on %s (%s%s), policy %s, %d GPU + %d CPU KV blocks of %d tokens",
            config.model,
            self.device,
            self.dtype,
            f", tensor parallel {tp.size}" if tp.size > 1 else "",
            config.policy,
            num_blocks,
            num_cpu_blocks,
            bs,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()

    # --- requests ----------------------------------------------------------------------------
    def validate(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """A ValueError for a request the engine cannot take: too long, or naming a token past the
        vocabulary (the sampler indexes the logits with its stop tokens and biased ones)."""
        self.scheduler.check_fits(num_prompt_tokens, sampling.max_tokens)
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", [t for t, _ in sampling.logit_bias]),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name} must be token ids in [0, {vocab}), got {list(ids)}")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        slo: SLO | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
        slo_class: str = DEFAULT_SLO_CLASS,
    ) -> None:
        """`slo` and `priority` default to those of `slo_class`."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if priority is not None and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority}")
        cls = self.slo_classes.get(slo_class)
        if cls is None:
            raise ValueError(f"unknown SLO class {slo_class!r}; known classes: {', '.join(sorted(self.slo_classes))}")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            slo=slo or cls.slo,
            priority=cls.priority if priority is None else priority,
            slo_class=slo_class,
        )
        self.scheduler.add(req)
        detok = (
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sampling.skip_special_tokens)
            if self.tokenizer and self.detokenize
            else None
        )
        self._live[request_id] = _Live(TextStream(detok, sampling.stop, sampling.include_stop_str_in_output))

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._live.pop(request_id, None)
            self.metrics.on_finish(req, self.clock())
            self.metrics.on_state(self.scheduler, self.kv, self.clock())

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> None:
        """End a live request from outside: a stop string the server found in its text (with
        `detokenize=False`). Counted as finished for `reason`, like one the engine ended itself."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(request_id, reason)
            self._live.pop(request_id, None)
            self.metrics.on_finish(req, self.clock())
            self.metrics.on_state(self.scheduler, self.kv, self.clock())

    @property
    def step_in_flight(self) -> bool:
        """A submitted step whose results are not collected yet (async scheduling)."""
        return self._in_flight is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.step_in_flight

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and submit a step, then collect the step in flight before it (async
        scheduling) or this one. Returns the outputs of the steps collected."""
        try:
            return self._step()
        except Exception as exc:
            if self.workers is not None:
                self.workers.check(exc)  # a lost rank is the reason to report
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if self.workers is not None:
            self.workers.submit(plan)
        submitted = self.runner.submit(plan)
        phases = {"schedule": t1 - t0, "submit": time.perf_counter() - t1}
        previous, self._in_flight = self._in_flight, submitted
        outputs = []
        if previous is not None:
            outputs += self._collect(previous, phases)
            phases = {}
        if not self.async_scheduling or plan.is_empty:
            self._in_flight = None
            outputs += self._collect(submitted, phases)
        return outputs

    def _collect(self, step: SubmittedStep, phases: dict[str, float]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        result = self.runner.collect(step)
        if self.workers is not None:
            self.workers.collected(step.plan.step_id)
        return self.complete(step.plan, result, {**phases, "wait": time.perf_counter() - t0})

    def complete(self, plan: StepPlan, result: StepOutput, phase_seconds: dict[str, float]) -> list[RequestOutput]:
        """Apply an executed step: new tokens, stop strings, finished requests, metrics."""
        t2 = time.perf_counter()
        touched = self.scheduler.update(plan, result.sampled)
        grammar_errors = result.grammar_errors  # their text can no longer follow their grammar
        now = self.clock()
        for request_id, by_position in result.prompt_logprobs.items():
            if request_id in self._live:  # a recomputed prompt keeps the logprobs of its first pass
                self._live[request_id].prompt_logprobs = by_position | self._live[request_id].prompt_logprobs
        self.metrics.on_tokens(len(touched), self.scheduler.token_timing)
        outputs = []
        logprobs = result.logprobs
        new = self.scheduler.new_tokens
        for req, token, num_output in zip(touched, new.tokens, new.num_output, strict=True):
            request_id, finished = req.request_id, req.is_finished
            live = self._live[request_id]
            stream, text = live.stream, ""
            if grammar_errors and request_id in grammar_errors:
                if not finished:
                    self.scheduler.finish(request_id, FinishReason.ABORT)
                req.finish_reason, finished = FinishReason.ABORT, True  # (also over an EOS the error forced)
            if stream.detokenizer is not None:  # (else text and stop strings are the server's)
                stream.feed(token, last=finished)
                if stream.stopped:  # a stop string matched (also on the very last token)
                    if finished:
                        req.finish_reason = FinishReason.STOP
                    else:
                        self.scheduler.finish(request_id, FinishReason.STOP)
                        finished = True
                text = stream.take(finished)
            if finished:
                del self._live[request_id]
                self.metrics.on_finish(req, now)
            lp = logprobs.get(request_id) if logprobs else None
            prompt_lps = None
            num_prompt = len(req.prompt_token_ids)
            if req.sampling.prompt_logprobs is not None and num_output == 1:
                prompt_lps = [None, *(live.prompt_logprobs[p] for p in range(1, num_prompt))]
            outputs.append(
                RequestOutput(  # (positional: see RequestOutput)
                    request_id,
                    text,
                    [token],
                    [lp] if lp else None,
                    finished,
                    req.finish_reason.value if req.finish_reason else None,
                    num_prompt,
                    num_output,
                    req.num_cached_tokens,
                    prompt_lps,
                )
            )
        self.metrics.on_step(
            self.scheduler,
            self.kv,
            result.copies,
            self.block_bytes,
            phase_seconds={**phase_seconds, "update": time.perf_counter() - t2},
            now=self.clock(),
        )
        return outputs


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    """What the server holds of the engine, whether its core runs on a thread of this process
    (AsyncEngine) or in a process of its own (engine/process.py's ProcessEngine): `generate`,
    which sends commands (engine/wire.py) and streams a request's outputs, and failing once."""

    error: BaseException | None
    core: Any  # EngineCore, or the process's CoreView: its limits, tokenizer, SLO classes, clock
    _loop: asyncio.AbstractEventLoop | None
    _streams: dict[str, Any]  # the live requests'

    def _open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Register a new request's stream; the queue its outputs arrive on."""
        raise NotImplementedError

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    def _fail_live(self, exc: BaseException) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """Stop serving after a fatal error (from any thread): every live request gets an
        EngineDeadError and new ones are refused."""
        if self.error is not None:
            return
        self.error = exc
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_live, exc)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        slo: SLO | None = None,
        priority: int | None = None,
        slo_class: str = DEFAULT_SLO_CLASS,
        after: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it. A request the
        engine refuses (too long for the context or the KV pool) raises its ValueError, before
        any output.

        `after`: a live request with the same prompt; this one starts once that one has computed
        the prompt (its first token), to share the prompt's KV blocks through the prefix cache.
        Its arrival time, for its SLO, is still now."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already live")
        outputs = self._open(request_id, prompt_token_ids, sampling)
        arrival = self.core.clock()
        self._send(AddRequest(request_id, prompt_token_ids, sampling, slo, priority, arrival, slo_class, after))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(Abort(request_id))


Delivery = list[tuple[str, RequestOutput | BaseException]]


class EngineLoop:
    """The step loop around an EngineCore, run by the thread that calls `run`: between steps it
    applies the queued commands (engine/wire.py; a scrape goes to `on_scrape`), steps while
    there is work, and hands each step's outputs to `deliver` in one call. AsyncEngine runs it on a
    thread of the server's process, the engine process (engine/process.py) on its main thread."""

    def __init__(
        self,
        core: EngineCore,
        deliver: Callable[[Delivery], None],
        fail: Callable[[BaseException], None],
        on_scrape: Callable[[Scrape], None] | None = None,
    ) -> None:
        self.core = core
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._deliver = deliver
        self._fail = fail
        self._on_scrape = on_scrape
        # Requests held back until the request they share a prompt with has computed it, so that
        # they find its KV in the prefix cache instead of computing it again (n > 1).
        self._held: dict[str, list[AddRequest]] = {}

    def run(self) -> None:
        """Until a `stop` command, or a step fails (then `fail` is called with its error)."""
        while True:
            try:
                command = self.commands.get(block=not self.core.has_work)
            except queue.Empty:
                command = None
            while command is not None:
                if type(command) is Stop:
                    return
                self._apply(command)
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    command = None
            if not self.core.has_work:
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:  # a broken step: fail every live request, stop serving
                log.exception("engine step failed")
                self._fail(exc)
                return
            if outputs:
                self._deliver([(o.request_id, o) for o in outputs])
            if self._held:
                for out in outputs:
                    self._release_held(out.request_id)

    def _holds(self, after: str | None) -> bool:
        """Whether a request sharing `after`'s prompt should wait for that prompt's KV."""
        if after is None or not self.core.kv.enable_prefix_caching:
            return False
        first = self.core.scheduler.requests.get(after)
        return first is not None and first.num_output_tokens == 0 and not first.is_finished

    def _release_held(self, request_id: str) -> None:
        for command in self._held.pop(request_id, ()):
            self._apply(command)

    def _apply(self, command: Command) -> None:
        if type(command) is AddRequest:
            rid, prompt, sampling, slo, priority, arrival, slo_class, after = command
            if self._holds(after):
                self._held.setdefault(after, []).append(command)
                return
            try:
                self.core.validate(len(prompt), sampling)
                self.core.add_request(rid, prompt, sampling, slo, priority, arrival, slo_class)
            except ValueError as exc:
                self._deliver([(rid, exc)])
            except Exception as exc:  # a bug, not bad input: fail this request, keep serving
                log.exception("could not add request %s", rid)
                self._deliver([(rid, RuntimeError(f"internal error adding the request: {exc}"))])
            if rid not in self.core.scheduler.requests:  # refused, or finished at once
                self._release_held(rid)
        elif type(command) in (Abort, Finish):
            rid = command.request_id
            for held in self._held.values():
                held[:] = [h for h in held if h.request_id != rid]
            if type(command) is Abort:
                self.core.abort(rid)
            else:
                self.core.finish(rid)
            self._release_held(rid)
        elif type(command) is Scrape and self._on_scrape is not None:
            self._on_scrape(command)


class AsyncEngine(EngineClient):
    """EngineCore on its own thread; `generate` streams a request's outputs to a coroutine."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.loop = EngineLoop(core, self._deliver, self.fail)
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.died = asyncio.Event()  # set (on the event loop) once `error` is

    @property
    def num_live(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Live requests that are neither running nor parked in the CPU tier."""
        scheduler = self.core.scheduler
        return self.num_live - scheduler.num_running - scheduler.num_rotary

    async def metrics_text(self) -> bytes:
        """The engine's /metrics page."""
        return self.core.metrics.render()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self.loop.run, name="superinfer-engine", daemon=True)
        self._thread.start()
        if self.core.workers is not None:
            self.core.workers.watch(self.fail)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop the engine thread (after its current step; at most `timeout_s` if given: a thread
        blocked on a dead device is left behind), then the core's worker processes."""
        if self._thread is not None:
            self.loop.commands.put(Stop())
            try:
                await asyncio.wait_for(asyncio.to_thread(self._thread.join), timeout_s)
            except asyncio.TimeoutError:
                log.warning("the engine thread did not stop within %.0f s: left behind", timeout_s)
            self._thread = None
        self.core.close()

    def _fail_live(self, exc: BaseException) -> None:
        self._dispatch([(rid, EngineDeadError(f"the engine failed: {exc}")) for rid in list(self._streams)])
        self.died.set()

    def _open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        self.core.validate(len(prompt_token_ids), sampling)
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = outputs
        return outputs

    def _send(self, command: Command) -> None:
        self.loop.commands.put(command)

    def _deliver(self, items: Delivery) -> None:
        if items and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: Delivery) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(item)
