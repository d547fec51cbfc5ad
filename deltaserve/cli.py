"""`deltaserve serve | generate | bench serve | bench latency | bench forward | bench steps | bench matrix | make-tiny`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltaserve import __version__
from deltaserve.engine_config import CPU_MAX_NUM_SEQS, LOAD_FORMATS, EngineConfig, SpeculativeConfig
from deltaserve.errors import ConfigError, RequestValidationError

if TYPE_CHECKING:
    from deltaserve.engine.process import EngineLaunch
    from deltaserve.server.args import ServerConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names. Defaults live in EngineConfig."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="checkpoint directory (default: the embedded tiny random model)"
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto | float32 | bfloat16 | float16, or vLLM's half | float (auto: bf16 on GPU, fp32 on CPU)",
    )
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="dummy: random weights of the right shapes",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window (default: the model's, capped by KV capacity)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="requests decoded at once (state slots); default: the first of 512, 256, 128, 64, 32, 16 whose "
        "state takes at most two thirds of the GPU memory left for caches (16 when none does); 256 on the CPU",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per step (decode rows + prefill chunks)",
    )
    g.add_argument(
        "--max-num-batched-tokens-saturated",
        type=int,
        default=d.max_num_batched_tokens_saturated,
        metavar="N",
        help="tokens per step while the server is saturated (requests wait for admission, or more than "
        "an eighth of --max-num-seqs, and more than 8, wait for their prefill; then until 8 or fewer do); "
        "default: --max-num-seqs + min(4096, 2 x --max-num-batched-tokens); 0: off",
    )
    g.add_argument(
        "--page-size", type=int, default=d.page_size, help="KV page size in tokens (a power of two)"
    )
    g.add_argument("--num-kv-pages", type=int, default=None, help="KV pages (default: sized from memory)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None, help="CPU: memory for the KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument(
        "--scheduler-policy", default=d.scheduler_policy, help="fcfs | auto (decode priority near a finish)"
    )
    g.add_argument(
        "--decode-latency-budget-ms",
        type=float,
        default=d.decode_latency_budget_ms,
        help="while requests decode, size each step's prefill from measured step times so the step "
        "takes about this long (inter-token latency under load; at least a quarter of "
        "--max-num-batched-tokens, and a 16th of the prompt tokens waiting, still prefill); 0 (default): off",
    )
    g.add_argument(
        "--kv-reserve-tokens",
        type=int,
        default=d.kv_reserve_tokens,
        help="admit a request only while the KV cache keeps room for every admitted request's next this "
        "many tokens (capped at its max_tokens; requests that finish within it count the pages they "
        "return): under KV pressure requests then finish instead of being preempted and recomputed, which "
        "pauses their streams; 1: admit optimistically",
    )
    g.add_argument(
        "--prefill-overlap",
        action="store_true",
        help="launch prefill chunks asynchronously while decode continues: on the GPU on a low-priority "
        "stream of their own, beside the decode steps on a high-priority one (off by default: see "
        "docs/benchmarks for the A/B)",
    )
    g.add_argument(
        "--no-decode-ahead",
        dest="decode_ahead",
        action="store_false",
        help="read each step's tokens before launching the next (by default the next step, decode rows "
        "and prompt chunks, is launched first, so host work overlaps the device; a stopped request "
        "costs one wasted row)",
    )
    g.add_argument(
        "--async-scheduling",
        dest="decode_ahead",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="vLLM's name for decode-ahead (on by default)",
    )
    g.add_argument(
        "--mamba-ssm-cache-dtype",
        default=d.mamba_ssm_cache_dtype,
        help="auto | float32 | bfloat16 | float16: the GDN SSM state (auto: the checkpoint's, float32); "
        "16-bit halves the state memory at a measured accuracy cost",
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=d.prefill_graph_max_tokens,
        help="steps with prompt chunks of up to this many tokens replay CUDA graphs, captured on first "
        "use per (tokens, prompt chunks) bucket (default: min(--max-num-batched-tokens, 2048); 0: off)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="shard the model over this many GPUs (or CPU processes), one process per rank; eager, "
        "without decode-ahead",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV and GDN state of a cached prompt prefix at token granularity (on by default)",
    )
    g.add_argument(
        "--prefix-cache-state-memory-gb",
        type=float,
        default=None,
        help="GiB for the prefix cache's GDN state snapshots (default: 8%% of the GPU, at most a quarter of what the weights leave; 0.25 on CPU)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding with the checkpoint\'s MTP head, vLLM\'s JSON: \'{"method": "mtp", '
        '"num_speculative_tokens": K}\' (K in 1..4; "adaptive": false pins K, "max_batch" caps the rows '
        "that speculate)",
    )


def _model_arg(args: argparse.Namespace) -> str | None:
    """`deltaserve serve DIR` (vLLM's positional model) or `--model DIR`."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ConfigError(
            f"the model is given twice, as {positional!r} and as --model {args.model!r}; give one"
        )
    return positional if positional is not None else args.model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        model=_model_arg(args),
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_batched_tokens_saturated=args.max_num_batched_tokens_saturated,
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        scheduler_policy=args.scheduler_policy,
        prefill_overlap=args.prefill_overlap,
        decode_latency_budget_ms=args.decode_latency_budget_ms,
        kv_reserve_tokens=args.kv_reserve_tokens,
        decode_ahead=args.decode_ahead,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        enforce_eager=args.enforce_eager,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_state_memory_gb=args.prefix_cache_state_memory_gb,
        speculative_config=(
            None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config)
        ),
    )
    config.validate()
    return config


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from deltaserve.tiny import make_tiny

    out = make_tiny(args.dir, args.preset, args.seed, weights=not args.config_only)
    what = "configs and tokenizer (serve with --load-format dummy)" if args.config_only else "random weights"
    print(f"wrote a {args.preset} checkpoint ({what}) to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    kwargs = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in ("model", "extra")
    }
    with LLM(config.model, **kwargs) as llm:  # LLM(None) says the weights are random
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
        )
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        out = llm.generate([prompt], params)[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    completion = out.outputs[0]
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Flags are checked and the port bound first (a mistake fails at once); then the engine process
    is spawned, so its start-up (model, warm-up, graphs) overlaps this process importing the server."""
    from deltaserve.engine.process import spawn_engine
    from deltaserve.server.args import ServerConfig
    from deltaserve.server.listen import bind_socket
    from deltaserve.stack_dumps import dump_stacks_on_sigusr1
    from deltaserve.vllm_flags import check_vllm_arguments, checkpoint_quantization

    model = _model_arg(args)
    check_vllm_arguments(args, checkpoint_quantization(model) if args.quantization is not None else None)
    engine_config = engine_config_from_args(args)  # validated
    server_config = ServerConfig.from_args(args)
    sock = bind_socket(server_config.host, server_config.port)
    dump_stacks_on_sigusr1()
    return _serve_over(
        lambda clients: spawn_engine(engine_config, clients), server_config, engine_config, sock
    )


def _serve_over(
    spawn: Callable[[int], EngineLaunch],
    server_config: ServerConfig,
    engine_config: EngineConfig,
    sock: socket.socket,
) -> int:
    """Spawns the engine for the configured API server processes (their shared metrics set up first,
    before anything imports prometheus_client), then serves on `sock` until the server exits."""
    from deltaserve.server import metrics_processes

    metrics_dir = metrics_processes.enable(server_config.api_server_count)
    try:
        launch = spawn(server_config.api_server_count)
    except BaseException:
        sock.close()
        metrics_processes.disable(metrics_dir)
        raise
    try:
        from deltaserve.server.app import run_server

        return run_server(server_config, engine_config, sock=sock, launch=launch)
    finally:
        launch.abandon()  # a no-op after an orderly shutdown; a server that failed takes its engine along
        metrics_processes.disable(metrics_dir)


def _cmd_bench_api(args: argparse.Namespace) -> int:
    from deltaserve.bench.api import run_bench_api

    return run_bench_api(args)


def _cmd_bench_api_server(args: argparse.Namespace) -> int:
    """`deltaserve serve` with the synthetic engine of bench/synthetic_engine.py in place of the model:
    the server that `bench api` measures."""
    from deltaserve.bench.synthetic_engine import SyntheticEngineConfig, spawn_synthetic_engine
    from deltaserve.server.args import ServerConfig
    from deltaserve.server.listen import bind_socket

    engine_config = engine_config_from_args(args)
    server_config = ServerConfig.from_args(args)
    sock = bind_socket(server_config.host, server_config.port)
    synthetic = SyntheticEngineConfig(
        engine_config.model,
        args.step_ms / 1000,
        engine_config.max_num_seqs or CPU_MAX_NUM_SEQS,
        engine_config.max_model_len or 32768,
    )
    return _serve_over(
        lambda clients: spawn_synthetic_engine(synthetic, clients), server_config, engine_config, sock
    )


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from deltaserve.bench.serve import run_bench_serve

    result = run_bench_serve(args)
    return 0 if result.completed > 0 else 1


def _cmd_bench_matrix(args: argparse.Namespace) -> int:
    from deltaserve.bench.matrix import run_bench_matrix

    return run_bench_matrix(args)


def _cmd_bench_latency(args: argparse.Namespace) -> int:
    from deltaserve.bench.latency import run_bench_latency

    run_bench_latency(args, engine_config_from_args(args))
    return 0


def _cmd_bench_forward(args: argparse.Namespace) -> int:
    from deltaserve.bench.forward_cost import run_bench_forward

    run_bench_forward(args, engine_config_from_args(args))
    return 0


def _cmd_bench_steps(args: argparse.Namespace) -> int:
    from deltaserve.bench.step_log import run_bench_steps

    run_bench_steps(args)
    return 0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL_DIR", help="checkpoint directory, as --model"
    )
    add_engine_arguments(parser)
    from deltaserve.server.args import add_server_arguments
    from deltaserve.vllm_flags import add_vllm_arguments

    add_server_arguments(parser)
    add_vllm_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Serve Qwen3.5 hybrid models.")
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        usage="%(prog)s [MODEL_DIR] [options]  (all options: %(prog)s --help)",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve, parser=serve)

    gen = sub.add_parser("generate", help="complete one prompt offline")
    add_engine_arguments(gen)
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template as a user turn"
    )
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_cmd_generate, parser=gen, max_num_seqs=16)

    tiny = sub.add_parser("make-tiny", help="write a checkpoint with random weights and the real tokenizer")
    tiny.add_argument("dir")
    from deltaserve.tiny import PRESETS

    tiny.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--config-only", action="store_true", help="no weights: for --load-format dummy")
    tiny.set_defaults(func=_cmd_make_tiny, parser=tiny)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load a running server like `vllm bench serve`")
    from deltaserve.bench.serve import add_bench_serve_arguments

    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=_cmd_bench_serve, parser=bench_serve)
    bench_api = bench_sub.add_parser(
        "api", help="the API process's cost per streamed token, over a synthetic engine (no model, no GPU)"
    )
    from deltaserve.bench.api import add_bench_api_arguments, add_step_argument

    add_bench_api_arguments(bench_api)
    bench_api.set_defaults(func=_cmd_bench_api, parser=bench_api)
    api_server = bench_sub.add_parser(
        "api-server", help="`serve` over the synthetic engine that `bench api` measures"
    )
    add_serve_arguments(api_server)
    add_step_argument(api_server)
    api_server.set_defaults(func=_cmd_bench_api_server, parser=api_server)
    bench_latency = bench_sub.add_parser("latency", help="in-process TTFT/TPOT through the engine (no HTTP)")
    add_engine_arguments(bench_latency)
    from deltaserve.bench.latency import add_bench_latency_arguments

    add_bench_latency_arguments(bench_latency)
    bench_latency.set_defaults(func=_cmd_bench_latency, parser=bench_latency)
    bench_forward = bench_sub.add_parser(
        "forward", help="in-process cost of one forward per batch shape: wall and host time (no HTTP)"
    )
    add_engine_arguments(bench_forward)
    from deltaserve.bench.forward_cost import add_bench_forward_arguments

    add_bench_forward_arguments(bench_forward)
    bench_forward.set_defaults(func=_cmd_bench_forward, parser=bench_forward)
    bench_steps = bench_sub.add_parser(
        "steps",
        help="step intervals of a server log written with DELTASERVE_ITL_DEBUG=1, by kind and prefill",
    )
    from deltaserve.bench.step_log import add_bench_steps_arguments

    add_bench_steps_arguments(bench_steps)
    bench_steps.set_defaults(func=_cmd_bench_steps, parser=bench_steps)
    bench_matrix = bench_sub.add_parser(
        "matrix",
        help="start a server and run one group of the standard matrix with `bench serve`; write the record",
    )
    from deltaserve.bench.matrix import add_bench_matrix_arguments

    add_bench_matrix_arguments(bench_matrix)
    bench_matrix.set_defaults(func=_cmd_bench_matrix, parser=bench_matrix)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand, with its usage, not the top-level one
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ConfigError, RequestValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
