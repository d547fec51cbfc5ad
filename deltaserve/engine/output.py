"""Client-side output processing: incremental detokenization, stop strings, and the RequestOutput shape.

Engine updates carry token ids; the client turns them into text. A stop string is matched across token
boundaries in the accumulated text; when one is found the request finishes with finish_reason "stop"
and stop_reason the string, the text is cut before it (unless include_stop_str_in_output), and the
client aborts the engine request. While streaming, the last len(longest stop) - 1 characters are held
back, since they could be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.engine.protocol import RequestUpdate, TokenLogprobs
from deltaserve.sampling_params import SamplingParams
from deltaserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort | rejected | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set when finish_reason is rejected or error
    error_field: str | None = None
    # Asked-for prompt logprobs: entry i scores prompt token i (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class OutputDelta:
    """What one engine update added to a request, after detokenization and stop strings."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_field: str | None = None
    abort_engine: bool = False  # a stop string ended it: the engine must be told to stop generating
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first delta, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class OutputState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_field: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    _detok: IncrementalDetokenizer | None = field(default=None, init=False, repr=False)
    _holdback: int = field(default=0, init=False, repr=False)  # length of the longest stop string
    # The text decoded so far (stop strings already cut) is the pieces handed out as deltas, then the
    # unsent rest: once an update is applied, at most the longest stop string's length - 1 characters
    # (a stop string may still start there). Kept apart so that a long output is never copied whole
    # per token; stop strings are only ever searched for in the unsent rest.
    _sent: list[str] = field(default_factory=list, init=False, repr=False)
    _unsent: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self._detok = self.tokenizer.new_detokenizer(skip_special_tokens=self.params.skip_special_tokens)
        self._holdback = max((len(s) for s in self.params.stop or ()), default=0)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text decoded so far, stop strings already cut."""
        return "".join(self._sent) + self._unsent

    def apply(self, update: RequestUpdate) -> OutputDelta:
        """Invariant: applying an update of several tokens gives what applying one update per token
        would (an engine step may emit several: speculation, or a client catching up): with stop
        strings the tokens are matched one at a time, and the output ends at the token that completed
        a match, the rest dropped as later updates would have been."""
        if self.finished:  # a stop string already ended it; late engine updates are dropped
            return OutputDelta("", [], None)
        tokens = update.new_token_ids
        self.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        finish, stop_reason = update.finish_reason, update.stop_reason
        abort = False
        if self._detok is not None and tokens:
            pieces = [[t] for t in tokens] if self._holdback else [tokens]
            for i, piece in enumerate(pieces):
                start = max(0, len(self._unsent) - self._holdback + 1)
                self._unsent += self._detok.push(piece)
                last = i == len(pieces) - 1
                if last and finish is not None:
                    self._unsent += self._detok.flush()
                matched = self._match_stop(start)
                if matched is not None and finish not in ("rejected", "error"):
                    finish, stop_reason = "stop", matched
                    abort = update.finish_reason is None
                    tokens = tokens[: i + 1]  # a match needs stop strings: one token a piece
                    break
        new_logprobs = update.new_logprobs[: len(tokens)] if update.new_logprobs else None
        self.token_ids.extend(tokens)
        if self.logprobs is not None and new_logprobs:
            self.logprobs.extend(new_logprobs)
        self.finish_reason, self.stop_reason = finish, stop_reason
        self.error, self.error_field = update.error, update.error_field
        unsent = self._unsent
        end = len(unsent) if finish is not None else max(0, len(unsent) - max(self._holdback - 1, 0))
        if end:
            self._sent.append(unsent[:end])
            self._unsent = unsent[end:]
        delta = OutputDelta(
            text=unsent[:end],
            token_ids=list(tokens),
            logprobs=new_logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            error=update.error,
            error_field=update.error_field,
            abort_engine=abort,
            num_prompt_tokens=update.num_prompt_tokens or len(self.prompt_token_ids),
            num_output_tokens=len(self.token_ids),
            num_cached_tokens=update.num_cached_tokens,
            prompt_logprobs=update.prompt_logprobs,
        )
        return delta

    def _match_stop(self, start: int) -> str | None:
        """Finds the earliest stop string starting at or after `start` of the unsent text; cuts the
        text there."""
        best: tuple[int, str] | None = None
        unsent = self._unsent
        for stop in self.params.stop or ():
            pos = unsent.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self._unsent = unsent[: pos + len(stop)] if self.params.include_stop_str_in_output else unsent[:pos]
        return stop

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            0, self.text, list(self.token_ids), self.logprobs, self.finish_reason, self.stop_reason
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            finished=self.finished,
            error=self.error,
            error_field=self.error_field,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
