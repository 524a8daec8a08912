"""`superinfer` as users run it: flags, bad configuration, and `serve` as a real process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from superinfer.cli.main import build_parser, main
from superinfer.engine import contract
from tests.hf_fixtures import make_hf_checkpoint


def test_every_contract_flag_exists():
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    options = {opt for action in serve._actions for opt in action.option_strings}
    assert set(contract.SERVE_FLAGS) == options - {"-h", "--help"}  # engine.args is checked against these


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--block-size", "0"], "block_size"),
        (["serve", "--model", "/no/such/folder"], "/no/such/folder"),
        (["serve", "--policy", "nope"], "invalid choice"),
        (["serve", "--num-gpu-block", "5"], "unrecognized arguments"),  # no abbreviations
        (["serve", "--model", "tiny", "--device", "cpu", "--max-model-len", "100000"], "max_position_embeddings"),
        (["serve", "--device", "tpu"], "device"),
        (["serve", "--api-key", ""], "api_key"),  # (an empty key had turned authentication off)
        (["serve", "--tbt-slo-ms", "inf"], "tbt_slo_ms"),
        (["serve", "--rotary-alpha", "nan"], "rotary_alpha"),
        (
            [
                "serve",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--no-engine-process",
                "--policy",
                "rotary",
                "--cpu-kv-gib",
                "1e6",
            ],
            "--cpu-kv-gib (the CPU KV tier): 1000000.00 GiB exceeds the host's available memory",
        ),
    ],
)
def test_bad_configuration_exits_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(argv))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_port_in_use_fails_before_the_model_loads(capsys):
    """(The server had loaded the model, failed to bind, and hung on its engine process.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    assert f"--port {port} on 127.0.0.1" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early with {proc.returncode}: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(url + contract.READY_PATH, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError("server did not become ready")


def test_serve_an_hf_folder_as_a_process_bench_it_and_drain_on_sigterm(tmp_path: Path):
    folder = make_hf_checkpoint("qwen3", tmp_path / "qwen3", seed=1)
    port = free_port()
    exe = shutil.which("superinfer", path=str(Path(sys.executable).parent)) or "superinfer"
    proc = subprocess.Popen(
        [
            exe,
            "serve",
            "--model",
            str(folder),
            "--served-model-name",
            "m",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--num-gpu-blocks",
            "64",
            "--max-model-len",
            "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c for c in stream if c.choices]
        assert chunks[-1].choices[0].finish_reason == "length"
        report_path = tmp_path / "bench.json"
        bench = subprocess.run(
            [
                exe,
                "bench",
                "--url",
                url,
                "--rate",
                "20",
                "--duration",
                "0.5",
                "--prompt-median",
                "8",
                "--output-median",
                "6",
                "--json",
                str(report_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bench.returncode == 0, bench.stderr
        saved = json.loads(report_path.read_text())
        assert saved["model"] == "m" and saved["report"]["requests"] >= 1
        assert 0.0 <= saved["report"]["ttft_attainment"] <= 1.0 and saved["report"]["output_tokens"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
