"""Structured outputs: request parsing, grammar compilation, masks, and random sampling under them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from superinfer.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GuidedSpec,
    apply_bitmask,
    fill_bitmasks,
)
from superinfer.engine.model.tiny import BOS, END_OF_TEXT, EOT, TINY_VOCAB_SIZE, special_token_ids, tiny_tokenizer
from superinfer.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "done": {"type": "boolean"},
    },
    "required": ["color", "count", "done"],
    "additionalProperties": False,
}
BUDGET = 200  # tokens a random model gets to finish a small constrained output
SEEDS = range(8)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    ids = special_token_ids()
    # Two EOS ids, as the tiny model's generation_config has.
    return Tokenizer(tiny_tokenizer(), bos_token=BOS, eos_token=EOT, extra_eos_ids=[ids[END_OF_TEXT]])


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, TINY_VOCAB_SIZE)


def _allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    logits = torch.zeros(1, bitmask.shape[1] * 32)
    apply_bitmask(logits, bitmask[row : row + 1])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _sample(compiler: GrammarCompiler, spec: GuidedSpec, seed: int, tok: Tokenizer) -> tuple[str, bool]:
    """Random logits under the grammar's mask until EOS or BUDGET tokens: (text, ended with EOS)."""
    gen = torch.Generator().manual_seed(seed)
    matcher = GrammarMatcher(compiler.compile(spec))
    ids: list[int] = []
    for _ in range(BUDGET):
        bitmask = fill_bitmasks([matcher])
        assert bitmask is not None
        logits = torch.randn(1, compiler.vocab_size, generator=gen)
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert matcher.accept(token), matcher.error
        if token in tok.eos_token_ids:
            assert matcher.is_terminated()
            return tok.decode(ids), True
        ids.append(token)
    return tok.decode(ids), False


# ----------------------------------------------------------------------------------------------
# Random sampling under the mask: always valid, and finished within the budget.


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sampling_follows_json_schema(compiler: GrammarCompiler, tok: Tokenizer, seed: int) -> None:
    text, ended = _sample(compiler, GuidedSpec.for_json_schema(SCHEMA), seed, tok)
    assert ended, text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "  " not in text and "\n" not in text  # at most one space, after ',' or ':'


def test_random_sampling_json_object(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    # Free-form JSON has no bound a random model is pushed to: some seeds finish, all are valid.
    results = [_sample(compiler, GuidedSpec("json_object", ""), seed, tok) for seed in SEEDS]
    finished = [text for text, ended in results if ended]
    assert finished
    for text in finished:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sampling_regex(compiler: GrammarCompiler, tok: Tokenizer, seed: int) -> None:
    pattern = r"[a-z]{1,6}@(example|test)\.(com|org)"
    text, ended = _sample(compiler, GuidedSpec("regex", pattern), seed, tok)
    assert ended and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sampling_choice(compiler: GrammarCompiler, tok: Tokenizer, seed: int) -> None:
    choices = ["alpha", "beta", "gamma delta", "42"]
    text, ended = _sample(compiler, GuidedSpec("choice", json.dumps(choices)), seed, tok)
    assert ended and text in choices, text


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sampling_lark_grammar(compiler: GrammarCompiler, tok: Tokenizer, seed: int) -> None:
    grammar = 'start: "(" NUM ("," NUM){0,3} ")"\nNUM: /[0-9]{1,3}/'
    text, ended = _sample(compiler, GuidedSpec("grammar", grammar), seed, tok)
    assert ended and re.fullmatch(r"\(\d{1,3}(,\d{1,3}){0,3}\)", text), text


def test_gbnf_grammar_is_converted(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    matcher = GrammarMatcher(compiler.compile(GuidedSpec("grammar", 'root ::= "yes" | "no"')))
    assert all(matcher.accept(t) for t in tok.encode("no", add_special_tokens=False))
    assert matcher.is_terminated()


# ----------------------------------------------------------------------------------------------
# EOS, errors, rows without a grammar, wide vocabularies.


def test_eos_only_where_the_grammar_accepts(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    eos = set(tok.eos_token_ids)
    assert len(eos) == 2 and set(compiler.eos_token_ids) == eos
    choice = GrammarMatcher(compiler.compile(GuidedSpec("choice", json.dumps(["yes", "no"]))))
    assert not _allowed(fill_bitmasks([choice])) & eos
    for t in tok.encode("yes", add_special_tokens=False):
        assert not choice.is_terminated()
        assert choice.accept(t)
    assert choice.is_terminated()
    assert _allowed(fill_bitmasks([choice])) == eos  # complete: only EOS may follow

    regex = GrammarMatcher(compiler.compile(GuidedSpec("regex", "a+")))
    assert regex.accept(tok.encode("a", add_special_tokens=False)[0])
    allowed = _allowed(fill_bitmasks([regex]))
    assert eos <= allowed and len(allowed) > len(eos) and not regex.is_terminated()


def test_a_forbidden_token_is_refused_and_leaves_only_eos(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    matcher = GrammarMatcher(compiler.compile(GuidedSpec("regex", "[0-9]+")))
    assert matcher.error is None
    assert not matcher.accept(tok.encode("x", add_special_tokens=False)[0])
    assert matcher.error and matcher.is_terminated()
    assert _allowed(fill_bitmasks([matcher])) == set(tok.eos_token_ids)  # never an all -inf row


def test_matchers_of_one_grammar_are_independent(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    grammar = compiler.compile(GuidedSpec("choice", json.dumps(["yes", "no"])))
    first, second = GrammarMatcher(grammar), GrammarMatcher(grammar)
    for t in tok.encode("yes", add_special_tokens=False):
        first.accept(t)
    assert first.is_terminated() and not second.is_terminated()
    assert _allowed(fill_bitmasks([second])) == _allowed(fill_bitmasks([GrammarMatcher(grammar)]))


def test_rollback(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    matcher = GrammarMatcher(compiler.compile(GuidedSpec("choice", json.dumps(["yes", "no"]))))
    start = _allowed(fill_bitmasks([matcher]))
    ids = tok.encode("yes", add_special_tokens=False)
    for t in ids:
        matcher.accept(t)
    matcher.rollback(len(ids))
    assert not matcher.is_terminated() and _allowed(fill_bitmasks([matcher])) == start


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedSpec.for_json_schema({"type": "foo"}), "(?s)json_schema.*foo"),
        (GuidedSpec("json_schema", "{not json"), "json_schema"),
        (GuidedSpec("regex", "a(b"), "(?s)regex.*unclosed group"),
        (GuidedSpec("grammar", "start: undefined_rule"), "(?s)grammar.*undefined_rule"),
        (GuidedSpec("grammar", 'root ::= ( "a"'), "(?s)grammar.*GBNF"),
        (GuidedSpec("choice", "[]"), "choice"),
    ],
)
def test_uncompilable_grammars_raise(compiler: GrammarCompiler, spec: GuidedSpec, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)


def test_compile_is_cached_lru(tok: Tokenizer) -> None:
    compiler = GrammarCompiler(tok, TINY_VOCAB_SIZE, cache_size=2)
    a, b, c = (GuidedSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GuidedSpec("regex", "a+")) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent; c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first
    assert compiler.compile(GuidedSpec.for_json_schema(SCHEMA)) is compiler.compile(GuidedSpec.for_json_schema(SCHEMA))


def test_rows_without_a_grammar_are_all_allowed(compiler: GrammarCompiler) -> None:
    assert fill_bitmasks([None, None]) is None
    matcher = GrammarMatcher(compiler.compile(GuidedSpec("regex", "[0-9]+")))
    bitmask = fill_bitmasks([None, matcher, None])
    assert bitmask is not None and bitmask.shape == (3, compiler.mask_words)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert 0 < torch.isfinite(logits[1]).sum() < 50


def test_batched_fill_matches_one_by_one_and_reuses_out(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    grammars = [compiler.compile(GuidedSpec.for_json_schema(SCHEMA)), compiler.compile(GuidedSpec("regex", "a+"))]
    matchers: list[GrammarMatcher | None] = [GrammarMatcher(grammars[i % 2]) for i in range(6)]
    matchers[1].accept(tok.encode("{", add_special_tokens=False)[0])
    matchers[4] = None
    out = torch.zeros(8, compiler.mask_words, dtype=torch.int32)
    batched = fill_bitmasks(matchers, out=out)
    assert batched is not None and batched.shape[0] == 6 and batched.data_ptr() == out.data_ptr()
    single = torch.zeros(1, compiler.mask_words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is None:
            assert (batched[i] == -1).all()
        else:
            m.fill_bitmask(single, 0)
            assert torch.equal(batched[i], single[0])
    with pytest.raises(ValueError, match="bitmask"):
        fill_bitmasks(matchers, out=torch.zeros(8, compiler.mask_words, dtype=torch.int64))


def test_logits_wider_than_the_tokenizer_mask_the_extra_ids(tok: Tokenizer) -> None:
    wide = GrammarCompiler(tok, TINY_VOCAB_SIZE + 40)  # e.g. an embedding padded to a multiple of 64
    assert wide.mask_words == (TINY_VOCAB_SIZE + 40 + 31) // 32
    for spec in (GuidedSpec("json_object", ""), GuidedSpec("regex", "(.|\n)*")):
        matcher = GrammarMatcher(wide.compile(spec))
        bitmask = fill_bitmasks([matcher])
        logits = torch.randn(1, wide.vocab_size)
        apply_bitmask(logits, bitmask)
        assert torch.isfinite(logits[0, :TINY_VOCAB_SIZE]).any()
        assert torch.isinf(logits[0, TINY_VOCAB_SIZE:]).all()
    # A mask narrower than the logits (e.g. built for the tokenizer's vocabulary) disallows the rest.
    logits = torch.zeros(2, TINY_VOCAB_SIZE + 40)
    apply_bitmask(logits, torch.full((2, TINY_VOCAB_SIZE // 32), -1, dtype=torch.int32))
    assert torch.isfinite(logits[:, :TINY_VOCAB_SIZE]).all() and torch.isinf(logits[:, TINY_VOCAB_SIZE:]).all()


def test_apply_bitmask_matches_the_bit_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=gen, dtype=torch.int32)
    logits = torch.zeros(3, 120)
    apply_bitmask(logits, bitmask)
    for row in range(3):
        for t in range(120):
            allowed = (int(bitmask[row, t // 32]) >> (t % 32)) & 1
            assert torch.isfinite(logits[row, t]) == bool(allowed)
    with pytest.raises(ValueError, match="bitmask"):
        apply_bitmask(torch.zeros(2, 120), bitmask)


# ----------------------------------------------------------------------------------------------
# Request fields -> GuidedSpec.


def test_spec_from_response_format() -> None:
    assert GuidedSpec.from_response_format(None) is None
    assert GuidedSpec.from_response_format({"type": "text"}) is None
    assert GuidedSpec.from_response_format({"type": "json_object"}) == GuidedSpec("json_object", "")
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    spec = GuidedSpec.from_response_format(rf)
    assert spec == GuidedSpec.for_json_schema(SCHEMA) and json.loads(spec.value) == SCHEMA
    assert list(json.loads(spec.value)["properties"]) == ["color", "count", "done"]  # order kept


def test_spec_from_vllm_fields() -> None:
    assert GuidedSpec.from_request() is None
    assert GuidedSpec.from_request(guided_json=SCHEMA) == GuidedSpec.for_json_schema(SCHEMA)
    assert GuidedSpec.from_request(guided_json=json.dumps(SCHEMA)) == GuidedSpec.for_json_schema(SCHEMA)
    assert GuidedSpec.from_request(guided_regex="a+") == GuidedSpec("regex", "a+")
    assert GuidedSpec.from_request(guided_choice=["a", "b"]) == GuidedSpec("choice", '["a", "b"]')
    assert GuidedSpec.from_request(guided_grammar="start: /a/") == GuidedSpec("grammar", "start: /a/")
    so = GuidedSpec.from_request
    assert so(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}) == GuidedSpec.for_json_schema(SCHEMA)
    assert so(structured_outputs={"regex": "a+", "choice": None}) == GuidedSpec("regex", "a+")
    assert so(structured_outputs={"choice": ["x"]}) == GuidedSpec("choice", '["x"]')
    assert so(structured_outputs={"grammar": "start: /a/"}) == GuidedSpec("grammar", "start: /a/")
    assert so(structured_outputs={"json_object": True}) == GuidedSpec("json_object", "")
    assert so(structured_outputs={"json_object": False}) is None
    assert so(response_format={"type": "text"}, guided_regex="a") == GuidedSpec("regex", "a")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, r"json_schema\.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, r"json_schema\.schema"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_grammar": 7}, "guided_grammar"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "regex, structured_outputs.choice"),
    ],
)
def test_malformed_requests_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GuidedSpec.from_request(**kwargs)
