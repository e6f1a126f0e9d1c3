"""SIGTERM drains `hf_dlm.serving.app.serve` in bounded time whatever the rows are doing: a server process
whose every forward blocks forever still answers its open requests (503) and exits after the drain timeout."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.utils import free_port, save_tiny_checkpoint, wait_until_serving

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

# the server `hf-dlm serve` runs (create_app + serve), on a model whose forward never returns once `stuck`
SERVER = """
import sys, threading
from transformers import AutoModelForMaskedLM, AutoTokenizer
import hf_dlm
from hf_dlm.serving.app import ServerSettings, create_app, serve
from hf_dlm.serving.engine import ContinuousBatchingEngine

path, port = sys.argv[1], int(sys.argv[2])
model = AutoModelForMaskedLM.from_pretrained(path).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
never = threading.Event()
model.get_input_embeddings().register_forward_pre_hook(lambda module, args: never.wait())  # every forward
engine = ContinuousBatchingEngine(model, eos_token_id=tokenizer.eos_token_id)
settings = ServerSettings(model_name="tiny", drain_timeout=1.0)
serve(create_app(engine, tokenizer, settings, log=lambda line: print(line, flush=True)), port=port, log_level="warning")
"""


def test_sigterm_answers_open_requests_and_exits_when_rows_never_finish(tmp_path):
    save_tiny_checkpoint(tmp_path / "model")
    (tmp_path / "server.py").write_text(SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), str(tmp_path / "model"), str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    replies = {}

    def complete():
        response = httpx.post(url + "/v1/completions", json={"prompt": "the quick", "max_tokens": 8}, timeout=120)
        replies["plain"] = response.status_code, response.json()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": "a diffusion", "max_tokens": 8, "stream": True}) as response:
            replies["stream"] = response.status_code, [line for line in response.iter_lines() if line]

    try:
        wait_until_serving(process, url)
        deadline = time.monotonic() + 120
        clients = [threading.Thread(target=complete), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        while True:  # one row inside the stuck forward, the other queued behind it
            state = httpx.get(url + "/health", timeout=10).json()
            if state["running"] >= 1 and state["running"] + state["waiting"] == 2:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)  # exits: the drain is bounded (1 s here), the rows are not
        for client in clients:
            client.join(60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode in (0, -signal.SIGTERM), output
    status, body = replies["plain"]
    assert status == 503 and "drain timeout" in body["error"]["message"], body
    status, events = replies["stream"]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert "drain timeout" in json.loads(events[-2][len("data: "):])["error"]["message"]
    assert "draining 2 open request(s)" in output and "did not stop within 1 s" in output, output
    assert "2 requests accepted, 0 completed" in output, output
