"""Structured output: a JSON object, a JSON schema, a grammar, a regex, a choice of strings or a
structural tag, enforced while sampling with xgrammar.

Each constrained request holds a grammar matcher. Before a step samples, every active matcher writes
the tokens that can continue a valid document into a bitmask, and the others' logits become -inf; after
the step the sampled token advances the matcher. A document that is complete allows only the stop
tokens, so the request then stops. With a start token (the end of a reasoning block) the matcher stays
inactive, and the text unconstrained, until that token is sampled.

Masks need each sampled token on the host before the next step, so steps over constrained requests run
synchronously (no decode-ahead). Logprobs are those of the constrained distribution. xgrammar is an
optional dependency (`pip install deltaserve[structured]`); without it such requests are rejected.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from deltaserve.engine.schema_rules import SchemaRuleError, check_schema
from deltaserve.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    import torch
    import xgrammar

    from deltaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def grammars_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def grammar_vocabulary(tokenizer: Tokenizer) -> list[str]:
    """Token id -> its byte-level string; special tokens are never text, so empty (never allowed)."""
    special = tokenizer.special_token_ids
    return ["" if i in special else tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]


class StructuredOutputError(ValueError):
    """The request's structured output cannot be served (no xgrammar, a schema it cannot compile or
    would not enforce: schema_rules.py)."""


# xgrammar prefixes its messages with a log time and its C++ source position: "[12:00:00] /x/y.cc:42: ".
_XGRAMMAR_PREFIX = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: ")


def compiler_message(err: Exception) -> str:
    """xgrammar's message for a client: its text without the log prefix and source paths."""
    return _XGRAMMAR_PREFIX.sub("", str(err)).strip()


# The compiled grammars a backend keeps for reuse, by size: 0.2 MB (a two-field object) to 2.2 MB (200
# fields) each over Qwen3.5's vocabulary, so an agent server sending a new schema per request would
# otherwise grow without end.
COMPILED_GRAMMAR_CACHE_BYTES = 512 * 2**20


class CompiledGrammars:
    """Compiled grammars by specification key, least recently used first out once their sizes pass
    `limit_bytes` (the newest always stays). Safe across the scheduler and compile threads."""

    def __init__(self, limit_bytes: int = COMPILED_GRAMMAR_CACHE_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[tuple[object, ...], tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...]) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple[object, ...], compiled: xgrammar.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (compiled, size)
            self._bytes += size
            while self._bytes > self.limit_bytes and len(self._entries) > 1:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


class GrammarBackend:
    """Compiles grammars for one tokenizer and caches them by specification.

    The compiler (xgrammar, the vocabulary, the built-in JSON grammar: about 2 s on CPU) is built with
    the backend, so before the engine reports ready: built on the first structured-output request it
    would stall that request's caller, the scheduler thread, and every stream with it. (Built on a
    background thread while serving, it stalls them all the same: it holds the GIL for seconds at a
    time. The engine builds it during start-up, beside the model's warm-up.)
    """

    def __init__(
        self,
        vocabulary: Callable[[], list[str]],
        stop_token_ids: Sequence[int],
        cache_bytes: int = COMPILED_GRAMMAR_CACHE_BYTES,
    ) -> None:
        self._vocabulary = vocabulary
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.vocab_size = 0
        # The one cache of compiled grammars (xgrammar's own is off: unbounded, and a second copy).
        self._compiled = CompiledGrammars(cache_bytes)
        self._executor: ThreadPoolExecutor | None = None  # the compile thread, started on first use
        if grammars_available():
            try:
                self.grammar(StructuredOutputParams(json_object=True))  # the compiler, and a first grammar
            except Exception:  # the first structured-output request reports it
                logger.exception("building the grammar compiler failed")

    def _compiler_for_vocabulary(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        if self._compiler is None:
            vocab = self._vocabulary()
            info = xgr.TokenizerInfo(
                vocab,
                vocab_type=xgr.VocabType.BYTE_LEVEL,
                vocab_size=len(vocab),
                stop_token_ids=self._stop_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            self.vocab_size = len(vocab)
        return self._compiler

    def grammar(self, spec: StructuredOutputParams) -> RequestGrammar:
        try:
            import xgrammar  # noqa: F401 (its absence is the request's error, not an ImportError)
        except ImportError as err:
            raise StructuredOutputError(
                "structured output needs the xgrammar package on the server (pip install deltaserve[structured])"
            ) from err
        compiler = self._compiler_for_vocabulary()
        key = grammar_key(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            if spec.json_schema is not None:
                try:
                    check_schema(json.loads(spec.json_schema))
                except (SchemaRuleError, RecursionError, ValueError) as err:
                    raise StructuredOutputError(f"the JSON schema cannot be served: {err}") from err
            compiled = _compile(compiler, spec)
            self._compiled.put(key, compiled)
        return self._request_grammar(compiled, spec)

    def cached(self, spec: StructuredOutputParams) -> RequestGrammar | None:
        """The grammar when `spec` is compiled already (a new matcher over it: no compilation), else None."""
        compiled = self._compiled.get(grammar_key(spec))
        return None if compiled is None else self._request_grammar(compiled, spec)

    def _request_grammar(
        self, compiled: xgrammar.CompiledGrammar, spec: StructuredOutputParams
    ) -> RequestGrammar:
        """A request's own matcher over a compiled grammar."""
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), spec.start_after_token_id, self.vocab_size)

    def compile_in_background(
        self, spec: StructuredOutputParams, done: Callable[[], None]
    ) -> Future[RequestGrammar]:
        """grammar(spec) on the backend's compile thread (one; specifications queue in order), then
        `done()`. xgrammar's compilation leaves the interpreter to other threads most of the time: on
        the caller's thread a 1.1 s compilation stalled it whole, beside it the caller's longest pause
        was 4 ms. The future holds the grammar or the StructuredOutputError."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="deltaserve-grammar-compile"
            )
        future = self._executor.submit(self.grammar, spec)
        future.add_done_callback(lambda _: done())
        return future

    def forget(self) -> None:
        """Drops the compiled grammars kept for reuse (the compiler itself stays)."""
        self._compiled.clear()


def grammar_key(spec: StructuredOutputParams) -> tuple[object, ...]:
    """What a compiled grammar depends on: every kind of specification (and nothing else)."""
    choice = None if spec.choice is None else tuple(spec.choice)
    return (spec.json_object, spec.json_schema, spec.ebnf, spec.regex, choice, spec.structural_tag)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF of exactly one of `choices` (literal strings)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# A JSON object (json_object): any properties, but an object, never another JSON value.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _compile(compiler: xgrammar.GrammarCompiler, spec: StructuredOutputParams) -> xgrammar.CompiledGrammar:
    """Raises StructuredOutputError with xgrammar's reason."""
    kind = spec.kinds[0] if spec.kinds else "structured output"
    try:
        if spec.json_object:
            return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
        if spec.json_schema is not None:
            return compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_grammar(spec.choice))
        if spec.structural_tag is not None:
            return compiler.compile_structural_tag(spec.structural_tag)
        assert spec.ebnf is not None, "validate() admits exactly one kind"
        return _compile_ebnf_or_lark(compiler, spec.ebnf)
    except StructuredOutputError:
        raise
    except Exception as err:  # xgrammar raises RuntimeError/ValueError with its parser's message
        what = {"json_schema": "JSON schema", "ebnf": "grammar", "json_object": "JSON grammar"}.get(
            kind, kind
        )
        raise StructuredOutputError(f"the {what} cannot be compiled: {compiler_message(err)}") from err


def _compile_ebnf_or_lark(compiler: xgrammar.GrammarCompiler, grammar: str) -> xgrammar.CompiledGrammar:
    """xgrammar's EBNF, else (vLLM accepts both) a Lark grammar; the EBNF error is the one reported."""
    try:
        return compiler.compile_grammar(grammar)
    except Exception as ebnf_error:
        try:
            return compiler.compile_lark(grammar)
        except Exception:
            raise StructuredOutputError(
                f"the grammar cannot be compiled as EBNF (nor as Lark): {compiler_message(ebnf_error)}"
            ) from ebnf_error


class RequestGrammar:
    """One request's matcher. Inactive (no constraint) until its start token, if it has one."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, start_after: int | None, vocab_size: int) -> None:
        self.matcher = matcher
        self.start_after = start_after
        self.active = start_after is None
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        """Advances on a sampled token; False if the grammar forbids it (the request then fails)."""
        if not self.active:
            self.active = token == self.start_after
            return True
        return bool(self.matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        """The document is complete and a stop token ended it."""
        return self.active and self.matcher.is_terminated()


def apply_grammars(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Masks, in place, the tokens each row's active grammar forbids (row i of `logits` is grammars[i])."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    import xgrammar as xgr

    vocab_size = next(g.vocab_size for g in grammars if g is not None)
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.matcher.fill_next_token_bitmask(bitmask, i)
    _apply_bitmask(logits, bitmask, vocab_size, rows)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: list[int]) -> None:
    """Masks `rows` of `logits` in place by the host `bitmask` (xgrammar's layout, `vocab_size` ids)."""
    import xgrammar as xgr

    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=min(vocab_size, logits.shape[1]), indices=rows
    )


# Masked-row counts that take each specialisation of xgrammar's CUDA mask kernel (Triton specialises an
# integer argument equal to 1 and one divisible by 16).
WARM_MASK_ROWS = (1, 2, 16)


def warm_grammar_masks(grammars: GrammarBackend, logits_width: int, device: torch.device) -> None:
    """Applies all-allowing masks on `device` at WARM_MASK_ROWS rows, so that the first structured-output
    step under load neither compiles xgrammar's mask kernel nor loads it (a kernel's first launch waits
    for the work queued on the device) while every decoder waits. Nothing to do on CPU, or without a
    compiler (structured output unavailable)."""
    if device.type != "cuda" or grammars.vocab_size == 0:
        return
    import torch
    import xgrammar as xgr

    for rows in WARM_MASK_ROWS:
        logits = torch.zeros(rows, logits_width, device=device)
        bitmask = xgr.allocate_token_bitmask(rows, grammars.vocab_size)  # all allowed
        _apply_bitmask(logits, bitmask, grammars.vocab_size, list(range(rows)))
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("xgrammar's mask kernel masked tokens an all-allowing bitmask allows")
