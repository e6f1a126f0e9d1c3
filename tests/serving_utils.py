"""A tiny saved DLM with its own BPE tokenizer and chat template, and a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

from hf_dlm.data.corpus import train_bpe_tokenizer

from .conftest import tiny_model

TEXTS = ["the quick brown fox jumps over the lazy dog", "a diffusion model fills in masked tokens"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_served_model(**config):
    """(model, tokenizer): a tiny DLM over a BPE tokenizer with a chat template; `config` overrides DLMConfig."""
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model("sdpa", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **config)
    return model, tokenizer


def save_tiny_checkpoint(path, **config):
    model, tokenizer = tiny_served_model(**config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn.Server on a thread; `stop()` is what SIGTERM does (should_exit), then waits for the drain."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60):
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not drain in time"


def wait_until_serving(process, url: str, timeout: float = 120):
    """Wait for a server subprocess to answer /health; fail if it exits or takes longer than `timeout`."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
