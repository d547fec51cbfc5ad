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
