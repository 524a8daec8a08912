"""Tokenizer, chat templates and streaming detokenization on top of the `tokenizers` library.

No transformers at runtime: `tokenizer.json` carries the model, the special tokens and the BOS
post-processor; `tokenizer_config.json` names bos/eos and may hold the chat template;
`chat_template.jinja` (newer repos) holds it beside, `chat_template.json` in some older ones;
`generation_config.json` adds eos ids.
Chat templates are rendered the way transformers does (sandboxed jinja2, trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template is missing, broken, or rejected the messages (raise_exception)."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or AddedToken dicts {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _select_template(raw: Any) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    named = {t["name"]: t["template"] for t in raw}  # [{"name": ..., "template": ...}, ...]
    if "default" not in named:
        raise ChatTemplateError(f"no 'default' chat template among {sorted(named)}")
    return named["default"]


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training; render the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        # Some tokenizer.json files carry truncation/padding settings; a server must see whole prompts.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = {tokenizer.token_to_id(eos_token)} if eos_token else set()
        self.eos_token_ids: frozenset[int] = frozenset(i for i in (*eos, *extra_eos_ids) if i is not None)
        # Template variables such as bos_token / eos_token / pad_token.
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._prepend_bos = bool(add_bos_token) and self.bos_token_id is not None and not self._adds_bos()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
        config = _read_json(path / "tokenizer_config.json")
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        else:  # older repos: inside tokenizer_config.json, or a processor's chat_template.json
            template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
        specials = {
            key: content
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(config.get(key))) is not None
        }
        return cls(
            tokenizers.Tokenizer.from_file(str(file)),
            bos_token=specials.get("bos_token"),
            eos_token=specials.get("eos_token"),
            special_tokens=specials,
            extra_eos_ids=gen_eos,
            add_bos_token=config.get("add_bos_token"),
            chat_template=_select_template(template),
        )

    def _adds_bos(self) -> bool:
        """Whether the post-processor already puts BOS in front (Llama 3 does, Qwen does not)."""
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, exactly one BOS even when `text` starts with it
        (as a rendered chat template does)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        bos = self.bos_token_id
        if self._prepend_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        elif len(ids) >= 2 and ids[0] == bos and ids[1] == bos and self.bos_token and text.startswith(self.bos_token):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json['chat_template']); use the completions API instead"
            )
        try:
            return _jinja_env().from_string(self.chat_template)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the conversation to a prompt string (encode it with add_special_tokens=False,
        or rely on encode() not doubling BOS). Extra kwargs (tools, documents...) reach the template.
        `continue_final_message`: the prompt ends inside the last message (a prefill to continue),
        cut after its content as transformers does."""
        # Like transformers: tools/documents are defined (None) even when not given.
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        if continue_final_message:
            final = (messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at == -1:
                raise ChatTemplateError("continue_final_message: the final message's text is not in the prompt")
            text = text[: at + len(final)]
        return text

    def info(self) -> dict[str, Any]:
        """What vLLM's /tokenizer_info reports: the special tokens, the chat template, the size."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": self.vocab_size,
            **self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "add_bos_token": self._prepend_bos or self._adds_bos(),
            "chat_template": self.chat_template,
        }


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, through `tokenizers`' DecodeStream.

    `feed` returns only text that is final: a multi-byte character split across tokens is held
    back until complete. After `flush()`, `text` equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def feed(self, new_token_ids: Iterable[int]) -> str:
        """Add ids; return the text they complete (possibly "")."""
        new = []
        for token_id in new_token_ids:
            self._ids.append(int(token_id))
            chunk = self._stream.step(self._tokenizer.backend, int(token_id))
            if chunk:
                new.append(chunk)
        self._parts += new
        return "".join(new)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD), at end of stream."""
        emitted = self.text
        tail = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)[len(emitted) :]
        if tail:
            self._parts.append(tail)
        return tail
