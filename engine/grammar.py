"""Grammar-constrained decoding (structured outputs) with llguidance.

A request's constraint is a `GuidedSpec` (JSON schema, any JSON object, regex, choice list or
Lark grammar), built from OpenAI's `response_format` or vLLM's `guided_*` / `structured_outputs`
fields. `GrammarCompiler.compile` turns it into a `CompiledGrammar` once (LRU-cached) and fails
with `GrammarError` at admission; each sequence then walks the grammar with its own
`GrammarMatcher`. Per step, `fill_bitmasks` computes the allowed tokens of a batch (llguidance's
executor, GIL released, so it can overlap the model forward) and `apply_bitmask` sets the
disallowed logits to -inf on the logits' device.

EOS: the compiler gives llguidance the tokenizer's EOS ids; the mask allows them only where the
grammar accepts, and once the grammar can go no further (`is_terminated`) EOS is all it allows.
Ids past the tokenizer's vocabulary (a model whose logits are wider) are never allowed.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from superinfer.engine.output_constraint import JSON_LAYOUT, GrammarError, GuidedSpec, choices
from superinfer.engine.tokenizer import Tokenizer


def _grammar_text(spec: GuidedSpec) -> str:
    """llguidance's grammar definition for `spec` (not yet checked)."""
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, overrides=JSON_LAYOUT)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            # JSON string literals are valid Lark literals.
            options = choices(json.loads(spec.value), "choice")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in options))
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"invalid {spec.kind}: {e}") from e
    raise GrammarError(f"unknown structured-output kind {spec.kind!r}")


class CompiledGrammar:
    """A checked grammar bound to the model's tokenizer. Its matcher is never advanced: each
    sequence's `GrammarMatcher` starts as a copy of it (about a microsecond; building a matcher
    from the grammar again would cost a compile)."""

    __slots__ = ("_initial", "mask_words", "spec")

    def __init__(self, spec: GuidedSpec, initial: llguidance.LLMatcher, mask_words: int) -> None:
        self.spec = spec
        self.mask_words = mask_words
        self._initial = initial


class GrammarCompiler:
    """Compiles `GuidedSpec`s for one model; thread-safe.

    `vocab_size` is the model's logits width; it may exceed the tokenizer's vocabulary, and the
    extra ids are masked out.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        # A tokenizer.json string goes to llguidance's own `tokenizers` binding: no transformers.
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=sorted(tokenizer.eos_token_ids) or None
        )
        self.vocab_size = vocab_size
        self.mask_words = (n_vocab + 31) // 32
        self.eos_token_ids: list[int] = list(self._tokenizer.eos_tokens)
        self._cache_size = cache_size
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compile (or fetch) `spec`; GrammarError carries llguidance's message. Compiling a
        large schema can take a while (the GIL is released), so callers on an event loop may
        want a thread."""
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._build(spec)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)  # another thread may have won
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: GuidedSpec) -> CompiledGrammar:
        initial = llguidance.LLMatcher(self._tokenizer, _grammar_text(spec), log_level=0)
        if initial.is_error():
            raise GrammarError(f"invalid {spec.kind}: {initial.get_error()}")
        # The first mask, on a copy: a grammar no text can satisfy (a schema that only refers to
        # itself) stops there, and would answer nothing with finish_reason "stop".
        probe, mask = initial.deep_copy(), torch.zeros(self.mask_words, dtype=torch.int32)  # (held while written)
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), self.mask_words * 4)
        if probe.is_error():
            raise GrammarError(f"invalid {spec.kind}: no output can satisfy it ({_reason(probe.get_error())})")
        return CompiledGrammar(spec, initial, self.mask_words)


def _reason(error: str) -> str:
    """llguidance's reason for stopping a matcher, without the parser state it dumps after it."""
    return error.partition("\n")[0]


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: do not `accept` while a
    `fill_bitmasks` that includes this matcher is running."""

    __slots__ = ("_m", "mask_words")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._m = grammar._initial.deep_copy()
        self.mask_words = grammar.mask_words

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and the matcher is in error for good) if the
        grammar forbids it."""
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, EOS was taken, or an error)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return _reason(self._m.get_error()) if self._m.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, CPU, contiguous; bit t%32 of
        word t//32 set = token t allowed)."""
        _check_bitmask(bitmask, self.mask_words, row + 1)
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self.mask_words * 4)


def _check_bitmask(bitmask: torch.Tensor, words: int, rows: int) -> None:
    # llguidance writes through a raw pointer: a wrong shape would corrupt memory, not raise.
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous int32 CPU tensor")
    if bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.shape[0] < rows:
        raise ValueError(f"bitmask must be [>= {rows}, {words}], got {list(bitmask.shape)}")


EXECUTOR_ROWS = 8  # from this many rows, masks are filled in parallel by llguidance's executor


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # threads: 80% of the CPUs, at most 32


def fill_bitmasks(matchers: Sequence[GrammarMatcher | None], out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The batch's bitmask [len(matchers), words] (in `out` if given, e.g. pinned and reused),
    rows without a matcher all-allowed; None when no row has one.

    The masks are computed in parallel by llguidance's executor with the GIL released, so this
    can run in a background thread during the forward pass.
    """
    rows = [(m._m, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    words = {m.mask_words for m in matchers if m is not None}
    if len(words) != 1:
        raise ValueError("the matchers of one batch must come from one GrammarCompiler")
    (width,) = words
    if out is None:
        out = torch.full((len(matchers), width), -1, dtype=torch.int32)
    else:
        _check_bitmask(out, width, len(matchers))
        free = [i for i, m in enumerate(matchers) if m is None]
        if free:
            out[free] = -1
    if len(rows) < EXECUTOR_ROWS:  # the executor's dispatch costs more than a few masks
        for matcher, i in rows:
            matcher.unsafe_compute_mask_ptr(out[i].data_ptr(), width * 4)
    else:
        _executor().unsafe_compute_mask_ptr(rows, out.data_ptr(), width * 4, out.shape[0])
    return out[: len(matchers)]


def disallowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [rows, vocab] on `device`, True where the bitmask forbids the token (and for ids at or
    past 32 * bitmask.shape[1]). On a GPU the packed mask travels and is unpacked there; on the CPU
    this can run on the mask thread, leaving only a masked_fill for the step."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} {list(bitmask.shape)}")
    rows, width = bitmask.shape[0], bitmask.shape[1] * 32
    # As bytes (torch runs on little-endian hosts only), token t is bit t % 8 of byte t // 8.
    if torch.device(device).type == "cpu":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        disallowed = torch.from_numpy(bits) == 0
    else:
        packed = bitmask.to(device, non_blocking=True).contiguous().view(torch.uint8)
        shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
        disallowed = ((packed[:, :, None] >> shifts) & 1).view(rows, width) == 0
    if vocab <= width:
        return disallowed[:, :vocab]
    return torch.cat([disallowed, disallowed.new_ones((rows, vocab - width))], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on the logits' device.

    `logits` is [rows, vocab]; ids at or past 32 * bitmask.shape[1] are disallowed.
    """
    rows, vocab = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != rows:
        raise ValueError(f"bitmask must be int32 [{rows}, words], got {bitmask.dtype} {list(bitmask.shape)}")
    logits.masked_fill_(disallowed_tokens(bitmask, vocab, logits.device), float("-inf"))
