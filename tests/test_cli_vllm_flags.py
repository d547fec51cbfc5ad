"""A `vllm serve` command line: the flags deltaserve refuses fail with one line naming the flag and what
is supported, before anything loads; argument errors show `deltaserve serve`'s usage."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_fixture import SMALL_ENGINE

from deltaserve import __version__
from deltaserve.cli import main
from deltaserve.engine_config import EngineConfig

# (flags, what the one error line says)
REFUSED = [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype must be 'auto'"),
    (
        ["--quantization", "fp8"],
        "--quantization must be left out, or name the checkpoint's own FP8 format ('fp8' or "
        "'compressed-tensors'; its weights load dequantized), got 'fp8' for an unquantized checkpoint "
        "(online quantization is not supported)",
    ),
    (
        ["--speculative-config", '{"method": "eagle"}'],
        "--speculative-config: 'method' must be one of ['mtp']",
    ),
    (
        ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 8}'],
        "'num_speculative_tokens' must be an integer in 1..4, got 8",
    ),
    (["--tool-call-parser", "hermes"], "--tool-call-parser must be one of ['qwen3_coder', 'qwen3_xml']"),
    (["--reasoning-parser", "gpt_oss"], "--reasoning-parser must be one of ['qwen3', 'deepseek_r1']"),
    (["--no-enable-chunked-prefill"], "prefill is always chunked"),
    (["--limit-mm-per-prompt", '{"image": 4, "video": 0}'], "--limit-mm-per-prompt must allow no media"),
    (["--max-logprobs", "50"], "--max-logprobs must be in [0, 20]"),
    (["--dtype", "int8"], "--dtype must be one of ['auto', 'bfloat16', 'float16', 'float32'"),
    (["--generation-config", "/nonexistent"], "--generation-config must be auto, vllm or a folder"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template must be a jinja template file"),
    (["--ssl-keyfile", "/nonexistent.pem"], "--ssl-keyfile and --ssl-certfile must be given together"),
    (["--root-path", "api/"], "--root-path must start with '/'"),
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list of strings"),
    (["/some/dir", "--model", "/other/dir"], "the model is given twice"),
    (["--data-parallel-size", "2"], "--data-parallel-size must be '1' (one engine per server), got 2"),
    (
        ["--scheduling-policy", "priority"],
        "--scheduling-policy must be 'fcfs' (requests are admitted in arrival",
    ),
    (["-pp", "2"], "--pipeline-parallel-size must be '1' (use --tensor-parallel-size), got 2"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend must be 'mp' or 'uni'"),
    (["--enable-lora"], "--enable-lora is not supported: no LoRA adapters"),
    (["--lora-modules", "sql=/adapters/sql"], "--lora-modules is not supported: no LoRA adapters"),
    (["--enable-sleep-mode"], "--enable-sleep-mode is not supported: no sleep mode"),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config is not supported: no disaggregated prefill"),
    (
        ["--tokenizer", "/other"],
        "--tokenizer must be the model directory (the embedded default: its tokenizer.json",
    ),
    (
        ["--structured-outputs-config", '{"backend": "outlines"}'],
        "--structured-outputs-config: backend must be one of ['auto', 'xgrammar'], got 'outlines'",
    ),
    (["--hf-overrides", '{"num_hidden_layers": 2}'], "--hf-overrides may have no keys"),
    (
        ["--block-size", "32", "--page-size", "64"],
        "--block-size 32 and --page-size 64 both set the KV page size",
    ),
    (
        ["--override-generation-config", '{"max_new_tokens": 16}'],
        "--override-generation-config: keys must be among ['temperature', 'top_p', 'top_k', 'min_p', "
        "'repetition_penalty'], got 'max_new_tokens'",
    ),
    (["--override-generation-config", '{"temperature": "hot"}'], "temperature must be a finite number"),
    (["--api-server-count", "0"], "--api-server-count must be an integer >= 1, got 0"),
    (["--stream-interval", "0"], "--stream-interval must be an integer >= 1 (tokens per event), got 0"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_refused_flag_fails_with_one_line_naming_it(capsys, flags: list[str], message: str) -> None:
    assert main(["serve", *SMALL_ENGINE, *flags]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert message in line and "Traceback" not in err


def test_an_unknown_flag_shows_the_serve_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--no-such-flag"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: deltaserve serve [MODEL_DIR]")
    assert "deltaserve serve: error: unrecognized arguments: --no-such-flag" in err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"deltaserve {__version__}"


@pytest.mark.parametrize(
    ("spelling", "dtype"), [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")]
)
def test_vllm_dtype_spellings(spelling: str, dtype: str) -> None:
    config = EngineConfig(dtype=spelling)
    config.validate()
    assert config.dtype == dtype


def test_an_engine_start_up_error_is_one_line_without_a_traceback() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaserve.cli",
            "serve",
            "--device",
            "cpu",
            "--max-model-len",
            "999999",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: --max-model-len 999999 exceeds the model's max_position_embeddings (32768)"
    )


def test_a_server_that_fails_after_spawning_its_engine_takes_the_engine_along(capsys) -> None:
    """`serve` spawns the engine before the server's own start-up; a failure after the spawn (here a
    --generation-config folder that does not exist) must not leave the engine process running."""
    import multiprocessing

    assert main(["serve", *SMALL_ENGINE, "--port", "0", "--generation-config", "/nonexistent"]) == 2
    assert "--generation-config must be auto, vllm or a folder" in capsys.readouterr().err
    assert multiprocessing.active_children() == []


def test_an_invalid_engine_flag_fails_before_any_engine_process_starts(capsys, monkeypatch) -> None:
    import deltaserve.engine.process as engine_process

    def no_spawn(config):
        raise AssertionError("the engine was spawned for an invalid flag")

    monkeypatch.setattr(engine_process, "spawn_engine", no_spawn)
    assert main(["serve", *SMALL_ENGINE, "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be an integer >= 1" in capsys.readouterr().err


def test_vllm_aliases_reach_the_engine_and_server_configs() -> None:
    from deltaserve.cli import build_parser, engine_config_from_args
    from deltaserve.server.args import ServerConfig
    from deltaserve.vllm_flags import check_vllm_arguments

    flags = [
        "--block-size",
        "32",
        "--mamba-cache-mode",
        "none",
        "--override-generation-config",
        '{"top_p": 0.5}',
    ]
    args = build_parser().parse_args(
        [
            "serve",
            *flags,
            "--disable-fastapi-docs",
            "--enable-force-include-usage",
            "--return-tokens-as-token-ids",
            "--stream-interval",
            "8",
        ]
    )
    check_vllm_arguments(args)
    engine = engine_config_from_args(args)
    assert engine.page_size == 32 and engine.enable_prefix_caching is False
    server = ServerConfig.from_args(args)
    assert server.generation_overrides == {"top_p": 0.5}
    assert server.fastapi_docs is False and server.force_include_usage is True
    assert server.return_tokens_as_token_ids is True
    assert server.stream_interval == 8


def test_override_generation_config_goes_over_the_generation_config_file(tmp_path) -> None:
    from deltaserve.server.lifecycle import generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20}')
    merged = generation_defaults("auto", tmp_path, {"top_k": 1, "min_p": 0.1})
    assert merged == {"temperature": 0.6, "top_p": 0.95, "top_k": 1, "min_p": 0.1}
    assert generation_defaults("vllm", tmp_path, {"top_k": 1}) == {"top_k": 1}


@pytest.mark.parametrize("docs", [True, False])
def test_disable_fastapi_docs_removes_the_docs_and_the_schema(docs: bool) -> None:
    import asyncio
    import types

    import httpx

    from deltaserve.server.app import build_app
    from deltaserve.server.args import ServerConfig

    app = build_app(types.SimpleNamespace(config=ServerConfig(fastapi_docs=docs)))  # type: ignore[arg-type]

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return [(await http.get(path)).status_code for path in ("/docs", "/redoc", "/openapi.json")]

    assert asyncio.run(statuses()) == ([200, 200, 200] if docs else [404, 404, 404])
