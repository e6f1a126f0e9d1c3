"""Fuzzing the server: 400 seeded random and extreme bodies (huge integers, NaN and infinities,
deep nesting, unicode and lone surrogates, wrong types, unknown fields, broken JSON), from 8 concurrent
clients. Each is answered within the client's timeout with 2xx or 4xx in OpenAI's error shape, and the
server is healthy afterwards: nothing left running or queued, and a plain request still decodes as
`model.generate` does."""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_dlm.serving.engine import ContinuousBatchingEngine
from hf_dlm.serving.protocol import FIELD_NAMES

from tests.utils import ThreadedServer, tiny_served_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

INTS = [0, 1, -1, 2, 3, 4, 8, 16, 17, 63, 64, 65, 299, 300, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**40, -10**40]
FLOATS = [0.0, -0.0, 1e-320, 0.3, 0.5, 0.9, 1.0, 1.5, 2.0, 2.5, 1e308, -1e308, float("nan"), float("inf"),
          -float("inf")]
STRINGS = ["", "x", "the quick brown fox", "é" * 40, "😀" * 10, "\ud800", "a\x00b", "<|mask|>", "word " * 300,
           "日本語のテキスト", "\u202e\u200b", "null", "low_confidence", "dual", "tiny"]
# plausible values per field, valid and not: most bodies mix these with random ones
GOOD = {"max_tokens": [1, 4, 8, 16], "temperature": [0, 0.5, 1.0], "top_p": [0.5, 1.0], "top_k": [1, 5, 300],
        "n": [1, 2, 4], "seed": [0, 7, 2**63 - 1], "steps": [4, 8, 16], "block_length": [1, 2, 4, 8],
        "threshold": [0.0, 0.5, 0.9], "cache": ["none", "prefix", "dual"], "cfg_scale": [0.0, 1.0],
        "remasking": ["low_confidence", "random", "margin", "entropy"], "stream": [True, False],
        "stop": ["a", ["the", "o"], []], "model": ["tiny", None], "user": ["u1"], "factor": [0.5, 1.0],
        "entropy_bound": [0.1, 1.0], "editing_threshold": [0.5], "max_post_steps": [1, 4]}
UNKNOWN = ["logprobs", "tools", "presence_penalty", "__proto__", "", "max_tokens ", "Temperature"]


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(STRINGS + UNKNOWN): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def random_prompt(rng: random.Random):
    return rng.choice([rng.choice(STRINGS[1:4]), [rng.choice(STRINGS[1:5]) for _ in range(rng.randrange(1, 4))],
                       [rng.randrange(0, 300) for _ in range(rng.randrange(1, 12))], rng.choice(STRINGS),
                       rng.choice(INTS), [[1, 2]], random_value(rng)])


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, raw body): valid-looking requests with plausible and extreme values, plus garbage."""
    roll = rng.random()
    if roll < 0.08:  # not JSON, not an object, or nested past any parser's patience
        raw = rng.choice([b"", b"{", b"\xff\xfe", b"[" * 50000, b"{" * 5000, b"null", b"[1,2]", b'"x"',
                          b'{"prompt": "x",}', b"{'prompt': 'x'}", json.dumps(random_value(rng)).encode()])
        return rng.choice(["/v1/completions", "/v1/chat/completions"]), raw
    chat = rng.random() < 0.3
    body = {}
    if chat:
        body["messages"] = rng.choice([
            [{"role": "user", "content": rng.choice(STRINGS)}],
            [{"role": rng.choice(["system", "user", "assistant", "robot"]), "content": rng.choice(STRINGS)}
             for _ in range(rng.randrange(0, 4))],
            random_value(rng)])
    else:
        body["prompt"] = random_prompt(rng)
    for _ in range(rng.randrange(0, 6)):
        name = rng.choice(list(GOOD))
        body[name] = rng.choice(GOOD[name]) if rng.random() < 0.8 else random_value(rng)
    if rng.random() < 0.1:
        body[rng.choice(UNKNOWN)] = random_value(rng)
    if rng.random() < 0.05:  # a required field missing
        body.pop("messages" if chat else "prompt")
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


@pytest.fixture(scope="module")
def server():
    from hf_dlm.serving.app import ServerSettings, create_app

    model, tokenizer = tiny_served_model(max_position_embeddings=64)
    engine = ContinuousBatchingEngine(model, max_batch_size=16, max_waiting=256, eos_token_id=tokenizer.eos_token_id)
    settings = ServerSettings(model_name="tiny", max_prompt_tokens=48, max_output_tokens=32, default_max_tokens=8)
    running = ThreadedServer(create_app(engine, tokenizer, settings, log=lambda line: None))
    running.model, running.tokenizer, running.engine = model, tokenizer, engine
    yield running
    running.stop()


def test_random_and_extreme_bodies_get_2xx_or_4xx_and_the_server_stays_healthy(server):
    rng = random.Random(27)
    requests = [random_body(rng) for _ in range(400)]

    def send(request):
        path, raw = request
        response = client.post(server.url + path, content=raw, headers={"content-type": "application/json"})
        return response.status_code, response.text

    # "within seconds": a request not answered within the client's timeout fails the test
    with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=8)) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, requests))
    statuses = [status for status, _ in results]
    for (path, raw), (status, text) in zip(requests, results):
        assert 200 <= status < 300 or 400 <= status < 500, (status, raw[:300], text[:300])
        if status >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"], (raw[:300], error)
            # param names a field of the request (as sent, for unknown ones) or nothing
            assert error["param"] is None or error["param"].split(".")[0] in FIELD_NAMES | set(UNKNOWN) | set(
                STRINGS), (raw[:300], error)
        elif text.startswith("data: "):  # a stream ends with [DONE]
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        else:
            assert json.loads(text)["choices"], text[:300]
    # the mix really covered both sides
    assert sum(200 <= s < 300 for s in statuses) >= 20 and sum(s == 400 for s in statuses) >= 20
    assert sum(s == 422 for s in statuses) >= 50

    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "waiting": 0, "running": 0}
    prompt_ids = server.tokenizer("the quick brown")["input_ids"]
    out = server.model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, block_length=4, steps=8)
    expected = out[0, len(prompt_ids):].tolist()
    eos = server.tokenizer.eos_token_id
    expected = expected[: expected.index(eos)] if eos in expected else expected
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"prompt": "the quick brown", "max_tokens": 8, "block_length": 4, "steps": 8})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == server.tokenizer.decode(expected, skip_special_tokens=True)
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'status="5' not in metrics
