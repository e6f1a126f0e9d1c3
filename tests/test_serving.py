"""The continuous-batching engine against `model.generate`, and the OpenAI-compatible server on a real
uvicorn at 127.0.0.1 (random free port, loopback only, bounded loops)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

from tests.utils import ThreadedServer, free_port, save_tiny_checkpoint, tiny_model, wait_until_serving

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

DLM = {"block_length": 4, "steps": 8}


def reference(model, prompt_ids, seed=None, **options):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([prompt_ids]), generator=generator, **options)
    return out[0, len(prompt_ids):].tolist()


def test_engine_rows_decode_as_generate_alone_while_sharing_forwards():
    model = tiny_model(eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=8)
    generator = torch.Generator().manual_seed(0)
    # (prompt length, max_new_tokens, block_length, steps, temperature, threshold, top_p, remasking)
    cases = [(3, 8, 4, 8, 0.0, None, None, "low_confidence"), (7, 8, 4, 4, 1.0, None, 0.9, "low_confidence"),
             (5, 12, 4, 6, 0.0, 0.5, None, "low_confidence"), (2, 4, 4, 4, 0.5, None, None, "random"),
             (9, 8, 8, 8, 0.0, None, None, "margin"), (4, 8, 2, 8, 0.0, None, None, "low_confidence"),
             # uneven LLaDA budgets ([2, 2, 1, 1, 1, 1]) and steps with nothing to commit ([1, 1, 1, 1, 0, ...])
             (6, 8, 8, 6, 1.0, None, None, "low_confidence"), (3, 8, 4, 16, 0.7, None, None, "low_confidence")]
    rows = []
    for seed, (length, new, block, steps, temperature, threshold, top_p, remasking) in enumerate(cases):
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = dict(max_new_tokens=new, block_length=block, steps=steps, temperature=temperature,
                       threshold=threshold, top_p=top_p, remasking=remasking)
        request = GenerationRequest(ids, engine.sampling_params(seed=seed, **options))
        rows.append((ids, seed, options, request))
    engine.submit([r[-1] for r in rows[:4]])
    engine.step()  # the first four run one step, then the others join the running batch
    engine.submit([r[-1] for r in rows[4:]])
    engine.run_until_idle()
    for ids, seed, options, request in rows:
        expected = reference(model, ids, seed, **options)
        assert request.generated == expected[: len(request.generated)], options
        eos_at = expected.index(5) if 5 in expected else len(expected)
        # an EOS-finished row stops early (the rest would be EOS), otherwise it decodes the whole canvas
        assert request.finish_reason == ("stop" if eos_at < len(expected) else "length")
        assert request.generated[: eos_at] == expected[: eos_at]
    assert engine.stats["max_forward_rows"] == 8 and engine.stats["forward_rows"] > engine.stats["forward_passes"]
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        engine.sampling_params(max_new_tokens=8, block_length=4, steps=3)


@pytest.mark.parametrize("alignment", ["same", "shift"])
def test_engine_classifier_free_guidance_decodes_as_generate_with_and_without_a_cache(alignment):
    # guided rows bring their unconditional copy (prompt masked; with a cache its keys / values in a lane of its
    # own, refreshed at each block start) into the shared forward, unguided rows beside them; rows arrive over steps
    model = tiny_model(eos_token_id=5, label_alignment=alignment)
    with torch.no_grad():  # a sharper head: guidance then changes which tokens win
        model.lm_head.weight.mul_(8)
    engine = ContinuousBatchingEngine(model, max_batch_size=8)
    calls = []
    forward_window = model.model.forward_window
    model.model.forward_window = lambda *args, **kwargs: calls.append(1) or forward_window(*args, **kwargs)
    generator = torch.Generator().manual_seed(1)
    cases = [(3, 8, 4, 8, 0.0, 1.5, "none"), (6, 8, 4, 8, 0.8, 0.5, "dual"), (4, 12, 4, 6, 0.0, 0.0, "dual"),
             (8, 8, 8, 8, 1.0, 3.0, "prefix"), (5, 12, 4, 12, 0.0, 2.0, "dual"), (7, 16, 8, 8, 0.0, 1.0, "prefix")]
    rows = []
    for seed, (length, new, block, steps, temperature, cfg, cache) in enumerate(cases):
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = dict(max_new_tokens=new, block_length=block, steps=steps, temperature=temperature, cfg_scale=cfg,
                       cache=cache, stop_on_eos=False)
        rows.append((ids, seed, options, GenerationRequest(ids, engine.sampling_params(seed=seed, **options))))
    pending = [r[-1] for r in rows]
    while pending or engine.has_work():  # two requests join before each step
        engine.submit(pending[:2])
        pending, before = pending[2:], len(calls)
        engine.step()
        assert len(calls) - before == 1  # guided, unguided, refreshing and window rows: ONE forward
    for ids, seed, options, request in rows:
        assert request.generated == reference(model, ids, seed, **options), options
    # guidance matters here: without it every guided row with a cache decodes differently
    assert all(request.generated != reference(model, ids, seed, **{**options, "cfg_scale": 0.0})
               for ids, seed, options, request in rows if options["cfg_scale"] and options["cache"] != "none")
    # a guided row takes two of the 8 lanes (its copy counts): 5 guided + 1 plain rows never all run at once
    assert engine.stats["max_forward_rows"] == 8
    assert engine.storage.lanes == 8  # the storage never grew past max_batch_size lanes
    with pytest.raises(ValueError, match="cfg_scale"):  # a guided row needs two lanes
        ContinuousBatchingEngine(model, max_batch_size=1).submit([GenerationRequest([1, 2], engine.sampling_params(
            max_new_tokens=4, cfg_scale=1.0))])


@pytest.mark.parametrize("attn, alignment", [("sdpa", "same"), ("eager", "shift")])
def test_engine_prefix_and_dual_caches_decode_as_generate_with_that_cache(attn, alignment):
    model = tiny_model(attn_implementation=attn, eos_token_id=5, label_alignment=alignment)
    engine = ContinuousBatchingEngine(model, max_batch_size=8)
    generator = torch.Generator().manual_seed(0)
    cases = [(3, 8, 4, 8, 0.0, None, "dual"), (7, 12, 4, 6, 1.0, None, "prefix"), (5, 12, 4, 6, 0.0, 0.3, "dual"),
             (2, 8, 4, 8, 0.5, None, "none"), (9, 8, 8, 8, 0.0, None, "prefix"), (4, 16, 4, 16, 0.0, None, "dual"),
             (6, 16, 4, 16, 0.0, None, "prefix"), (3, 16, 2, 16, 0.9, None, "prefix")]
    rows = []
    for seed, (length, new, block, steps, temperature, threshold, cache) in enumerate(cases):
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = dict(max_new_tokens=new, block_length=block, steps=steps, temperature=temperature,
                       threshold=threshold, cache=cache, stop_on_eos=False)
        rows.append((ids, seed, options, GenerationRequest(ids, engine.sampling_params(seed=seed, **options))))
    engine.submit([r[-1] for r in rows[:2]])
    engine.step()  # cached rows mid-block when the others join
    engine.submit([r[-1] for r in rows[2:]])
    engine.run_until_idle()
    for ids, seed, options, request in rows:
        assert request.generated == reference(model, ids, seed, **options), options
    uncached = ContinuousBatchingEngine(model, max_batch_size=8)
    uncached.submit([GenerationRequest(ids, uncached.sampling_params(seed=seed, **{**options, "cache": "none"}))
                     for ids, seed, options, _ in rows])
    uncached.run_until_idle()
    # the caches really ran: cached steps send only their windows through the model
    assert engine.stats["forward_tokens"] < 0.7 * uncached.stats["forward_tokens"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hf_dlm.serving.app import ServerSettings, create_app

    path = tmp_path_factory.mktemp("served")
    model, tokenizer = save_tiny_checkpoint(path)
    engine = ContinuousBatchingEngine(model, max_batch_size=16, max_waiting=64)
    settings = ServerSettings(model_name="tiny", max_prompt_tokens=48, max_output_tokens=32, default_max_tokens=8)
    running = ThreadedServer(create_app(engine, tokenizer, settings, log=lambda line: None))
    running.model, running.tokenizer, running.path = model, tokenizer, path
    running.app_server = running.server.config.app.state.server
    yield running
    running.stop()


def expected_text(server, prompt_ids, max_tokens=8, **options):
    tokens = reference(server.model, prompt_ids, max_new_tokens=max_tokens, temperature=0.0, **options)
    eos = server.tokenizer.eos_token_id
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    return server.tokenizer.decode(tokens, skip_special_tokens=True)


def test_openai_client_completes_chats_and_streams(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "the quick brown"
    ids = server.tokenizer(prompt)["input_ids"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=DLM)
    assert out.choices[0].text == expected_text(server, ids, **DLM) and out.choices[0].text
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].finish_reason in ("stop", "length")

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, extra_body=DLM)
    chat_ids = server.tokenizer("<|user|>hi<|assistant|>", add_special_tokens=False)["input_ids"]
    assert chat.choices[0].message.content == expected_text(server, chat_ids, **DLM)
    assert chat.choices[0].message.role == "assistant"
    guided = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={**DLM, "cfg_scale": 2.0})
    assert guided.choices[0].text == expected_text(server, ids, cfg_scale=2.0, **DLM)

    # a stream delivers the same text, one event per committed block (8 tokens = 2 blocks of 4)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            extra_body=DLM))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    chat_chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=8, temperature=0, stream=True, extra_body=DLM))
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat.choices[0].message.content

    # n choices with seeds seed + i; a sampled choice equals generate() with that seed
    many = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=7,
                                     extra_body=DLM)
    for i, choice in enumerate(many.choices):
        tokens = reference(server.model, ids, 7 + i, max_new_tokens=8, temperature=1.0, **DLM)
        eos = server.tokenizer.eos_token_id
        tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert choice.index == i and choice.text == server.tokenizer.decode(tokens, skip_special_tokens=True)


def test_stop_sequences_cut_the_answer_and_end_the_row(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model="tiny", prompt="a diffusion", max_tokens=16, temperature=0, extra_body=DLM)
    text = client.completions.create(**ask).choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(**ask, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**ask, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_errors_name_the_field_and_limits_apply(server):
    def post(body, path="/v1/completions", headers=None):
        response = httpx.post(server.url + path, json=body, headers=headers, timeout=60)
        return response.status_code, response.json().get("error", {})

    cases = [({"prompt": "x", "temperature": -1}, 422, "temperature"),
             ({"prompt": "x", "logprobs": 2}, 422, "logprobs"),  # unsupported OpenAI field: rejected, not ignored
             ({"prompt": "x", "max_tokens": 8, "block_length": 4, "steps": 3}, 400, "steps"),
             ({"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
             ({"prompt": "word " * 60}, 400, "prompt"),
             ({"prompt": "x", "cache": "full"}, 422, "cache"),
             ({"prompt": "x", "max_tokens": 8, "block_length": 4, "cfg_scale": -1.0}, 422, "cfg_scale"),
             ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
             ({"prompt": ""}, 400, "prompt"),
             ({}, 422, "prompt")]
    for body, status, param in cases:
        got_status, error = post(body)
        assert (got_status, error.get("param")) == (status, param), (body, error)
        assert error["message"]
    status, error = post({"messages": [{"role": "robot", "content": "x"}]}, "/v1/chat/completions")
    assert status == 422 and error["param"].startswith("messages")

    settings, engine = server.app_server.settings, server.app_server.engine
    settings.api_key = "sekret"
    counted = server.app_server.http_status
    unauthorized = counted[("/v1/completions", 401)]
    try:
        assert post({"prompt": "x"})[0] == 401
        assert counted[("/v1/completions", 401)] == unauthorized + 1  # /metrics counts the middleware's own answers
        assert post({"prompt": "x", "max_tokens": 4}, headers={"Authorization": "Bearer sekret"})[0] == 200
        assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    finally:
        settings.api_key = None
    engine.max_waiting = 0
    try:
        status, error = post({"prompt": "x"})
        assert status == 429 and error["type"] == "rate_limit_error"
    finally:
        engine.max_waiting = 64


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_bounded_load_valid_answered_bad_rejected_and_batched(server):
    bodies = []
    for i in range(200):
        if i % 10 == 3:  # one in ten malformed, in several ways
            bodies.append([{"prompt": "x", "max_tokens": "many"}, {"prompt": "x", "top_p": 0},
                           {"prompt": "x", "max_tokens": 8, "block_length": 4, "steps": 5}, {"n": 1}][i % 4])
        else:
            bodies.append({"prompt": f"the quick brown fox {i}", "max_tokens": 8, "temperature": 0.5, "seed": i,
                           **DLM})
    before = httpx.get(server.url + "/metrics").text

    def send(body):
        with httpx.Client(timeout=120) as client:
            response = client.post(server.url + "/v1/completions", json=body)
            return response.status_code, response.json()

    with ThreadPoolExecutor(16) as pool:  # 16 concurrent clients
        results = list(pool.map(send, bodies))
    for body, (status, payload) in zip(bodies, results):
        if "prompt" in body and body.get("seed") is not None:
            assert status == 200 and payload["choices"][0]["finish_reason"] in ("stop", "length"), payload
        else:
            assert 400 <= status < 500 and payload["error"]["param"], (body, payload)
    assert all(status < 500 for status, _ in results)
    after = httpx.get(server.url + "/metrics").text
    passes = metric(after, "hf_dlm_forward_passes_total") - metric(before, "hf_dlm_forward_passes_total")
    rows = metric(after, "hf_dlm_forward_rows_total") - metric(before, "hf_dlm_forward_rows_total")
    assert rows / passes > 1.0, (rows, passes)  # continuous batching: requests share forward passes
    assert 'hf_dlm_http_responses_total{path="/v1/completions",status="200"}' in after
    assert re.search(r"^hf_dlm_graph_captures_total 0$", after, re.M)  # CPU: no CUDA graphs
    # every step ran one forward at most, and the steps' wall time is counted (the busy share of a run)
    steps = metric(after, "hf_dlm_engine_steps_total") - metric(before, "hf_dlm_engine_steps_total")
    busy = metric(after, "hf_dlm_engine_step_seconds_total") - metric(before, "hf_dlm_engine_step_seconds_total")
    assert passes <= steps and busy > 0


def test_serve_cli_shutdown_under_load_loses_no_accepted_request(server, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "hf_dlm.cli", "serve", "--model", str(server.path), "--port",
                                str(port), "--device", "cpu", "--max-batch-size", "8", "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, url)
        deadline = time.monotonic() + 120

        outcomes = []

        def client(k):
            for i in range(30):  # bounded: each client stops after 30 calls or at the first refused connection
                try:
                    response = httpx.post(url + "/v1/completions", timeout=120,
                                          json={"prompt": f"the lazy dog {k} {i}", "max_tokens": 16, **DLM})
                    outcomes.append(response.status_code)
                except httpx.TransportError:
                    outcomes.append("refused")
                    return

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client, k) for k in range(8)]
            while sum(1 for o in outcomes if o == 200) < 10:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)  # graceful shutdown in the middle of the load
            for future in futures:
                future.result()
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    # uvicorn re-raises the caught SIGTERM once drained, so the exit status says "terminated by SIGTERM"
    assert process.returncode in (0, -signal.SIGTERM), output
    accepted, completed = map(int, re.search(r"(\d+) requests accepted, (\d+) completed", output).groups())
    answered = sum(1 for o in outcomes if o == 200)
    assert set(outcomes) <= {200, 503, "refused"}, outcomes
    assert accepted == completed == answered >= 10, (accepted, completed, answered, outcomes)
    assert "refused" in outcomes  # the load really ran into the shutdown
