"""The standard matrix (docs: "How deltaserve is measured") as named groups of `bench serve` cells.

A group is one server (one model shape, one set of flags) and the cells measured against it; each
group fits in 10 minutes on one H200, server start included. A cell is one or more `bench serve`
streams run at the same time (the mixed-load cell runs decoders and cold prefills together), each with
a warm-up run first: the same flags with another seed (so no prompt of the warm-up is a prefix of a
timed prompt), the cell's prompt length, at most `WARMUP_MAX_PROMPTS` prompts and short outputs. The
first prefill on a GPU autotunes kernels (~40 s), which the warm-up absorbs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

TIMED_SEED = 0
WARMUP_SEED_OFFSET = 1000
WARMUP_MAX_PROMPTS = 256  # the default --max-num-seqs: enough to fill the decode batch
WARMUP_MAX_OUTPUT = 16


@dataclass(frozen=True, slots=True)
class Stream:
    """One `bench serve` run: `flags` are its dataset and traffic flags (the runner adds the server URL,
    percentiles and result paths); `warmup_flags` the run before timing."""

    name: str  # "" when the cell has one stream
    flags: tuple[str, ...]
    warmup_flags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Cell:
    """Streams run concurrently; a cell without streams is a server start (the start-up group)."""

    name: str  # unique within the group; with the preset, the key of records.REFERENCES
    title: str
    streams: tuple[Stream, ...] = ()
    timeout_s: float = 300.0  # per run (warm-up or timed)


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    preset: str  # `deltaserve make-tiny --preset`
    model: str
    cells: tuple[Cell, ...]
    expected_wall_s: int  # on one H200, server start and warm-ups included
    server_flags: tuple[str, ...] = ()  # beyond --model, --load-format dummy, --port, --served-model-name
    startup: bool = False  # cells are server starts (ready time, first response), not bench runs
    public: bool = True  # listed in --help; hidden groups are CPU smoke tests


def random_stream(
    input_len: int,
    output_len: int,
    num_prompts: int,
    concurrency: int | None,
    *,
    request_rate: float | None = None,
    name: str = "",
    seed: int = TIMED_SEED,
    sampling: tuple[str, ...] = (),
) -> Stream:
    """vLLM's random dataset (token-id prompts of exactly `input_len`), ignore_eos; `sampling`: bench
    serve's sampling flags, for the warm-up too (default: greedy)."""

    def flags(prompts: int, out: int, run_seed: int, rate: float | None) -> tuple[str, ...]:
        f = ["--dataset-name", "random", "--random-input-len", str(input_len)]
        f += ["--random-output-len", str(out), "--ignore-eos", "--num-prompts", str(prompts)]
        if concurrency is not None:
            f += ["--max-concurrency", str(concurrency)]
        f += ["--request-rate", "inf" if rate is None else f"{rate:g}", "--seed", str(run_seed)]
        return (*f, *sampling)

    warmup_prompts = min(num_prompts, concurrency or 1, WARMUP_MAX_PROMPTS)
    warmup = flags(warmup_prompts, min(output_len, WARMUP_MAX_OUTPUT), seed + WARMUP_SEED_OFFSET, None)
    return Stream(name, flags(num_prompts, output_len, seed, request_rate), warmup)


def multi_turn_stream(
    conversations: int, turns: int, system_len: int, user_len: int, output_len: int, concurrency: int
) -> Stream:
    """`bench serve --dataset-name multi-turn`; the warm-up is 2 conversations of 2 turns with another
    seed, hence another system prompt: it leaves nothing in a prefix cache that the timed run can use."""

    def flags(convs: int, num_turns: int, c: int, seed: int) -> tuple[str, ...]:
        f = ["--dataset-name", "multi-turn", "--num-prompts", str(convs), "--max-concurrency", str(c)]
        f += ["--multi-turn-num-turns", str(num_turns), "--multi-turn-system-prompt-len", str(system_len)]
        f += ["--multi-turn-user-len", str(user_len), "--multi-turn-output-len", str(output_len)]
        return (*f, "--seed", str(seed))

    warm_convs = min(2, conversations)
    warmup = flags(warm_convs, min(2, turns), warm_convs, TIMED_SEED + WARMUP_SEED_OFFSET)
    return Stream("", flags(conversations, turns, concurrency, TIMED_SEED), warmup)


def _random_cell(
    model: str,
    input_len: int,
    output_len: int,
    concurrency: int,
    prompts: int,
    *,
    sampling: tuple[str, ...] = (),
    tag: str = "",
    what: str = "",
) -> Cell:
    """`sampling`: bench serve's sampling flags, named `tag` in the cell's name and `what` in its title."""
    return Cell(
        f"{input_len}-{output_len}-c{concurrency}" + (f"-{tag}" if tag else ""),
        f"{model}, {input_len} in / {output_len} out, concurrency {concurrency}"
        + (f", {what}" if what else ""),
        (random_stream(input_len, output_len, prompts, concurrency, sampling=sampling),),
    )


def _saturated(name: str, preset: str, model: str, expected_wall_s: int) -> Group:
    cell = Cell(
        "1024-128-c512",
        f"{model}, 1024/128, 1000 prompts, rate inf, max concurrency 512, default flags",
        (random_stream(1024, 128, 1000, 512),),
    )
    return Group(name, preset, f"Qwen3.5-{model} shape", (cell,), expected_wall_s)


def _groups() -> dict[str, Group]:
    decode_4b = Group(
        "decode-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            _random_cell("4B", 1, 256, 1, 20),
            Cell(
                "1-1-c1",
                "4B, 1-token prompt, 1 out, concurrency 1 (TTFT)",
                (random_stream(1, 1, 50, 1),),
            ),
            _random_cell("4B", 1024, 256, 1, 10),
            _random_cell("4B", 1024, 256, 16, 64),
            _random_cell("4B", 1024, 256, 64, 256),
            _random_cell("4B", 128, 512, 256, 512),
        ),
        expected_wall_s=240,
    )
    prefill_4b = Group(
        "prefill-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            _random_cell("4B", 8192, 1, 1, 20),
            _random_cell("4B", 32768, 1, 1, 8),
            _random_cell("4B", 131072, 1, 1, 3),
        ),
        expected_wall_s=210,
        # 128k prompts + 1 output token; prefill chunks of 8192 tokens, as the first GPU records used.
        server_flags=("--max-model-len", "132096", "--max-num-batched-tokens", "8192"),
    )
    mixed_4b = Group(
        "mixed-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            Cell(
                "mixed",
                "4B mixed load: 4 decoders (512 in / 4000 out) + cold 8192-token prompts at 0.5 QPS for 60 s",
                (
                    # 16 decodes of 4000 tokens, 4 at a time: about as long as the 60 s of prefills.
                    random_stream(512, 4000, 16, 4, name="decoders"),
                    # Another seed: no prefill prompt starts like a decoder's.
                    random_stream(8192, 1, 30, None, request_rate=0.5, name="prefills", seed=1),
                ),
            ),
        ),
        expected_wall_s=210,
    )
    multiturn_4b = Group(
        "multiturn-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            Cell(
                "multi-turn-c32",
                "4B multi-turn: 10 turns, 2000-token system prompt, 200-token user turns, 128-token "
                "answers, 32 conversations at once",
                (multi_turn_stream(32, 10, 2000, 200, 128, 32),),
            ),
        ),
        expected_wall_s=180,
    )
    # Qwen3.5's card, thinking mode, general tasks: the sampling a production server sees most.
    card = ("--temperature", "1.0", "--top-p", "0.95", "--top-k", "20", "--presence-penalty", "1.5")
    card_title = "the card's sampling (presence penalty 1.5)"
    # A structured-output constraint that never completes: the grammar masks every step of the request.
    words = ("--extra-body", json.dumps({"structured_outputs": {"regex": "([a-z]+ )+"}}))
    sampling_4b = Group(
        "sampling-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            _random_cell("4B", 1, 2048, 1, 4),
            _random_cell("4B", 1, 2048, 1, 4, sampling=card, tag="card", what=card_title),
            _random_cell("4B", 1024, 2048, 64, 128, sampling=card, tag="card", what=card_title),
            _random_cell("4B", 1024, 512, 64, 128),
            Cell(
                "1024-512-c60-free-c4-regex",
                "4B, 1024 in / 512 out: 60 free streams beside 4 constrained by a regex",
                (
                    random_stream(1024, 512, 120, 60, name="free"),
                    random_stream(1024, 512, 8, 4, name="regex", seed=1, sampling=words),
                ),
            ),
        ),
        expected_wall_s=300,  # a cold first start takes ~100 s of it
    )
    decode_27b = Group(
        "decode-27b",
        "27b-shape",
        "Qwen3.5-27B shape",
        (_random_cell("27B", 1024, 256, 1, 5), _random_cell("27B", 1024, 256, 16, 32)),
        expected_wall_s=330,
    )
    # Batch-1 and light-load decode of the MoE model: ~3B active parameters a token, so at batch 1 its
    # step is the experts' and the layers' launches as much as their bytes.
    decode_35b = Group(
        "decode-35b",
        "35b-a3b-shape",
        "Qwen3.5-35B-A3B shape",
        (
            _random_cell("35B-A3B", 1, 256, 1, 20),
            # 4 streams: 32 routing slots a decode step, the slot GEMVs' default bound, for the A/B against
            # the grouped kernels (DELTASERVE_MOE_SLOT_GEMV_SLOTS=16 against the default)
            _random_cell("35B-A3B", 1, 256, 4, 32),
            _random_cell("35B-A3B", 1024, 256, 16, 32),
        ),
        expected_wall_s=300,
    )
    startup_4b = Group(
        "startup-4b",
        "4b-shape",
        "Qwen3.5-4B shape",
        (
            Cell("first-start", "4B, first start: process start -> HTTP ready, then one 1-token completion"),
            Cell("restart", "4B, restart: the same after the first server stopped"),
        ),
        expected_wall_s=180,
        startup=True,
    )
    tiny = ("--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8")
    smoke_tiny = Group(
        "smoke-tiny",
        "tiny",
        "tiny (CPU smoke test)",
        (
            Cell("8-4-c2", "tiny, 8 in / 4 out, concurrency 2", (random_stream(8, 4, 4, 2),)),
            Cell(
                "mixed",
                "tiny mixed: 1 decoder + prefills at 4 QPS",
                (
                    random_stream(8, 8, 2, 1, name="decoders"),
                    random_stream(64, 1, 3, None, request_rate=4.0, name="prefills", seed=1),
                ),
            ),
            Cell("multi-turn-c2", "tiny multi-turn, 2 x 2 turns", (multi_turn_stream(2, 2, 16, 4, 3, 2),)),
        ),
        expected_wall_s=40,
        server_flags=tiny,
        public=False,
    )
    smoke_startup_tiny = Group(
        "smoke-startup-tiny",
        "tiny",
        "tiny (CPU smoke test)",
        (Cell("first-start", "tiny, first start"), Cell("restart", "tiny, restart")),
        expected_wall_s=30,
        server_flags=tiny,
        startup=True,
        public=False,
    )
    groups = [
        decode_4b,
        prefill_4b,
        mixed_4b,
        multiturn_4b,
        sampling_4b,
        _saturated("saturated-9b", "9b-shape", "9B", 270),
        _saturated("saturated-35b", "35b-a3b-shape", "35B-A3B", 300),
        decode_27b,
        decode_35b,
        startup_4b,
        smoke_tiny,
        smoke_startup_tiny,
    ]
    return {g.name: g for g in groups}


GROUPS: dict[str, Group] = _groups()


def select_cells(group: Group, names: str | None) -> Group:
    """The group with only the comma-separated cells `names` (all when None), in the group's order."""
    if not names:
        return group
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [c.name for c in group.cells]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(f"--cells {names!r}: group {group.name} has cells {', '.join(known)}")
    return dataclasses.replace(group, cells=tuple(c for c in group.cells if c.name in wanted))
