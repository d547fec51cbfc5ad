"""The multi-turn chat workload of `bench serve --dataset-name multi-turn`.

N conversations of T turns over /v1/chat/completions. Every conversation opens with the same system
prompt (so all of them share that prefix); conversation i has its own T user messages. Turn k sends the
system prompt, turns 1..k-1 (each user message followed by the answer text the server returned for it)
and user message k, as a chat client does. A conversation sends its turns one after another; the caller
decides how many conversations run at once.

Lengths: texts are words of `words.WORDS` joined by single spaces, so a system prompt of S words is S
tokens and a user message of U words is U tokens under the Qwen3.5 tokenizer (approximately under
another). The chat template adds a few tokens per message (5 for a Qwen3.5 user turn). Each answer is
`output_len` tokens when the request carries ignore_eos; its text, re-tokenized inside the next turn's
prompt, need not be exactly `output_len` tokens.

What a prefix cache can reuse: every prompt shares the system message; turn k's prompt extends turn
k-1's prompt up to the assistant's opening tokens (the Qwen3.5 template renders earlier answers without
the think block that opened them), then differs where the answer text starts.

Texts are reproducible from the seed: the system prompt from (seed, 0), conversation i's messages from
(seed, 1, i), so the first conversations are the same whatever the number of conversations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from deltaserve.bench.client import Endpoint, chat_payload, send_payload
from deltaserve.bench.metrics import RequestRecord
from deltaserve.bench.words import WORDS


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    user_messages: tuple[str, ...]  # one per turn


@dataclass(frozen=True, slots=True)
class MultiTurnDataset:
    system_prompt: str  # "" when there is no system message
    conversations: tuple[Conversation, ...]
    output_len: int


@dataclass(slots=True)
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    record: RequestRecord


def word_text(rng: np.random.Generator, num_words: int) -> str:
    """`num_words` words drawn uniformly from WORDS, joined by single spaces."""
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words))


def multi_turn_dataset(
    num_conversations: int,
    num_turns: int,
    system_prompt_len: int,
    user_len: int,
    output_len: int,
    seed: int = 0,
) -> MultiTurnDataset:
    for flag, value, least in [
        ("--num-prompts", num_conversations, 1),
        ("--multi-turn-num-turns", num_turns, 1),
        ("--multi-turn-system-prompt-len", system_prompt_len, 0),
        ("--multi-turn-user-len", user_len, 1),
        ("--multi-turn-output-len", output_len, 1),
        ("--seed", seed, 0),
    ]:
        if value < least:
            raise ValueError(f"{flag} must be >= {least} for the multi-turn dataset, got {value}")
    system_prompt = word_text(np.random.default_rng([seed, 0]), system_prompt_len)
    conversations = []
    for i in range(num_conversations):
        rng = np.random.default_rng([seed, 1, i])
        conversations.append(Conversation(i, tuple(word_text(rng, user_len) for _ in range(num_turns))))
    return MultiTurnDataset(system_prompt, tuple(conversations), output_len)


async def converse(
    endpoint: Endpoint, dataset: MultiTurnDataset, conversation: Conversation
) -> list[TurnRecord]:
    """Send the conversation's turns in order. A failed turn ends the conversation: its later turns are
    recorded as failed without being sent (their prompt would not be the one asked for)."""
    messages = [{"role": "system", "content": dataset.system_prompt}] if dataset.system_prompt else []
    turns: list[TurnRecord] = []
    for turn, user_message in enumerate(conversation.user_messages, start=1):
        if turns and not turns[-1].record.success:
            error = f"not sent: turn {turns[-1].turn} of conversation {conversation.index} failed"
            turns.append(
                TurnRecord(
                    conversation.index, turn, RequestRecord(False, error, time.perf_counter(), [], 0, 0)
                )
            )
            continue
        messages.append({"role": "user", "content": user_message})
        payload = chat_payload(endpoint, messages, dataset.output_len)
        record = await send_payload(endpoint, payload, prompt_len=0)
        turns.append(TurnRecord(conversation.index, turn, record))
        messages.append({"role": "assistant", "content": record.generated_text})
    return turns
