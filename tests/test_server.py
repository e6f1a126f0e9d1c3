"""The OpenAI-compatible server against the requests that used to break it (issue 27): each defect has its
test here, on a real uvicorn at 127.0.0.1 over a tiny model of 64 positions."""

import json
import re
import threading

import pytest
import torch

from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

from tests.utils import ThreadedServer, tiny_served_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

DLM = {"block_length": 4, "steps": 8}
POSITIONS = 64


def start_server(**settings):
    from hf_dlm.serving.app import ServerSettings, create_app

    model, tokenizer = tiny_served_model(max_position_embeddings=POSITIONS)
    engine = ContinuousBatchingEngine(model, max_batch_size=8, max_waiting=64, eos_token_id=tokenizer.eos_token_id)
    options = dict(model_name="tiny", aliases=("tiny-dlm",), max_prompt_tokens=48, max_output_tokens=64,
                   default_max_tokens=8)
    logged = []
    running = ThreadedServer(create_app(engine, tokenizer, ServerSettings(**{**options, **settings}),
                                        log=logged.append))
    running.model, running.tokenizer, running.engine, running.logged = model, tokenizer, engine, logged
    running.app_server = running.server.config.app.state.server
    return running


@pytest.fixture(scope="module")
def server():
    running = start_server()
    yield running
    running.stop()


def post(server, body, path="/v1/completions"):
    # json.dumps escapes lone surrogates and writes NaN, as a client in another language may send them
    response = httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                          headers={"content-type": "application/json"})
    return response.status_code, response.json()


def generated_ids(model, prompt_ids, max_tokens=16, seed=None, **options):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, generator=generator, **options)
    return out[0, len(prompt_ids):].tolist()


def test_unknown_model_is_404_model_not_found_and_every_accepted_name_is_listed(server):
    listed = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert listed == ["tiny", "tiny-dlm"]
    for name in listed:  # every listed name is served, and named back in the response
        status, body = post(server, {"model": name, "prompt": "the quick", "max_tokens": 4})
        assert status == 200 and body["model"] == name
    status, body = post(server, {"model": "gpt-4o", "prompt": "the quick", "max_tokens": 4})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "tiny" in body["error"]["message"]
    status, body = post(server, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
                        "/v1/chat/completions")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_empty_prompt_list_is_400(server):
    for prompt in ([], [""], ["the quick", ""]):
        status, body = post(server, {"prompt": prompt, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)


def test_completion_tokens_count_the_generated_ids_not_a_retokenization(server):
    prompt = "the quick brown"
    ids = server.tokenizer(prompt)["input_ids"]
    expected = generated_ids(server.model, ids, temperature=0.0, **DLM)  # no EOS among them on this model
    assert server.tokenizer.eos_token_id not in expected
    status, body = post(server, {"prompt": prompt, "max_tokens": 16, "temperature": 0, **DLM})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    text = body["choices"][0]["text"]
    assert text == server.tokenizer.decode(expected, skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 16, "total_tokens": len(ids) + 16}
    # what the old count gave: the decoded text re-tokenized is another number on this tokenizer
    assert len(server.tokenizer(text, add_special_tokens=False)["input_ids"]) != 16
    # n choices and max_tokens cutting a block: counted per choice, up to max_tokens
    status, body = post(server, {"prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 3, **DLM})
    assert status == 200 and body["usage"]["completion_tokens"] == 18


class Chars:  # token id i decodes to chr(i); EOS is id 0
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def test_completion_tokens_stop_at_the_token_that_completes_a_stop_sequence():
    from hf_dlm.serving.app import answer_token_count

    tokens = [ord(c) for c in "abcdefgh"]
    assert answer_token_count(Chars(), tokens, [0], [], 8) == 8
    assert answer_token_count(Chars(), tokens, [0], [], 5) == 5  # cut at max_tokens
    assert answer_token_count(Chars(), tokens[:3] + [0] + tokens[3:], [0], [], 8) == 4  # through the EOS
    assert answer_token_count(Chars(), tokens, [0], ["de"], 8) == 5  # "abcde" is the first prefix holding "de"
    assert answer_token_count(Chars(), tokens, [0], ["xy", "b"], 8) == 2
    assert answer_token_count(Chars(), tokens, [0], ["gh"], 6) == 6  # the stop sequence lies beyond max_tokens


def test_answer_text_is_cut_at_max_tokens_the_first_eos_and_the_earliest_stop_sequence():
    from hf_dlm.serving.engine import decode_answer

    tokens = [ord(c) for c in "abcdefgh"]
    assert decode_answer(Chars(), tokens, [0], [], 8) == ("abcdefgh", "length")
    assert decode_answer(Chars(), tokens, [0], [], 5) == ("abcde", "length")  # the canvas ran past max_tokens
    assert decode_answer(Chars(), tokens[:4], [0], [], 8) == ("abcd", None)  # undecided: more blocks to come
    assert decode_answer(Chars(), tokens[:3] + [0] + tokens[3:], [0], [], 8) == ("abc", "stop")
    # two stop sequences in the text: the answer ends before the one that comes first, whatever the list order
    assert decode_answer(Chars(), tokens, [0], ["fg", "cd"], 8) == ("ab", "stop")
    assert decode_answer(Chars(), tokens, [0], ["cd", "fg"], 8) == ("ab", "stop")
    assert decode_answer(Chars(), tokens, [0], ["gh"], 6) == ("abcdef", "length")  # beyond max_tokens: no stop


def test_a_rows_stop_check_agrees_with_its_answer_and_decodes_only_for_stop_sequences():
    # the engine thread asks each row at each block end whether its answer is finished: without stop sequences
    # the ids decide (a tokenizer that cannot decode still gets the right answer), with them the text does
    import types

    from hf_dlm.serving.app import _Choice
    from hf_dlm.serving.engine import decode_answer

    class NoDecode:
        def decode(self, ids, skip_special_tokens=True):
            raise AssertionError("decoded on the engine thread")

    tokens = [ord(c) for c in "abcdefgh"]
    for generated in (tokens, tokens[:4], tokens[:3] + [0] + tokens[3:], [0] + tokens, tokens[:6] + [0]):
        for max_tokens in (4, 5, 8, 12):
            for stops, tokenizer in (([], NoDecode()), (["cd"], Chars()), (["xy"], Chars())):
                choice = types.SimpleNamespace(stops=stops, max_tokens=max_tokens,
                                               server=types.SimpleNamespace(tokenizer=tokenizer,
                                                                            engine=types.SimpleNamespace(eos_ids=[0])))
                choice.text = lambda c=choice: decode_answer(c.server.tokenizer, generated, [0], c.stops, c.max_tokens)
                expected = decode_answer(Chars(), generated, [0], stops, max_tokens)[1] is not None
                assert _Choice._stopped(choice, generated) == expected, (generated, max_tokens, stops)


def test_invalid_json_names_no_field(server):
    for raw in (b'{"prompt": "the quick", "max_tokens": 4,, }', b'{"prompt": "x"', b"\xff\xfe{}", b"[" * 100000):
        response = httpx.post(server.url + "/v1/completions", content=raw, timeout=60,
                              headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] is None, (raw[:40], error)
    huge = json.dumps({"prompt": "x" * (server.app_server.settings.max_body_bytes + 1)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=huge, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["param"] is None
    for body in ([], 5, "prompt", None):  # JSON, but not an object
        status, reply = post(server, body)
        assert status == 422 and reply["error"]["param"] is None, (body, reply)


def test_chunked_bodies_are_counted_as_they_stream_in(server):
    """A chunked body declares no Content-Length: the server counts its bytes and answers 413 once they pass the
    limit; a chunked body within the limit is served as any other."""
    limit = server.app_server.settings.max_body_bytes

    def chunked(total):  # a generator body: httpx sends it with Transfer-Encoding: chunked
        yield b'{"prompt": "'
        for _ in range(total // 2**16):
            yield b"x" * 2**16
        yield b'"}'

    url, headers = server.url + "/v1/completions", {"content-type": "application/json"}
    response = httpx.post(url, content=chunked(limit + 2**16), headers=headers, timeout=60)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert response.status_code == 413 and "more than" in response.json()["error"]["message"]
    small = (piece for piece in (b'{"prompt": "the', b' quick", "max_tokens": 4, ', b'"block_length": 4}'))
    response = httpx.post(url, content=small, headers=headers, timeout=60)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    assert 'path="/v1/completions",status="413"' in httpx.get(server.url + "/metrics", timeout=60).text


def test_fields_are_validated_before_queueing(server):
    cases = [  # body, status, param
        ({"prompt": "x", "seed": 2**64}, 422, "seed"),  # used to hang the server (torch.Generator refuses it)
        ({"prompt": "x", "seed": -1}, 422, "seed"),
        ({"prompt": "x", "seed": 2**63 - 1, "n": 2, "temperature": 1.0}, 400, "seed"),  # choice 1: seed + 1
        ({"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),  # prompt + 64 > the model's 64 positions
        ({"prompt": "x", "max_tokens": 60, "block_length": 32}, 400, "block_length"),  # canvas rounds up to 64
        ({"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 8, "steps": 9}, 400, "steps"),
        ({"prompt": "x", "max_tokens": 8, "steps": 10**30}, 400, "steps"),
        ({"prompt": "x", "max_tokens": 8, "block_length": 4, "steps": 3}, 400, "steps"),  # a FieldError's field
        ({"prompt": "x", "top_k": 10**6}, 400, "top_k"),
        ({"prompt": [5, 300]}, 400, "prompt"),  # token ids beyond the vocabulary
        ({"prompt": [5, -1]}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": "8"}, 422, "max_tokens"),  # strict types: no coercion
        ({"prompt": "x", "max_tokens": 8.0}, 422, "max_tokens"),
        ({"prompt": "x", "n": True}, 422, "n"),
        ({"prompt": "x", "stream": "yes"}, 422, "stream"),
        ({"prompt": [1, "a"]}, 422, "prompt"),
        ({"prompt": "x", "n": 17}, 422, "n"),
        ({"prompt": ["x"] * 17, "n": 4}, 400, "n"),  # 68 sequences in one request
        ({"prompt": "x", "stop": "a", "logit_bias": {"5": 1}}, 422, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, 422, "messages.0.extra"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, 422, "messages.0.content"),
        ({"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: valid JSON, no UTF-8
    ]
    before = dict(server.engine.stats)
    for body, status, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        got_status, reply = post(server, body, path)
        assert (got_status, reply["error"]["param"]) == (status, param), (body, reply)
        assert reply["error"]["message"]
    assert server.engine.stats["requests_admitted"] == before["requests_admitted"]  # nothing reached the engine
    # NaN and infinities are valid Python JSON but no temperature
    for value in (float("nan"), float("inf"), -float("inf")):
        status, reply = post(server, {"prompt": "x", "temperature": value})
        assert status == 422 and reply["error"]["param"] == "temperature"
    # the limits themselves are served: the largest seed, the full 64 positions
    prompt_ids = server.tokenizer("the quick brown")["input_ids"]
    status, body = post(server, {"prompt": prompt_ids, "max_tokens": POSITIONS - len(prompt_ids), "steps": 8,
                                 "block_length": POSITIONS - len(prompt_ids), "seed": 2**63 - 1, "temperature": 1.0})
    assert status == 200 and body["choices"][0]["text"] is not None


SAMPLERS = [  # request fields beyond prompt / max_tokens / seed: each reaches generate() under the same name
    {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "steps": 4, "block_length": 4, "remasking": "margin"},
    {"factor": 1.0, "block_length": 4},
    {"entropy_bound": 0.5, "block_length": 8, "temperature": 0.5},
    {"threshold": 0.3, "editing_threshold": 0.5, "max_post_steps": 2, "block_length": 4, "cache": "dual"},
    {"threshold": 0.3, "credit_alpha": 0.7, "credit_boost": 0.5, "credit_decay": 0.6, "block_length": 4},
]


@pytest.mark.parametrize("fields", SAMPLERS)
def test_field_mapping_reaches_the_sampler(server, fields):
    # every OpenAI / diffusion field lands on its DLMGenerationConfig name: the answer equals generate() with them
    from hf_dlm.serving.protocol import CompletionRequest

    body = {"prompt": "a diffusion", "max_tokens": 8, "seed": 11, **fields}
    assert CompletionRequest.model_validate(body).generation_overrides() == {"max_new_tokens": 8, **fields}
    ids = server.tokenizer(body["prompt"])["input_ids"]
    expected = generated_ids(server.model, ids, 8, 11, **fields)
    eos = server.tokenizer.eos_token_id
    expected = expected[: expected.index(eos)] if eos in expected else expected
    status, reply = post(server, body)
    assert status == 200 and reply["choices"][0]["text"] == server.tokenizer.decode(expected, skip_special_tokens=True)


def test_sampler_refusals_name_their_field(server):
    # DLMGenerationConfig's FieldErrors under the request's names (400); the schema's bounds first (422)
    cases = [({"factor": 1.0, "threshold": 0.5}, 400, "factor"), ({"editing_threshold": 0.5}, 400, "editing_threshold"),
             ({"factor": 0.0}, 422, "factor"), ({"max_post_steps": 10**6}, 422, "max_post_steps"),
             ({"credit_alpha": 0.7}, 400, "credit_alpha"), ({"credit_alpha": 0.7, "factor": 1.0}, 400, "credit_alpha"),
             ({"credit_decay": 1.5}, 422, "credit_decay"), ({"credit_alpha": -1.0}, 422, "credit_alpha")]
    for fields, expected, param in cases:
        status, reply = post(server, {"prompt": "x", "max_tokens": 8, **fields})
        assert (status, reply["error"]["param"]) == (expected, param), (fields, reply)


def expected_answer(server, prompt_ids, canvas, max_tokens, seed=None, **options):
    """(text, completion tokens) of generate() over `canvas` new tokens, cut at max_tokens and at the first EOS."""
    ids = generated_ids(server.model, prompt_ids, canvas, seed, **options)[:max_tokens]
    eos = server.tokenizer.eos_token_id
    if eos in ids:
        return server.tokenizer.decode(ids[: ids.index(eos)], skip_special_tokens=True), ids.index(eos) + 1
    return server.tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def stream_events(server, body, path="/v1/completions"):
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_max_tokens_inside_a_block_decodes_the_whole_canvas_one_token_per_step_and_cuts_the_answer(server):
    # max_tokens=6 in blocks of 4: the canvas is 8 tokens at one token per step (steps=8, generate's default for
    # 8 new tokens), and the answer is their first 6
    ids = server.tokenizer("a diffusion")["input_ids"]
    body = {"prompt": "a diffusion", "max_tokens": 6, "block_length": 4, "temperature": 1.0, "seed": 3}
    text, count = expected_answer(server, ids, 8, 6, 3, block_length=4, temperature=1.0)
    status, reply = post(server, body)
    assert status == 200 and reply["choices"][0]["text"] == text, (text, reply)
    assert reply["choices"][0]["finish_reason"] == ("length" if count == 6 else "stop")
    assert reply["usage"]["completion_tokens"] == count
    assert "".join(event["choices"][0]["text"] for event in stream_events(server, body)) == text


def test_usage_counts_each_prompt_once_and_choices_run_prompt_major_with_seed_plus_i(server):
    prompts = ["the quick brown", "a diffusion model"]
    ids = [server.tokenizer(prompt)["input_ids"] for prompt in prompts]
    status, reply = post(server, {"prompt": prompts, "n": 2, "max_tokens": 4, "block_length": 4, "temperature": 1.0,
                                  "seed": 5})
    assert status == 200, reply
    expected = [expected_answer(server, ids[p], 4, 4, 5 + i, block_length=4, temperature=1.0)
                for p in range(2) for i in range(2)]
    assert [(c["index"], c["text"]) for c in reply["choices"]] == [(k, text) for k, (text, _) in enumerate(expected)]
    completion = sum(count for _, count in expected)
    prompt_tokens = len(ids[0]) + len(ids[1])  # each prompt once, whatever n (OpenAI's count)
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                              "total_tokens": prompt_tokens + completion}


def test_responses_and_stream_chunks_name_their_object(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "block_length": 4}
    status, reply = post(server, {"prompt": "the quick", "max_tokens": 4, "block_length": 4})
    assert status == 200 and reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    status, reply = post(server, chat, "/v1/chat/completions")
    assert status == 200 and reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    events = stream_events(server, {"prompt": "the quick", "max_tokens": 8, "block_length": 4})
    assert {event["object"] for event in events} == {"text_completion"} and len({e["id"] for e in events}) == 1
    events = stream_events(server, chat, "/v1/chat/completions")
    assert {event["object"] for event in events} == {"chat.completion.chunk"}
    assert events[0]["id"].startswith("chatcmpl-") and len({e["id"] for e in events}) == 1


def test_the_limits_themselves_are_served_and_one_past_them_refused(server):
    settings, vocab = server.app_server.settings, server.model.config.vocab_size
    prompt = server.tokenizer("the quick")["input_ids"]
    sampled = {"block_length": 4, "steps": 8, "temperature": 1.0}
    # top_k = the whole vocabulary (no cut), temperature 2.0 (the schema's top): generate() with them
    for fields in ({"top_k": vocab}, {"temperature": 2.0}):
        options = {**sampled, **fields}
        text, _ = expected_answer(server, prompt, 8, 8, 5, **options)
        status, reply = post(server, {"prompt": prompt, "max_tokens": 8, "seed": 5, **options})
        assert status == 200 and reply["choices"][0]["text"] == text, (fields, reply)
    # a prompt of exactly max_prompt_tokens ids (48 + 8 new tokens within the 64 positions)
    longest = [3 + (7 * i) % 250 for i in range(settings.max_prompt_tokens)]
    text, _ = expected_answer(server, longest, 8, 8, block_length=4, steps=8)
    status, reply = post(server, {"prompt": longest, "max_tokens": 8, "block_length": 4, "steps": 8})
    assert status == 200 and reply["choices"][0]["text"] == text, reply
    refused = [({"prompt": prompt, "top_k": vocab + 1}, 400, "top_k"),
               ({"prompt": prompt, "temperature": 2.0001}, 422, "temperature"),
               ({"prompt": longest + [3], "max_tokens": 4}, 400, "prompt")]
    # max_tokens = the server's max_output_tokens (lowered to 8 here)
    settings.max_output_tokens = 8
    try:
        text, _ = expected_answer(server, prompt, 8, 8, 5, **sampled)
        status, reply = post(server, {"prompt": prompt, "max_tokens": 8, "seed": 5, **sampled})
        assert status == 200 and reply["choices"][0]["text"] == text, reply
        for body, expected_status, param in refused + [({"prompt": prompt, "max_tokens": 9}, 400, "max_tokens")]:
            status, reply = post(server, body)
            assert (status, reply["error"]["param"]) == (expected_status, param), (body, reply)
    finally:
        settings.max_output_tokens = 64


def test_empty_stop_sequences_are_ignored(server):
    body = {"prompt": "a diffusion", "max_tokens": 8, "block_length": 4, "temperature": 1.0, "seed": 2}
    ids = server.tokenizer(body["prompt"])["input_ids"]
    text, _ = expected_answer(server, ids, 8, 8, 2, block_length=4, temperature=1.0)
    status, plain = post(server, body)
    assert status == 200 and plain["choices"][0]["text"] == text and text
    for stop in ("", [""], ["", ""]):  # an empty string is in every text: it would cut every answer to ""
        status, reply = post(server, {**body, "stop": stop})
        assert status == 200 and reply["choices"] == plain["choices"], (stop, reply)


def test_a_default_block_length_longer_than_max_tokens_shrinks_to_max_tokens(server):
    # the model's generation config asks for blocks of 32; a request for 8 tokens decodes one block of 8 (not a
    # canvas of 32 cut to 8)
    config = server.model.generation_config
    ids = server.tokenizer("the quick brown")["input_ids"]
    text, count = expected_answer(server, ids, 8, 8, 4, block_length=8, temperature=1.0)
    config.block_length = 32
    try:
        status, reply = post(server, {"prompt": "the quick brown", "max_tokens": 8, "temperature": 1.0, "seed": 4})
    finally:
        config.block_length = None
    assert status == 200 and reply["choices"][0]["text"] == text, (text, reply)
    assert reply["usage"]["completion_tokens"] == count


def test_chat_without_a_template_is_400_naming_the_fix(server):
    from tests.utils import SERVING_CHAT_TEMPLATE as CHAT_TEMPLATE

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tokenizer, settings = server.tokenizer, server.app_server.settings
    tokenizer.chat_template = None
    try:
        status, reply = post(server, body, "/v1/chat/completions")
        assert status == 400 and reply["error"]["param"] == "messages"
        assert "--chat-template" in reply["error"]["message"] and "/v1/completions" in reply["error"]["message"]
        settings.chat_template = CHAT_TEMPLATE  # the fix it names: the server's own template
        status, reply = post(server, body, "/v1/chat/completions")
        assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    finally:
        tokenizer.chat_template, settings.chat_template = CHAT_TEMPLATE, None
    # a template that raises on these messages is the request's problem, not the server's
    settings.chat_template = "{{ raise_exception('only user messages') }}"
    try:
        status, reply = post(server, body, "/v1/chat/completions")
        assert status == 400 and "only user messages" in reply["error"]["message"]
    finally:
        settings.chat_template = None


def test_a_failing_row_fails_its_request_alone_and_frees_its_slot(server, monkeypatch):
    from hf_dlm.serving import app as app_module

    stopped = app_module._Choice._stopped

    def poisoned(choice, generated):  # a bug on one row's path (here its stop check, on the engine thread)
        if choice.request.prompt_ids[: len(poison)] == poison:
            raise RuntimeError("poisoned row")
        return stopped(choice, generated)

    poison = server.tokenizer("lazy dog")["input_ids"]
    monkeypatch.setattr(app_module._Choice, "_stopped", poisoned)
    results = {}

    def call(name, body):
        results[name] = post(server, body)

    threads = [threading.Thread(target=call, args=(f"ok{i}", {"prompt": f"the quick {i}", "max_tokens": 16, **DLM}))
               for i in range(4)] + [threading.Thread(target=call, args=("bad", {"prompt": "lazy dog", "max_tokens": 16,
                                                                                   **DLM}))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    status, reply = results["bad"]
    assert status == 500 and reply["error"]["type"] == "server_error" and "poisoned row" in reply["error"]["message"]
    assert all(results[f"ok{i}"][0] == 200 for i in range(4)), results
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "lazy dog", "max_tokens": 8, "stream": True, **DLM}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert "poisoned row" in events[-2] and events[-1] == "data: [DONE]"
    assert server.engine.num_running == 0 and server.engine.num_waiting == 0  # the slots are free
    monkeypatch.undo()
    assert post(server, {"prompt": "lazy dog", "max_tokens": 8, **DLM})[0] == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert re.search(r"^hf_dlm_engine_up 1$", metrics, re.M)
    for name, key in (("finished", "requests_finished"), ("failed", "requests_failed"),
                      ("cancelled", "requests_cancelled")):  # each sequence counted under its own outcome
        value = re.search(rf"^hf_dlm_sequences_{name}_total (\S+)$", metrics, re.M).group(1)
        assert float(value) == server.engine.stats[key], name
    assert server.engine.stats["requests_failed"] >= 2


def test_engine_rows_that_cannot_start_or_whose_callback_raises_fail_alone():
    model, tokenizer = tiny_served_model(max_position_embeddings=POSITIONS)
    engine = ContinuousBatchingEngine(model, max_batch_size=8)
    done = {}

    def request(name, seed=None, **hooks):
        params = engine.sampling_params(max_new_tokens=8, block_length=4, steps=8, temperature=1.0, seed=seed)
        params.seed = seed  # past the server's checks: torch.Generator refuses seeds >= 2**64

        def on_done(r, reason, error):
            done[name] = (reason, error)

        return GenerationRequest([5, 6, 7], params, on_done=on_done, **hooks)

    def raising(generated):
        raise RuntimeError("stop check failed")

    rows = {"ok": request("ok", seed=1), "bad_seed": request("bad_seed", seed=2**64),
            "bad_callback": request("bad_callback", seed=2, stop_check=raising), "ok2": request("ok2", seed=3)}
    engine.submit(list(rows.values()))
    engine.run_until_idle()
    assert done["bad_seed"][0] == "error" and isinstance(done["bad_seed"][1], Exception)
    assert done["bad_callback"][0] == "error" and "stop check failed" in str(done["bad_callback"][1])
    for name, seed in (("ok", 1), ("ok2", 3)):
        assert done[name] == ("length", None) or done[name][0] == "stop"
        expected = generated_ids(model, [5, 6, 7], 8, seed, block_length=4, steps=8,
                                 temperature=1.0)
        assert rows[name].generated == expected[: len(rows[name].generated)]
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.stats["requests_failed"] == 2


class _EngineCrash(BaseException):
    """Escapes the engine loop's `except Exception`: the thread dies as it would on a bug there."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_open_requests_and_health_says_so():
    running = start_server()
    try:
        def crash():
            raise _EngineCrash("engine bug")

        running.engine.step = crash
        status, reply = post(running, {"prompt": "the quick", "max_tokens": 8, **DLM})  # open when the engine dies
        assert status == 503 and reply["error"]["type"] == "server_error"
        assert "engine stopped" in reply["error"]["message"]
        health = httpx.get(running.url + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert post(running, {"prompt": "the quick", "max_tokens": 8})[0] == 503  # refused at once, not queued
        assert re.search(r"^hf_dlm_engine_up 0$", httpx.get(running.url + "/metrics", timeout=60).text, re.M)
        assert any(re.search("ERROR: the generation engine stopped", line) for line in running.logged)
    finally:
        running.stop()


def test_serve_cli_options_reach_the_server(tmp_path, monkeypatch, capsys):
    # --served-model-name NAME... (the first named in responses, all accepted), --chat-template, --drain-timeout;
    # --compile: the step is compiled (warm-up) before the server listens
    import argparse

    from hf_dlm.commands import serve as serve_command
    from hf_dlm.serving import app as app_module
    from tests.utils import SERVING_CHAT_TEMPLATE, save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "model")
    (tmp_path / "template.jinja").write_text(SERVING_CHAT_TEMPLATE)
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "model"), "--device", "cpu", "--served-model-name", "a", "b",
                              "--chat-template", str(tmp_path / "template.jinja"), "--drain-timeout", "2.5",
                              "--compile", "eager", "--max-length", "48"])
    served = []
    monkeypatch.setattr(app_module, "serve", lambda app, **options: served.append((app, options)))
    assert serve_command.run(args) == 0
    (app, options), = served
    settings = app.state.server.settings
    assert settings.model_names == ("a", "b") and settings.drain_timeout == 2.5
    assert settings.chat_template == SERVING_CHAT_TEMPLATE and options["port"] == 8000
    engine = app.state.server.engine
    assert engine.compile_choice == "eager" and engine.max_length == 48
    assert re.search(r"step compiled in [0-9.]+ s", capsys.readouterr().out)
    assert engine.storage.keys and engine.stats["forward_passes"] == 0  # warmed up, counters left at zero
    assert hasattr(engine.model.model.layers[0].self_attn, "qkv_proj")  # fused by default, as vLLM serves
    args = parser.parse_args(["--model", str(tmp_path / "model"), "--device", "cpu", "--no-fuse-projections"])
    assert serve_command.run(args) == 0
    assert hasattr(served[-1][0].state.server.engine.model.model.layers[0].self_attn, "q_proj")


def test_a_short_body_is_checked_on_the_event_loop_and_a_long_one_in_a_worker_thread(server, monkeypatch):
    # the hop to a worker and back costs two GIL hand-offs that a burst of short requests waits for; a long prompt's
    # tokenizing must still not stall the event loop
    check, threads = server.app_server.check, []
    original = type(check).__call__

    def recording(self, body):
        threads.append(threading.current_thread() is server.thread)
        return original(self, body)

    monkeypatch.setattr(type(check), "__call__", recording)
    monkeypatch.setattr(check, "inline_chars", 40)
    assert post(server, {"prompt": "the quick", "max_tokens": 4})[0] == 200
    assert post(server, {"prompt": [3, 4, 5] * 10, "max_tokens": 4})[0] == 200  # token ids: nothing to tokenize
    assert post(server, {"messages": [{"role": "user", "content": "the quick"}], "max_tokens": 4},
                "/v1/chat/completions")[0] == 200
    assert post(server, {"prompt": "the quick brown fox " * 3, "max_tokens": 4})[0] == 200  # 60 characters
    assert post(server, {"prompt": ["the quick brown fox"] * 3, "max_tokens": 4})[0] == 200
    assert post(server, {"messages": [{"role": "user", "content": "the quick brown fox " * 3}], "max_tokens": 4},
                "/v1/chat/completions")[0] == 200
    assert threads == [True, True, True, False, False, False]


def test_a_choice_decodes_its_text_once_per_new_block(server, monkeypatch):
    # a stream's events each ask for the text (and its last one twice): decoded again only when tokens came in
    import asyncio
    from types import SimpleNamespace

    from hf_dlm.serving.app import _Choice

    decoded, tokenizer = [], server.tokenizer
    owner = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: decoded.append(list(ids)) or
                                                      tokenizer.decode(ids, **kw)),
                            engine=SimpleNamespace(eos_ids={tokenizer.eos_token_id}))
    ids = tokenizer("the quick brown fox")["input_ids"]
    choice = _Choice(owner, ids, server.engine.sampling_params(max_new_tokens=8, block_length=4, steps=8), 8, [],
                     asyncio.new_event_loop(), 0)
    choice.request.generated.extend(ids[:2])
    assert choice.text() == choice.text() == (tokenizer.decode(ids[:2], skip_special_tokens=True), None)
    choice.request.generated.extend(ids[2:4])
    assert choice.text()[0] == tokenizer.decode(ids[:4], skip_special_tokens=True)
    assert decoded == [ids[:2], ids[:4]]
