"""Per-request sampling parameters: vLLM's names and defaults, every field validated.

Construction only normalises (`stop` and `stop_token_ids` become lists); `validate()` and
`validate_token_ids()` are the checks the engine runs at admission, before a request can reach the sampler.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltaserve.errors import RequestValidationError, UnsupportedRequestError

# Any temperature below this is greedy decoding, as in vLLM: dividing logits by it overflows the useful
# float32 range, and the distribution it describes is the argmax up to rounding.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_N = 128  # choices per prompt; each is its own engine request, so the prompt is computed n times
SEED_LIMIT = 2**63  # seeds are int64 values: [-2**63, 2**63), as OpenAI-style clients send any integer
INT64_MAX = 2**63 - 1  # every integer field travels to the engine as msgpack int64

_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _invalid(field: str, expected: str, found: object) -> RequestValidationError:
    return RequestValidationError(field, f"{field} must be {expected}, got {found!r}")


# (field, predicate on a real number, expected) for the float-valued fields.
_REAL_RANGES = (
    ("temperature", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
)


def check_choices(n: object) -> None:
    """`n` as a number of choices fanned out by a client (the engine itself runs one per request)."""
    if not (_is_int(n) and 1 <= n <= MAX_N):
        raise _invalid("n", f"an integer in [1, {MAX_N}]", n)


@dataclass(slots=True)
class StructuredOutputParams:
    """Output constrained while sampling (engine/structured.py), by exactly one of: a JSON object
    (`json_object`), a JSON schema given as JSON text, an EBNF grammar (xgrammar's dialect; a Lark
    grammar is accepted too), a regular expression, a choice of exact strings, or an xgrammar
    structural tag given as JSON text (the server's forced tool calls). With `start_after_token_id` the
    constraint starts after that token (the end of a reasoning block), the text before it is free."""

    json_schema: str | None = None
    json_object: bool = False
    ebnf: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    structural_tag: str | None = None
    start_after_token_id: int | None = None

    @property
    def kinds(self) -> list[str]:
        """The constraints set (valid: exactly one)."""
        given = [name for name in _SPEC_KINDS if getattr(self, name) is not None]
        return (["json_object"] if self.json_object else []) + given

    def validate(self) -> None:
        if len(self.kinds) != 1:
            raise _invalid(
                "structured_output",
                "exactly one of json_object, json_schema, ebnf, regex, choice or structural_tag",
                self,
            )
        for name in ("json_schema", "structural_tag"):
            text = getattr(self, name)
            if text is None:
                continue
            try:
                value = json.loads(text)
            except (TypeError, ValueError) as err:
                raise _invalid("structured_output", f"{name} as JSON text ({err})", text) from None
            if not isinstance(value, dict):
                raise _invalid("structured_output", f"{name}: a JSON object", value)
        for name in ("ebnf", "regex"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise _invalid("structured_output", f"{name}: a string", getattr(self, name))
        if self.choice is not None and not (
            isinstance(self.choice, list)
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _invalid("structured_output", "choice: a non-empty list of non-empty strings", self.choice)


_SPEC_KINDS = ("json_schema", "ebnf", "regex", "choice", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None: the rest of the context window (the scheduler resolves it)
    min_tokens: int = 0
    stop: str | list[str] | None = None  # always a list after construction
    stop_token_ids: list[int] | None = None  # always a list after construction
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per output token; 0 = only the sampled token's logprob
    prompt_logprobs: int | None = None  # per prompt token: its logprob, rank and this many alternatives
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be sampled
    # vLLM's bad_words: words the output never completes. The offline LLM and the server turn them into
    # bad_words_token_ids (bad_word_sequences), which the engine applies: a sequence's last token is
    # never sampled right after the rest of it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below GREEDY_TEMPERATURE (vLLM's rule)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raises RequestValidationError (UnsupportedRequestError for refused features) naming the field,
        the expected and the found value. Checks fields in declaration order; the first fault wins."""
        self._validate_n()
        for field, in_range, expected in _REAL_RANGES:
            value = getattr(self, field)
            if not (_is_real(value) and in_range(value)):
                raise _invalid(field, expected, value)
        if not (_is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX):
            raise _invalid("top_k", "an integer: -1 or 0 (disabled) or in [1, 2**63)", self.top_k)
        if self.seed is not None and not (_is_int(self.seed) and -SEED_LIMIT <= self.seed < SEED_LIMIT):
            raise _invalid("seed", "None or an integer in [-2**63, 2**63)", self.seed)
        self._validate_lengths()
        self._validate_stops()
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _invalid("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and not (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise _invalid(
                "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs
            )
        self._validate_logit_bias()
        if self.bad_words:
            raise _invalid(
                "bad_words", "tokenized into bad_words_token_ids before the engine", self.bad_words
            )
        if self.bad_words_token_ids is not None and not (
            isinstance(self.bad_words_token_ids, list)
            and all(
                isinstance(w, list) and w and all(_is_int(t) for t in w) for w in self.bad_words_token_ids
            )
        ):
            raise _invalid(
                "bad_words", "None or a list of non-empty token id lists", self.bad_words_token_ids
            )
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, list)
            and self.allowed_token_ids
            and all(_is_int(t) for t in self.allowed_token_ids)
        ):
            raise _invalid(
                "allowed_token_ids", "None or a non-empty list of token ids", self.allowed_token_ids
            )
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise _invalid("structured_output", "None or StructuredOutputParams", self.structured_output)
            self.structured_output.validate()
            if self.min_tokens:
                # A complete document allows only stop tokens, which min_tokens would forbid: no token left.
                raise _invalid(
                    "min_tokens",
                    "0 with structured_output (the grammar decides where it ends)",
                    self.min_tokens,
                )
        for field in _BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                raise _invalid(field, "a boolean", getattr(self, field))

    def validate_token_ids(self, vocab_size: int) -> None:
        """Every id in stop_token_ids, allowed_token_ids and the logit_bias keys lies in the tokenizer's
        [0, vocab_size)."""
        for field in ("stop_token_ids", "allowed_token_ids"):
            for tok in getattr(self, field) or ():
                if not 0 <= tok < vocab_size:
                    raise _invalid(field, f"token ids in [0, {vocab_size})", tok)
        for word in self.bad_words_token_ids or ():
            for tok in word:
                if not 0 <= tok < vocab_size:
                    raise _invalid("bad_words", f"token ids in [0, {vocab_size})", tok)
        for tok in self.logit_bias or {}:
            if not 0 <= tok < vocab_size:
                raise _invalid("logit_bias", f"keyed by token ids in [0, {vocab_size})", tok)

    def suppressed_ids(
        self, step: int, outputs: Sequence[int], eos_token_ids: Sequence[int]
    ) -> tuple[int, ...]:
        """The ids that may not be sampled at output index `step` after `outputs`: the end-of-sequence
        (unless ignore_eos) and stop ids while min_tokens holds them back, and the ids that would
        complete a bad word."""
        suppressed: tuple[int, ...] = ()
        if step < self.min_tokens:
            suppressed = tuple(() if self.ignore_eos else eos_token_ids) + tuple(self.stop_token_ids or ())
        if self.bad_words_token_ids:
            suppressed += bad_word_ends(self.bad_words_token_ids, outputs)
        return suppressed

    def validate_samplable(self, eos_token_ids: Sequence[int]) -> None:
        """allowed_token_ids leaves a token to sample: one that no one-token bad word forbids, and while
        min_tokens holds them back, other than the end-of-sequence and stop ids. A row with every token
        forbidden has no distribution to draw from."""
        if not self.allowed_token_ids:
            return
        allowed = set(self.allowed_token_ids)
        if allowed <= set(self.suppressed_ids(self.min_tokens, (), eos_token_ids)):
            raise _invalid(
                "allowed_token_ids", "an id that bad_words does not forbid", self.allowed_token_ids
            )
        if allowed <= set(self.suppressed_ids(0, (), eos_token_ids)):
            raise _invalid(
                "allowed_token_ids",
                f"an id other than the end-of-sequence, stop and bad-word ids that min_tokens "
                f"({self.min_tokens}) holds back",
                self.allowed_token_ids,
            )

    def per_choice(self, n: int) -> list[SamplingParams]:
        """The engine requests of `n` choices (the engine runs one completion per request): the same
        parameters with n = 1, and a given seed becomes seed + j (wrapped into the int64 range), so seeded
        choices differ from each other and still reproduce."""
        check_choices(n)

        def seed(j: int) -> int | None:
            if self.seed is None:
                return None
            return (self.seed + j + SEED_LIMIT) % (2 * SEED_LIMIT) - SEED_LIMIT

        return [dataclasses.replace(self, n=1, seed=seed(j)) for j in range(n)]

    def _validate_n(self) -> None:
        if not (_is_int(self.n) and self.n >= 1):
            raise _invalid("n", "1", self.n)
        if self.n > 1:
            raise UnsupportedRequestError(
                "n", f"n > 1 is not supported (one completion per request), got {self.n}; send n requests"
            )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and not (
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX
        ):
            raise _invalid("max_tokens", "None or an integer in [1, 2**63)", self.max_tokens)
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= INT64_MAX):
            raise _invalid("min_tokens", "an integer in [0, 2**63)", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestValidationError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}; "
                "lower min_tokens or raise max_tokens",
            )

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, list):
            raise _invalid("stop", "a string or a list of strings", self.stop)
        for s in self.stop:
            if not (isinstance(s, str) and s):
                raise _invalid("stop", "a list of non-empty strings", s)
        if not isinstance(self.stop_token_ids, list):
            raise _invalid("stop_token_ids", "a list of token ids", self.stop_token_ids)
        for tok in self.stop_token_ids:
            if not _is_int(tok):
                raise _invalid("stop_token_ids", "a list of integer token ids", tok)

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise _invalid("logit_bias", "a mapping of token id to bias", self.logit_bias)
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok):
                raise _invalid("logit_bias", "keyed by integer token ids", tok)
            if not (_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise RequestValidationError(
                    "logit_bias", f"logit_bias[{tok}] must be a number in [-100, 100], got {bias!r}"
                )


def bad_word_ends(words: list[list[int]], outputs: Sequence[int]) -> tuple[int, ...]:
    """The tokens that would complete a bad word after `outputs`: a one-token word's always, a longer
    word's last when the output ends with the rest of it."""
    return tuple(
        w[-1]
        for w in words
        if len(w) == 1
        or (len(outputs) >= len(w) - 1 and list(outputs[len(outputs) - len(w) + 1 :]) == w[:-1])
    )


def bad_word_sequences(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as it is and after a space (so that it is banned at
    the start of the text and inside it), each spelling once."""
    sequences: list[list[int]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise _invalid("bad_words", "a list of non-empty strings", word)
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = encode(spelling)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
