"""What a request's consumer receives each step: new tokens and text, with stop strings applied."""

from __future__ import annotations

from dataclasses import dataclass, field

from superinfer.engine.tokenizer import IncrementalDetokenizer
from superinfer.engine.worker.runner import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    """The delta of one request since its previous output (one per running request each step:
    the engine builds them with positional arguments, which cost a third of keyword ones)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    # With the first output of a request that asked for them: one per prompt token (the first None).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class TextStream:
    """Turns a request's tokens into text deltas and watches for stop strings.

    While a stop string could still be forming at the end of the text, that tail is held back,
    so a consumer never sees part of a stop string. The stop string itself is emitted only with
    `include_stop`.
    """

    detokenizer: IncrementalDetokenizer | None  # None for models without a tokenizer
    stop: tuple[str, ...]
    include_stop: bool = False
    text: str = ""
    emitted: int = 0
    stopped: bool = field(default=False)

    def feed(self, token_id: int, last: bool = False) -> None:
        """Add one token; `last` flushes a trailing incomplete character as the decoder would."""
        if self.detokenizer is None or self.stopped:
            return
        self.text += self.detokenizer.feed([token_id])
        if last:
            self.text += self.detokenizer.flush()
        for s in self.stop:
            # Only the newly added text and the held-back tail can contain a new match.
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[: at + len(s) if self.include_stop else at]
                self.stopped = True

    def take(self, finished: bool) -> str:
        """The text not yet emitted, minus a tail that may still become a stop string."""
        end = len(self.text)
        if not finished and not self.stopped and self.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
