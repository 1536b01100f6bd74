"""`scratchlm chat`: streaming from a running server (--url) and from an in-process engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scratchlm.server import ServerConfig
from tests.server.conftest import fake_server
from tests.server.fake_engine import chat_prompt, expected_text

REPO = Path(__file__).resolve().parents[2]


def run_chat(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scratchlm", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_chat_one_shot_against_server():
    with fake_server(server_config=ServerConfig(api_key="k")) as (srv, _):
        res = run_chat("--url", srv.url, "--api-key", "k", "--prompt", "hello", "--max-tokens", "7",
                       "--system", "sys")
    assert res.returncode == 0, res.stderr
    prompt = chat_prompt([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}])
    assert res.stdout == expected_text(prompt, 7)[0] + "\n"


def test_chat_conversation_keeps_history():
    with fake_server() as (srv, _):
        res = run_chat("--url", srv.url, "--max-tokens", "5", stdin="first\n/reset\nsecond\nthird\n/exit\n")
    assert res.returncode == 0, res.stderr
    replies = res.stdout.splitlines()
    first = expected_text(chat_prompt([{"role": "user", "content": "first"}]), 5)[0]
    second = expected_text(chat_prompt([{"role": "user", "content": "second"}]), 5)[0]
    third = expected_text(chat_prompt([{"role": "user", "content": "second"}, {"role": "assistant", "content": second},
                                       {"role": "user", "content": "third"}]), 5)[0]
    assert replies == [first, second, third]


@pytest.mark.slow
def test_chat_reports_errors_clearly():
    with fake_server(server_config=ServerConfig(api_key="k")) as (srv, _):
        res = run_chat("--url", srv.url, "--prompt", "x")
    assert res.returncode == 2 and "401" in res.stderr and "API key" in res.stderr
    res = run_chat("--url", "http://127.0.0.1:9", "--prompt", "x")
    assert res.returncode == 2 and "cannot reach" in res.stderr


def test_chat_in_process_engine_matches_offline_greedy(data_dir):
    inference = pytest.importorskip("scratchlm.inference")
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    res = run_chat(str(model), "--prompt", "Once upon a time", "--temperature", "0", "--max-tokens", "24")
    assert res.returncode == 0, res.stderr
    llm = inference.LLM(str(model))
    [offline] = llm.generate(["Once upon a time"], inference.SamplingParams(temperature=0, max_tokens=24))
    assert res.stdout == offline.outputs[0].text + "\n"


def test_chat_commands_help_unknown_and_goodbye():
    with fake_server() as (srv, _):
        res = run_chat("--url", srv.url, "--max-tokens", "5", stdin="/help\n/nonsense\n//slash\nhello\n")
    assert res.returncode == 0, res.stderr
    assert "/reset" in res.stderr and "/exit, /quit" in res.stderr  # /help
    assert "unknown command '/nonsense' (not sent to the model)" in res.stderr
    assert res.stderr.rstrip().endswith("bye.")  # Ctrl-D (end of input) says goodbye
    replies = res.stdout.splitlines()  # only "/slash" (escaped) and "hello" reached the model
    first = expected_text(chat_prompt([{"role": "user", "content": "/slash"}]), 5)[0]
    assert len(replies) == 2 and replies[0] == first


def test_ctrl_c_at_the_prompt_says_goodbye():
    import signal
    import time

    with fake_server() as (srv, _):
        proc = subprocess.Popen([sys.executable, "-m", "scratchlm", "chat", "--url", srv.url, "--max-tokens", "3"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO)
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        assert proc.stdout.readline()  # the first reply: the loop now waits at the prompt
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err.rstrip().endswith("bye.") and "Traceback" not in err


def test_chat_without_a_chat_template_warns_once(data_dir):
    """stories260K (llama2.c) has no chat template: one warning for the whole session; --quantization as serve's."""
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    res = run_chat(str(model), "--threads", "1", "--max-tokens", "4", "--quantization", "int8",
                   stdin="hello\nagain\n")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2, res.stdout
    assert res.stderr.count("has no chat template") == 1, res.stderr
