"""Offline API, in the shape vLLM users know:

    llm = LLM(model=DIR, dtype="float32", device="cpu")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0))
    outs = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=16))

Requests run through the same EngineCore and scheduler the server uses, in-process on a thread.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from deltaserve.config import read_sampling_defaults
from deltaserve.engine.core import EngineCore
from deltaserve.engine.output import OutputState, RequestOutput
from deltaserve.engine.protocol import AbortRequest, AddRequest, ResetPrefixCache, StepOutputs
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import RequestValidationError
from deltaserve.sampling_params import SamplingParams, bad_word_sequences
from deltaserve.tiny import RANDOM_WEIGHTS_NOTE
from deltaserve.tokenizer import Tokenizer
from deltaserve.vllm_flags import offline_engine_kwargs

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """`engine_kwargs` are the engine flags by their vLLM names (dtype, device, max_model_len,
        max_num_seqs, max_num_batched_tokens, scheduler_policy, load_format, seed, ...), and vLLM's other
        LLM() arguments, checked as their `vllm serve` flags are (trust_remote_code, tokenizer,
        quantization, kv_cache_dtype, block_size, swap_space, ...: deltaserve.vllm_flags)."""
        fields = set(EngineConfig.__dataclass_fields__) - {"model", "extra"}
        engine_kwargs = offline_engine_kwargs(model, engine_kwargs, fields)
        if model is None:
            print(RANDOM_WEIGHTS_NOTE, file=sys.stderr, flush=True)
        self.engine = EngineCore(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = Tokenizer.from_dir(self.engine.model_dir)
        self._outputs: queue.SimpleQueue[StepOutputs] = queue.SimpleQueue()
        self.engine.start(self._outputs.put)
        # An LLM dropped without shutdown() (a function's local, a notebook cell run again) stops its
        # engine when it is collected: its scheduler thread would otherwise run on, holding the model
        # and its pools for the life of the process. At interpreter exit too.
        self._finalizer = weakref.finalize(self, self.engine.shutdown, "LLM dropped")

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with `n` completions (each its own engine request).
        Invalid prompts or parameters raise before anything is submitted; a request the engine rejects
        or fails comes back with `error` set."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        states: dict[str, OutputState] = {}
        salts: dict[str, str | None] = {}
        order: list[str] = []
        choices: list[list[str]] = []  # per prompt, its choices' engine request ids
        for prompt, params in zip(prompts, params_list, strict=True):
            text, token_ids, salt = self._tokenize(prompt)
            if params.bad_words:
                words = bad_word_sequences(params.bad_words, self.tokenizer.encode)
                params = dataclasses.replace(params, bad_words=None, bad_words_token_ids=words)
            per_choice = params.per_choice(params.n)  # validates n
            per_choice[0].validate()
            per_choice[0].validate_token_ids(self.engine.info.vocab_size)
            choices.append([])
            for choice_params in per_choice:
                rid = uuid.uuid4().hex
                states[rid] = OutputState(rid, text, token_ids, choice_params, self.tokenizer)
                salts[rid] = salt
                order.append(rid)
                choices[-1].append(rid)
        now = time.monotonic()
        for rid in order:
            st = states[rid]
            self.engine.submit(
                AddRequest(rid, st.prompt_token_ids, st.params, arrival_time=now, cache_salt=salts[rid])
            )
        pending = set(order)
        while pending:
            for update in self._outputs.get().updates:
                st = states.get(update.request_id)
                if st is None or st.finished:
                    continue
                delta = st.apply(update)
                if delta.abort_engine:
                    self.engine.submit(AbortRequest(update.request_id))
                if st.finished:
                    pending.discard(update.request_id)
        return [_joined([states[rid].to_output() for rid in ids]) for ids in choices]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json sampling defaults (vLLM's)."""
        return SamplingParams(**read_sampling_defaults(self.engine.model_dir / "generation_config.json"))  # type: ignore[arg-type]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or several (a list of them) through the model's
        chat template, then `generate`: one RequestOutput per conversation. The text is the raw output,
        reasoning included (as vLLM's LLM.chat); chat_template_kwargs={"enable_thinking": False} turns
        thinking off."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                list(conversation),  # type: ignore[arg-type]
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of a prompt: a string, or vLLM's {"prompt": text} or
        {"prompt_token_ids": [...]}, either with an optional "cache_salt" (only requests with the same
        salt share cached prefixes)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), None
        if not isinstance(prompt, dict) or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise RequestValidationError(
                "prompt",
                "a prompt must be a string, {'prompt': text} or {'prompt_token_ids': [...]}, "
                f"got {prompt!r}",
            )
        extra = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
        if extra:
            raise RequestValidationError(
                extra[0],
                f"prompt keys must be among prompt, prompt_token_ids and cache_salt (text only), got {extra[0]!r}",
            )
        salt = prompt.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and salt):
            raise RequestValidationError("cache_salt", f"cache_salt must be a non-empty string, got {salt!r}")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise RequestValidationError("prompt", f"prompt must be a string, got {text!r}")
            return text, self.tokenizer.encode(text), salt
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestValidationError(
                "prompt_token_ids", f"prompt_token_ids must be a list of ints, got {ids!r}"
            )
        return None, list(ids), salt

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page and state snapshot (the next tick of the engine)."""
        self.engine.submit(ResetPrefixCache())

    def shutdown(self) -> None:
        self._finalizer.detach()
        self.engine.shutdown("LLM shut down")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's choices as one RequestOutput: outputs[j] is choice j (index j)."""
    first = outputs[0]
    for j, out in enumerate(outputs[1:], start=1):
        completion = out.outputs[0]
        completion.index = j
        first.outputs.append(completion)
        first.finished = first.finished and out.finished
        if first.error is None and out.error is not None:
            first.error, first.error_field = out.error, out.error_field
    return first
