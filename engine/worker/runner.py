"""ModelRunner: executes a StepPlan. Plan -> tensors -> forward -> sampled tokens.

It decides nothing: which tokens, blocks and sampling parameters come from the plan.
`submit(plan)` enqueues the step's copies, model and sampling work and returns at once on CUDA
(the sampled tokens travel to pinned host memory behind the step's event); `collect(step)` waits
for that event and reads them: one host sync per step. A plan's PLACEHOLDER tokens are filled on
the device from the previous submitted step's sampled tokens, so step t+1 can be submitted before
step t is collected (async scheduling).

With tensor parallelism every rank runs the same plan on its part of the model; rank 0 gets the
logits, samples, and broadcasts the tokens, which the other ranks need for the next placeholders.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from superinfer.engine.core.plan import PLACEHOLDER, ScheduledSeq, StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.grammar import GrammarCompiler, GrammarMatcher, disallowed_tokens, fill_bitmasks
from superinfer.engine.model.moe import SparseMoE
from superinfer.engine.worker import copy_methods
from superinfer.engine.worker.attention import SeqSpan
from superinfer.engine.worker.attention_backend import attention_backend
from superinfer.engine.worker.block_rows import BlockRows
from superinfer.engine.worker.device_tensor import device_tensor
from superinfer.engine.worker.duplex import CopyStats, DuplexKV, DuplexMode, StepCopies, tier_boundary
from superinfer.engine.worker.piecewise_graphs import PiecewiseGraphs, graph_token_counts
from superinfer.engine.worker.sampling import GrammarMasks, SampledLogprobs, sample
from superinfer.engine.worker.streams import Access, Block, CudaStreams, HostStreams, Streams
from superinfer.engine.worker.token_history import TokenHistories

if TYPE_CHECKING:
    from superinfer.engine.worker.cuda_graphs import DecodeGraphs  # imports triton

log = logging.getLogger("superinfer.runner")
T = TypeVar("T")

THREADED_MASK_ROWS = 8  # from this many rows under a grammar, their masks fill during the forward


def torch_threads(requested: int | None) -> int:
    """Threads for torch's CPU work: `requested`, else OMP_NUM_THREADS, else every core but one (at
    least one), which leaves a core to the HTTP server; on a loaded CPU, threads that wait for each
    other's core slow every step down."""
    if requested is not None:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best alternatives, most likely first
    rank: int | None = None  # of the token among the whole vocabulary, 1 = most likely (prompt tokens)


@dataclass
class StepOutput:
    sampled: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # in sampled_ids() order
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Prompt tokens' logprobs computed by this step's prefill chunks: position -> logprob.
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    copies: CopyStats = field(default_factory=CopyStats)
    grammar_errors: dict[str, str] = field(default_factory=dict)  # request id -> why its grammar stopped


@dataclass(frozen=True)
class PromptLogprobRows:
    """Prompt tokens whose logprobs a chunk yields: hidden rows row.. predict `targets`, the prompt
    tokens at positions first.. ."""

    request_id: str
    row: int
    first: int
    targets: list[int]
    k: int


@dataclass
class SubmittedStep:
    """A step whose work is enqueued; its results are host tensors valid once `copies` finish."""

    plan: StepPlan
    copies: StepCopies
    request_ids: list[str] = field(default_factory=list)  # of the sampled rows, in order
    logprobs_wanted: list[int | None] = field(default_factory=list)
    device_tokens: torch.Tensor | None = None  # what the next step's placeholders read
    tokens: torch.Tensor | None = None  # host (pinned on CUDA)
    logprobs: SampledLogprobs | None = None  # host
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    prompt_logprobs: SampledLogprobs | None = None  # host, the rows of prompt_rows in order
    prompt_ranks: torch.Tensor | None = None  # host, the rank of each prompt token
    grammar_errors: dict[str, str] = field(default_factory=dict)
    forward: str = ""  # how its forward ran: "decode_graph", "piecewise_graphs" or "op_by_op" ("": none)


@dataclass
class _StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_ids: list[str] = field(default_factory=list)  # whose token from the previous step
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        """Every row is a sequence's one new token, sampled (what the decode graphs run)."""
        n = len(self.spans)
        return len(self.input_ids) == n and len(self.sample_rows) == n and not self.prompt_rows


@dataclass(frozen=True)
class SampleRows:
    """The step's sampled rows in order, in columns: its seqs that sample, then its decode rows."""

    request_ids: list[str]
    sampling: list[SamplingParams]
    prompt_token_ids: list[list[int] | tuple[()]]
    banned_token_ids: list[tuple[int, ...]]

    @classmethod
    def of(cls, plan: StepPlan, request_ids: list[str]) -> SampleRows:
        """`request_ids`: the plan's `sampled_ids()`, already at hand."""
        seqs, d = [s for s in plan.seqs if s.sample], plan.decodes
        return cls(
            request_ids,
            [s.sampling for s in seqs] + d.sampling,
            [s.prompt_token_ids for s in seqs] + d.prompt_token_ids,
            [s.banned_token_ids for s in seqs] + [()] * len(d),
        )

    def __len__(self) -> int:
        return len(self.request_ids)


def _gather_inputs(plan: StepPlan, block_rows: BlockRows | None = None) -> _StepInputs:
    """The step's inputs as host lists; with `block_rows`, each span's blocks as an int32 array."""
    x = _StepInputs()
    row = 0
    for seq in plan.seqs:
        n, start, ctx = seq.num_tokens, seq.start_pos, seq.context_len
        x.input_ids.extend(seq.token_ids)
        if seq.token_ids[-1] == PLACEHOLDER:
            x.placeholder_rows.append(row + n - 1)
            x.placeholder_ids.append(seq.request_id)
        x.positions.extend(range(start, ctx))
        x.spans.append(SeqSpan(row, n, ctx, block_rows.array(seq.block_ids) if block_rows else seq.block_ids))
        k = seq.sampling.prompt_logprobs
        count = min(ctx, len(seq.prompt_token_ids) - 1) - start
        if k is not None and count > 0:
            targets = list(seq.prompt_token_ids[start + 1 : start + 1 + count])
            x.prompt_rows.append(PromptLogprobRows(seq.request_id, row, start + 1, targets, k))
        row += n
        if seq.sample:
            x.sample_rows.append(row - 1)
    d = plan.decodes
    x.input_ids += d.token_ids
    x.positions += d.start_pos
    blocks = block_rows.arrays(d.block_ids) if block_rows else d.block_ids
    x.spans += map(SeqSpan, range(row, row + len(d)), repeat(1), [p + 1 for p in d.start_pos], blocks)
    x.sample_rows += range(row, row + len(d))
    if d.token_ids.count(PLACEHOLDER) == len(d):  # every decode row's token is the step in flight's (async)
        x.placeholder_rows += range(row, row + len(d))
        x.placeholder_ids += d.request_ids
        return x
    for i, token in enumerate(d.token_ids):
        if token == PLACEHOLDER:
            x.placeholder_rows.append(row + i)
            x.placeholder_ids.append(d.request_ids[i])
    return x


def compute_access(plan: StepPlan, block_size: int) -> Access:
    """The GPU blocks a step's model work reads (each context) and writes (the new tokens' slots)."""
    reads: set[Block] = set()
    writes: set[Block] = set()
    for seq in plan.all_seqs():
        end = -(-seq.context_len // block_size)
        reads.update(("gpu", b) for b in seq.block_ids[:end])
        writes.update(("gpu", b) for b in seq.block_ids[seq.start_pos // block_size : end])
    return Access(frozenset(reads), frozenset(writes))


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        scale: float,
        cpu_cache: torch.Tensor | None = None,
        duplex: DuplexMode = "full",
        streams: Streams | None = None,
        grammars: GrammarCompiler | None = None,
        attention: str = "auto",
        copy_method: str = "auto",
    ) -> None:
        """`attention`: the attention backend, auto, torch, cpu or triton (see attention_backend.py);
        `copy_method`: how KV copies between tiers are issued, auto or a copy_methods.METHODS entry."""
        self.model = model
        self.tp = model.tp
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        if streams is None:
            streams = CudaStreams(self.device) if self.device.type == "cuda" else HostStreams()
        boundary = tier_boundary(kv_cache, cpu_cache)
        methods, probed = copy_methods.resolve(copy_method, kv_cache, cpu_cache, boundary)
        if probed:
            log.info("KV copy methods, measured: %s", copy_methods.describe(methods, probed))
        self.duplex = DuplexKV(kv_cache, cpu_cache, streams, duplex, methods)
        self.block_size = block_size
        self.scale = scale
        q_heads = model.model.layers[0].self_attn.num_heads  # this rank's
        self.attention_backend, self.attention = attention_backend(attention, kv_cache, q_heads)
        self.block_rows = BlockRows() if self.attention_backend == "triton" else None  # its tables take arrays
        if self.attention_backend == "triton" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches on the current device's current stream
            from superinfer.engine.model.decoder import FusedKernels
            from superinfer.kernels.rms_norm import add_rms_norm, rms_norm
            from superinfer.kernels.rope import rope
            from superinfer.kernels.silu_mul import silu_mul

            model.use_kernels(FusedKernels(rms_norm, add_rms_norm, silu_mul, rope))
        self.generators: dict[str, torch.Generator] = {}
        self.histories = TokenHistories(model.config.vocab_size, self.device)
        self.grammars = grammars
        self.matchers: dict[str, GrammarMatcher] = {}
        self._masker: ThreadPoolExecutor | None = None  # fills grammar masks during the forward
        self._previous: SubmittedStep | None = None  # whose sampled tokens fill the next placeholders
        self.graphs: DecodeGraphs | None = None  # see capture_decode_graphs
        self.piecewise: PiecewiseGraphs | None = None  # see capture_piecewise_graphs

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture a CUDA graph of the decode forward for each padded batch size up to `max_num_seqs`
        (cuda_graphs.py) where the step allows it: on CUDA, with the Triton attention, on one GPU,
        without MoE layers (their routing reads expert counts on the host)."""
        if not self._graphs_allowed:
            return
        from superinfer.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes

        sizes = graph_batch_sizes(max_num_seqs)
        self.graphs = self._capture(
            f"CUDA graphs of decode steps of {sizes} rows",
            lambda: DecodeGraphs(self.model, self.kv_cache, self.scale, max_model_len, sizes),
            "a lower --gpu-memory-utilization leaves them more memory, --max-num-seqs bounds the largest graph, "
            "and --enforce-eager runs without them",
        )

    def capture_piecewise_graphs(self, max_num_batched_tokens: int) -> None:
        """Capture the forward between attention calls as CUDA graphs per padded token count up
        to `max_num_batched_tokens` (piecewise_graphs.py), for the steps no decode graph runs,
        where the step allows graphs (as capture_decode_graphs)."""
        if not self._graphs_allowed:
            return
        counts = graph_token_counts(max_num_batched_tokens)
        self.piecewise = self._capture(
            f"piecewise CUDA graphs of {counts} tokens",
            lambda: PiecewiseGraphs(self.model, counts, self.device, self.graphs.pool if self.graphs else None),
            "a lower --gpu-memory-utilization or --max-num-batched-tokens leaves them more memory, and without "
            "--piecewise-graphs steps with prompt tokens run op by op",
        )

    def _capture(self, what: str, build: Callable[[], T], advice: str) -> T:
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                captured = build()
        except RuntimeError as e:  # out of memory included
            raise RuntimeError(f"capturing {what} failed ({e}); {advice}") from e
        log.info("%s captured in %.1f s", what, time.perf_counter() - t0)
        return captured

    @functools.cached_property
    def _graphs_allowed(self) -> bool:
        """On CUDA, with the Triton attention, on one GPU, without MoE layers (their routing reads
        expert counts on the host). (Asked by each kind of graph: said once.)"""
        if self.device.type != "cuda" or self.attention_backend != "triton":
            return False
        if self.tp.size > 1 or any(isinstance(m, SparseMoE) for m in self.model.modules()):
            log.info("CUDA graphs off: they need one GPU and a model without MoE layers")
            return False
        return True

    def warm_up(self) -> None:
        """Run one step, a prompt chunk beside a decode (op by op, or through the piecewise graphs
        if captured), before serving: on CUDA Triton compiles what the decode graphs do not hold
        (the prompt chunks' attention) now, not during the first requests. Its tokens go to the
        first few blocks, which hold nothing yet."""
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        chunk_blocks = -(-16 // self.block_size)
        decode_blocks = range(chunk_blocks, chunk_blocks + -(-41 // self.block_size))
        chunk = ScheduledSeq("warm-up-chunk", [0] * 16, 0, list(range(chunk_blocks)), True, greedy)
        decode = ScheduledSeq("warm-up-decode", [0], 40, list(decode_blocks), True, greedy)
        self.execute(StepPlan(step_id=0, seqs=[chunk, decode]))
        self.execute(StepPlan(step_id=0, seqs=[], released=[chunk.request_id, decode.request_id]))
        self._previous = None

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return device_tensor(values, torch.long, self.device)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the plan's copies and model step; returns once both are complete."""
        return self.collect(self.submit(plan))

    def submit(self, plan: StepPlan) -> SubmittedStep:
        """Enqueue the plan's copies, model step and sampling; on CUDA this does not wait for them."""
        step = SubmittedStep(plan, self.duplex.start(plan))
        step.request_ids = plan.sampled_ids()
        previous, self._previous = self._previous, step
        if self.block_rows is not None:
            self.block_rows.next_step()
        # On the host, now: the plan is not kept.
        inputs = _gather_inputs(plan, self.block_rows) if plan.num_seqs else None

        def work() -> None:
            for request_id in plan.released:
                self.generators.pop(request_id, None)
                self.histories.release(request_id)
                self.matchers.pop(request_id, None)
            if inputs is not None:
                with torch.inference_mode():
                    self._forward(plan, inputs, step, previous)

        self.duplex.compute(step.copies, work, lambda: compute_access(plan, self.block_size))
        return step

    def collect(self, step: SubmittedStep) -> StepOutput:
        """Wait for a submitted step and return its sampled tokens, logprobs and copy stats."""
        out = StepOutput(copies=self.duplex.finish(step.copies), grammar_errors=step.grammar_errors)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = _prompt_logprobs(step.prompt_rows, step.prompt_logprobs, step.prompt_ranks)
        if step.tokens is None:
            return out
        out.sampled = step.tokens.numpy()  # (a host tensor of its own, not reused)
        if step.logprobs is not None:
            sampled = out.sampled.tolist()
            chosen = step.logprobs.chosen.tolist()
            top_ids, top_values = step.logprobs.top_ids.tolist(), step.logprobs.top_values.tolist()
            for i, (rid, k) in enumerate(zip(step.request_ids, step.logprobs_wanted, strict=True)):
                if k is not None:
                    top = list(zip(top_ids[i], top_values[i], strict=True))[:k]
                    out.logprobs[rid] = TokenLogprob(sampled[i], chosen[i], top)
        return out

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying a result to pinned host memory, ordered behind the step's work."""
        if self.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def _forward(self, plan: StepPlan, x: _StepInputs, step: SubmittedStep, previous: SubmittedStep | None) -> None:
        input_ids = self._tensor(x.input_ids)
        if x.placeholder_rows:
            prev_tokens = previous.device_tokens if previous is not None else None
            row_of = {rid: i for i, rid in enumerate(previous.request_ids)} if previous is not None else {}
            missing = [rid for rid in x.placeholder_ids if rid not in row_of]
            if missing or prev_tokens is None:
                raise RuntimeError(f"the previous step sampled no token for {missing}: stale placeholders")
            src = self._tensor([row_of[rid] for rid in x.placeholder_ids])
            input_ids[self._tensor(x.placeholder_rows)] = prev_tokens[src]
        sampling = SampleRows.of(plan, step.request_ids)
        masks = self._start_masks(sampling) if self.tp.rank == 0 else None
        hidden = self.graphs.run(input_ids, x.positions, x.spans) if self.graphs and x.decode_only else None
        step.forward = "decode_graph"
        if hidden is None:
            attn = self.attention(x.spans, self.kv_cache, self.scale)
            hidden = self.piecewise.run(input_ids, x.positions, attn) if self.piecewise else None
            step.forward = "op_by_op" if hidden is None else "piecewise_graphs"
            if hidden is None:
                hidden = self.model(input_ids, self._tensor(x.positions), attn)
            if x.prompt_rows:
                self._score_prompts(hidden, x, step)
            if not sampling:
                return
            hidden = hidden[self._tensor(x.sample_rows)]
        logits = self.model.compute_logits(hidden)
        if logits is None:  # another rank's share: rank 0 samples
            tokens = torch.empty(len(sampling), dtype=torch.long, device=self.device)
            step.device_tokens = self.tp.broadcast_first(tokens)
            return
        params = sampling.sampling
        gens = [self._generator(rid, p.seed) for rid, p in zip(sampling.request_ids, params, strict=True)]
        rows = self.histories.rows(sampling.request_ids, params, sampling.prompt_token_ids)
        history = self.histories.gather(rows) if rows is not None else None
        grammar = None
        if masks is not None:
            guided_rows, future = masks
            disallowed = future.result()
            if disallowed.dtype == torch.int32:  # packed: unpacked on the device
                disallowed = disallowed_tokens(disallowed, logits.shape[-1], self.device)
            grammar = GrammarMasks(self._tensor(guided_rows), disallowed)
        tokens, logprobs = sample(logits, params, gens, sampling.banned_token_ids, history, grammar)
        self.tp.broadcast_first(tokens)
        if rows is not None:
            self.histories.record(rows, tokens)
        if masks is not None:
            guided_ids = [sampling.request_ids[i] for i in masks[0]]
            step.grammar_errors = self._advance_matchers(guided_ids, tokens[grammar.rows].tolist())
        step.device_tokens = tokens
        step.tokens = self._to_host(tokens)
        if logprobs is not None:
            step.logprobs_wanted = [p.logprobs for p in params]
            parts = (logprobs.chosen, logprobs.top_ids, logprobs.top_values)
            step.logprobs = SampledLogprobs(*(self._to_host(t) for t in parts))

    def _start_masks(self, sampling: SampleRows) -> tuple[list[int], Future] | None:
        """Start filling the grammar masks of the rows under a grammar, on a thread of their own:
        llguidance releases the GIL, so the masks are computed while the model runs."""
        rows = [i for i, p in enumerate(sampling.sampling) if p.guided is not None]
        if not rows:
            return None
        if self.grammars is None:
            raise RuntimeError("structured output needs a tokenizer: this model has none")
        matchers = []
        for i in rows:
            request_id, guided = sampling.request_ids[i], sampling.sampling[i].guided
            matcher = self.matchers.get(request_id)
            if matcher is None:
                grammar = self.grammars.compile(guided)
                matcher = self.matchers[request_id] = GrammarMatcher(grammar)
            matchers.append(matcher)
        if len(rows) < THREADED_MASK_ROWS:  # a few masks fill in microseconds: a thread costs more
            done: Future = Future()
            done.set_result(self._fill_masks(matchers))
            return rows, done
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="superinfer-grammar")
        return rows, self._masker.submit(self._fill_masks, matchers)

    def _fill_masks(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """The rows' masks, packed (GPU: unpacked there) or, on the CPU, already unpacked here."""
        bitmask = fill_bitmasks(matchers)
        if self.device.type == "cpu":
            return disallowed_tokens(bitmask, self.model.config.vocab_size)
        return bitmask

    def _advance_matchers(self, request_ids: list[str], tokens: list[int]) -> dict[str, str]:
        """Move each grammar on by its sampled token (a host sync, in steps with such rows only:
        the next step's masks depend on it). Returns why a grammar could go no further, by
        request: one of llguidance's limits (a huge repetition count or list of choices), met
        while filling its mask (which then allows only EOS) or taking the token."""
        errors = {}
        for request_id, token in zip(request_ids, tokens, strict=True):
            matcher = self.matchers[request_id]
            if not matcher.is_terminated():  # (past the grammar's end, with ignore_eos, EOS is all it allows)
                matcher.accept(token)
            if matcher.error is not None:
                errors[request_id] = f"its grammar stopped at token {token}: {matcher.error}"
                log.warning("request %s: %s", request_id, errors[request_id])
        return errors

    def _score_prompts(self, hidden: torch.Tensor, x: _StepInputs, step: SubmittedStep) -> None:
        """Logprobs of the prompt tokens this step's chunks predict (echo, prompt_logprobs)."""
        rows = [r.row + i for r in x.prompt_rows for i in range(len(r.targets))]
        targets = [t for r in x.prompt_rows for t in r.targets]
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        if logits is None:  # another rank's share: rank 0 scores
            return
        logp = logits.float().log_softmax(dim=-1)
        chosen = logp.gather(-1, self._tensor(targets)[:, None]).squeeze(-1)
        top = logp.topk(max(1, max(r.k for r in x.prompt_rows)), dim=-1)
        step.prompt_rows = x.prompt_rows
        step.prompt_logprobs = SampledLogprobs(*(self._to_host(t) for t in (chosen, top.indices, top.values)))
        step.prompt_ranks = self._to_host((logp > chosen[:, None]).sum(dim=-1) + 1)


def _prompt_logprobs(
    rows: list[PromptLogprobRows], lp: SampledLogprobs, ranks: torch.Tensor
) -> dict[str, dict[int, TokenLogprob]]:
    chosen, top_ids, top_values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
    rank = ranks.tolist()
    out: dict[str, dict[int, TokenLogprob]] = {}
    i = 0
    for r in rows:
        per_position = out.setdefault(r.request_id, {})
        for position, token in enumerate(r.targets, start=r.first):
            top = list(zip(top_ids[i], top_values[i], strict=True))[: r.k]
            per_position[position] = TokenLogprob(token, chosen[i], top, rank[i])
            i += 1
    return out
