"""The serving engine as the decoding core with rows joining and leaving: one model forward per engine step for
rows in every phase, each row's tokens equal to `model.generate` alone (fp32), the new commit rules, cancel and
block-end streaming."""

import pytest
import torch

from hf_dlm.serving.engine import ContinuousBatchingEngine, EngineStoppedError, GenerationRequest, QueueFullError

from tests.utils import counting, tiny_model


def reference(model, prompt_ids, seed=None, **options):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([prompt_ids]), generator=generator, **options)
    return out[0, len(prompt_ids):].tolist()


def run_arriving(engine, requests, per_step):
    """Submit `per_step` requests before each step until all are in, then run; -> forwards per step."""
    calls = counting(engine.model)
    per_step_forwards, pending = [], list(requests)
    while pending or engine.has_work():
        if pending:
            engine.submit(pending[:per_step])
            pending = pending[per_step:]
        before = len(calls)
        had_rows = bool(engine.running or engine.waiting)
        engine.step()
        per_step_forwards.append((len(calls) - before, had_rows))
    return per_step_forwards


@pytest.mark.parametrize("mode,alignment", [("bidirectional", "same"), ("bidirectional", "shift"), ("block", "same")])
def test_one_forward_per_step_with_rows_joining_in_every_phase_and_tokens_equal_generate_alone(mode, alignment):
    model = tiny_model("sdpa", eos_token_id=5, attention_mode=mode, label_alignment=alignment,
                       **({"block_size": 4} if mode == "block" else {}))
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # threshold decoding then commits several tokens at some steps
    engine = ContinuousBatchingEngine(model, max_batch_size=6)
    generator = torch.Generator().manual_seed(0)
    # (prompt length, new tokens, block, steps, temperature, threshold, cache): uncached, refreshing and window
    # rows meet in the same steps; 8 rows arrive two per step and wait for a slot once 6 run
    cases = [(3, 8, 4, 8, 0.0, None, "dual"), (7, 12, 4, 6, 1.0, None, "prefix"), (5, 12, 4, 12, 0.0, 0.3, "dual"),
             (2, 8, 4, 8, 0.5, None, "none"), (9, 8, 8, 8, 0.0, 0.5, "prefix"), (4, 16, 4, 16, 0.0, None, "dual"),
             (6, 16, 8, 16, 0.0, 0.2, "none"), (3, 16, 2, 16, 0.9, None, "prefix")]
    rows = []
    for seed, (length, new, block, steps, temperature, threshold, cache) in enumerate(cases):
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = dict(max_new_tokens=new, block_length=block, steps=steps, temperature=temperature,
                       threshold=threshold, cache=cache, stop_on_eos=False)
        rows.append((ids, seed, options, GenerationRequest(ids, engine.sampling_params(seed=seed, **options))))
    forwards = run_arriving(engine, [r[-1] for r in rows], per_step=2)
    assert all(count == 1 for count, had_rows in forwards if had_rows)  # exactly ONE forward per step
    assert engine.stats["forward_passes"] == sum(count for count, _ in forwards)
    assert engine.stats["max_forward_rows"] == 6
    for ids, seed, options, request in rows:
        assert request.generated == reference(model, ids, seed, **options), options


CONFIDENT_RULES = [dict(factor=1.0), dict(entropy_bound=1.5), dict(threshold=0.7, editing_threshold=0.5),
                   dict(threshold=0.9, editing_threshold=0.3, max_post_steps=2), dict(hierarchy_threshold=0.4),
                   dict(hierarchy_threshold=0.4, threshold=0.9)]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_factor_entropy_bound_hierarchy_and_editing_equal_generate_in_the_engine(cache):
    model = tiny_model("sdpa", eos_token_id=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # confident: several tokens per forward, edits that fire
    engine = ContinuousBatchingEngine(model, max_batch_size=8)
    generator = torch.Generator().manual_seed(4)
    rows = []
    for i, rule in enumerate(CONFIDENT_RULES * 2):
        ids = torch.randint(0, 90, (3 + i,), generator=generator).tolist()
        options = dict(max_new_tokens=16, block_length=8, cache=cache, stop_on_eos=False, **rule)
        rows.append((ids, options, GenerationRequest(ids, engine.sampling_params(**options))))
    forwards = run_arriving(engine, [r[-1] for r in rows], per_step=3)
    assert all(count == 1 for count, had_rows in forwards if had_rows)
    for ids, options, request in rows:
        alone = model.generate(torch.tensor([ids]), return_dict_in_generate=True, **options)
        assert request.generated == alone.sequences[0, len(ids):].tolist(), options
        if {"factor", "entropy_bound", "hierarchy_threshold"} & set(options):
            assert len(alone.forward_batch_sizes) < 16  # several tokens per forward


# Fast-dLLM v2 / LLaDA2.x block alignment, sub-blocks and lone first tokens; Dream's schedule (with and without
# aligned blocks); the prompts end inside, and on, a block
SCHEDULE_RULES = [dict(align_blocks=True, threshold=0.5), dict(schedule="dream", steps=8),
                  dict(align_blocks=True, threshold=0.6, sub_block_length=2, first_token_alone=True),
                  dict(align_blocks=True, schedule="dream", cache="dual"),
                  dict(align_blocks=True, factor=1.0, sub_block_length=3, cache="prefix")]


@pytest.mark.parametrize("mode,alignment", [("block", "shift"), ("bidirectional", "same")])
def test_aligned_blocks_sub_blocks_and_dream_schedule_equal_generate_in_the_engine(mode, alignment):
    model = tiny_model("sdpa", eos_token_id=5, attention_mode=mode, label_alignment=alignment,
                       **({"block_size": 4} if mode == "block" else {}))
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # thresholds then commit several tokens at some steps
    engine = ContinuousBatchingEngine(model, max_batch_size=4)
    generator = torch.Generator().manual_seed(6)
    rows = []
    for i, rule in enumerate(SCHEDULE_RULES * 2):
        ids = torch.randint(0, 90, (3 + i,), generator=generator).tolist()  # 3 .. 12 tokens: 4 and 8 among them
        options = dict(max_new_tokens=10 if rule.get("align_blocks") else 16, block_length=4, stop_on_eos=False,
                       **rule)
        rows.append((ids, options, GenerationRequest(ids, engine.sampling_params(**options))))
    forwards = run_arriving(engine, [r[-1] for r in rows], per_step=2)
    assert all(count <= 1 for count, _ in forwards)  # 0: Dream's step of count 0 needs no forward
    for ids, options, request in rows:
        assert request.error is None, options
        assert request.generated == reference(model, ids, **options), options


def test_cancel_frees_the_slot_at_the_next_step_and_blocks_stream_as_they_end():
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    streamed, done = {}, {}
    options = dict(max_new_tokens=12, block_length=4, steps=12, stop_on_eos=False)

    def request(ids):
        return GenerationRequest(ids, engine.sampling_params(**options),
                                 on_block=lambda r, tokens: streamed.setdefault(r.request_id, []).append(list(tokens)),
                                 on_done=lambda r, reason, error: done.setdefault(r.request_id, reason))

    first, second, third = request([1, 2, 3]), request([4, 5, 6, 7]), request([8, 9])
    engine.submit([first, second, third])
    engine.step()
    assert [row.request for row in engine.running] == [first, second] and engine.num_waiting == 1
    lane = engine.running[0].lane
    engine.cancel(first)
    engine.step()  # the cancelled row leaves and the waiting one takes its lane in the same step
    assert done[first.request_id] == "cancelled"
    assert [row.request for row in engine.running] == [second, third]
    assert engine.running[1].lane == lane
    engine.run_until_idle()
    for req, ids in ((second, [4, 5, 6, 7]), (third, [8, 9])):
        assert [len(block) for block in streamed[req.request_id]] == [4, 4, 4]  # one message per block end
        assert sum(streamed[req.request_id], []) == req.generated == reference(model, ids, **options)
    assert first.request_id not in streamed or len(streamed[first.request_id]) <= 1
    assert (engine.stats["requests_cancelled"], engine.stats["requests_finished"]) == (1, 2)  # not counted as done


def test_the_steps_inside_a_block_reuse_their_plan_and_a_row_joining_or_moving_on_replans(monkeypatch):
    from hf_dlm.serving import engine as engine_module

    plans, real = [], engine_module.RaggedStep
    monkeypatch.setattr(engine_module, "RaggedStep", lambda *args, **kwargs: plans.append(1) or real(*args, **kwargs))
    model = tiny_model("sdpa")
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    options = dict(max_new_tokens=16, block_length=8, steps=16, cache="dual", stop_on_eos=False)
    first = GenerationRequest([1, 2, 3], engine.sampling_params(**options))
    second = GenerationRequest([4, 5], engine.sampling_params(**options))
    engine.submit([first])
    counts = []
    for step in range(24):
        if step == 8:
            engine.submit([second])  # joins as the first row starts its second block
        engine.step()
        counts.append(len(plans))
    assert not engine.has_work()
    # one token per step, blocks of 8: a refresh step, then 7 window steps that repeat one plan. Row A: blocks at
    # steps 0 and 8, done after 15; row B: blocks at 8 (beside A's) and 16, done after 23
    assert counts == [1] + [2] * 7 + [3] + [4] * 7 + [5] + [6] * 7, counts
    for request, ids in ((first, [1, 2, 3]), (second, [4, 5])):
        assert request.generated == reference(model, ids, **options)


def test_the_queue_takes_exactly_max_waiting_requests_all_or_none_and_counts_each_row_once():
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=2, max_waiting=2)
    options = dict(max_new_tokens=8, block_length=4, steps=8, stop_on_eos=False)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    requests = [GenerationRequest(ids, engine.sampling_params(**options)) for ids in prompts]
    with pytest.raises(QueueFullError):  # three at once: none of them queued
        engine.submit(requests[:3])
    assert engine.num_waiting == 0
    engine.submit(requests[:2])  # exactly max_waiting
    with pytest.raises(QueueFullError):
        engine.submit(requests[2:3])
    assert engine.num_waiting == 2
    engine.step()  # both admitted (two lanes): the queue has room for two again
    assert engine.num_waiting == 0 and engine.num_running == 2
    engine.submit(requests[2:])
    engine.run_until_idle()
    for ids, request in zip(prompts, requests):
        expected = reference(model, ids, **options)
        assert request.generated == expected  # the whole canvas (stop_on_eos off): "stop" when it holds an EOS
        assert request.finish_reason == ("stop" if 5 in expected else "length")
    stats = engine.stats  # two blocks per row; the first of them timed once
    assert (stats["requests_admitted"], stats["requests_finished"], stats["generated_tokens"]) == (4, 4, 32)
    assert stats["first_block_count"] == 4 and stats["requests_failed"] == 0


def test_a_waiting_request_whose_client_left_frees_its_queue_place_at_the_next_submit():
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=1, max_waiting=2)
    options = dict(max_new_tokens=8, block_length=4, steps=8, stop_on_eos=False)
    done = []
    requests = [GenerationRequest(ids, engine.sampling_params(**options),
                                  on_done=lambda r, reason, error: done.append((r.request_id, reason)))
                for ids in ([1, 2, 3], [4, 5], [6, 7])]
    engine.submit(requests[:2])
    engine.cancel(requests[0])  # its client is gone while the request still waits
    engine.submit(requests[2:])  # the queue (max 2) has room again
    assert done == [(requests[0].request_id, "cancelled")] and engine.num_waiting == 2
    engine.run_until_idle()
    for request in requests[1:]:
        assert request.generated == reference(model, request.prompt_ids, **options)
    assert requests[0].generated == [] and engine.stats["requests_admitted"] == 2


def test_shutdown_finishes_every_queued_and_running_row_before_the_loop_stops():
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    options = dict(max_new_tokens=8, block_length=4, steps=8, stop_on_eos=False)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # three rows on two lanes: one waits for a lane
    requests = [GenerationRequest(ids, engine.sampling_params(**options)) for ids in prompts]
    engine.submit(requests)
    with engine.lock:  # the loop first looks at its work after the shutdown was asked for
        engine.start()
        engine.shutdown(timeout=0)
    engine.thread.join(60)
    assert not engine.thread.is_alive() and not engine.has_work()
    for ids, request in zip(prompts, requests):
        expected = reference(model, ids, **options)
        assert request.generated == expected  # the whole canvas (stop_on_eos off): "stop" when it holds an EOS
        assert request.finish_reason == ("stop" if 5 in expected else "length")
    with pytest.raises(EngineStoppedError):
        engine.submit([GenerationRequest([1, 2], engine.sampling_params(**options))])


def test_rows_without_steps_decode_one_token_per_step_as_generate_without_steps():
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=4)
    options = dict(max_new_tokens=8, block_length=4, temperature=1.0, stop_on_eos=False)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (n,), generator=generator).tolist() for n in (3, 6, 4)]
    requests = [GenerationRequest(ids, engine.sampling_params(seed=seed, **options))
                for seed, ids in enumerate(prompts)]
    engine.submit(requests)
    engine.run_until_idle()
    for seed, (ids, request) in enumerate(zip(prompts, requests)):
        assert request.generated == reference(model, ids, seed, **options)
    assert engine.sampling_params(**options).steps == 8  # generate's default: max_new_tokens, one token a step


def test_prompt_beyond_the_model_positions_is_refused_before_queueing():
    model = tiny_model("sdpa", max_position_embeddings=32)
    engine = ContinuousBatchingEngine(model)
    too_long = GenerationRequest(list(range(20)), engine.sampling_params(max_new_tokens=16, block_length=16))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.submit([too_long])
    assert engine.num_waiting == 0


def test_compiled_engine_step_with_bucketed_shapes_equals_eager():
    # compile="eager": Dynamo traces the ragged step (dynamic sizes; rows, tokens and queries bucketed, filler rows
    # and tokens writing the trash slot) without Inductor, so the test stays fast on CPU
    model = tiny_model("sdpa", eos_token_id=5)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 90, (n,), generator=generator).tolist() for n in (3, 7, 5, 11)]
    options = [dict(cache="dual"), dict(cache="prefix"), dict(cache="none"), dict(cache="dual")]
    results = []
    for compile_choice in (None, "eager"):
        engine = ContinuousBatchingEngine(model, max_batch_size=4, compile=compile_choice)
        requests = [GenerationRequest(ids, engine.sampling_params(max_new_tokens=12, block_length=4, steps=12,
                                                                  stop_on_eos=False, **o))
                    for ids, o in zip(prompts, options)]
        forwards = run_arriving(engine, requests, per_step=2)
        assert all(count == 1 for count, had_rows in forwards if had_rows)
        results.append([r.generated for r in requests])
        if compile_choice:  # bucketed: more tokens through the model than the rows' spans
            assert engine.stats["forward_tokens"] > results_tokens
        results_tokens = engine.stats["forward_tokens"]
    assert results[0] == results[1]
    for ids, o, generated in zip(prompts, options, results[1]):
        assert generated == reference(model, ids, max_new_tokens=12, block_length=4, steps=12, stop_on_eos=False, **o)


def test_serving_throughput_benchmark_tiny_core_part(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "serving_throughput.py"), "--tiny", "--parts",
                    "core", "--profile-steps", "2", "--profile-skip", "1", "--out", str(tmp_path)], check=True, env=env,
                   cwd=tmp_path, capture_output=True, timeout=600)
    report = json.loads((tmp_path / "serving_throughput.json").read_text())
    assert {(r["setting"], r["arrival"]) for r in report["core"]} == {
        (s, a) for s in ("one token per step", "threshold 0.9") for a in ("all at once", "one per 2 steps")}
    assert all(r["forwards"] == r["engine_steps"] for r in report["core"])  # one forward per engine step
    # fp32: the engine's rows equal generate's batch rows (a margin for argmax near-ties between kernel paths),
    # with the mask as the engine's additive bias and in its boolean form (--engine-mask bias,bool), each with the
    # compiled commit and the eager one (--commit compiled,eager), under the default SDPA priority and the model's
    at_once = [r for r in report["core"] if r["arrival"] == "all at once"]
    assert sorted(r["engine_mask"] for r in at_once) == ["bias"] * 16 + ["bool"] * 16
    assert sorted({r["engine_sdpa"] for r in at_once}) == ["as-now", "model-priority"]
    assert all(r["tokens_equal_to_generate"] > 0.9 for r in at_once)
    # the profiled runs: steps 3-4 (1 skipped, 2 warm-up), timed without and with the profiler, each with its table
    assert [(p["schedule"], p["steps"]) for p in report["profile"]] == [
        ("batch 4, all at once", [3, 4]), ("4 arriving one per 2 steps", [3, 4])]
    for p in report["profile"]:
        assert p["wall_ms_per_step"] > 0 and p["profiled_wall_ms_per_step"] > 0 and p["device_busy_share"] is None
        table = (tmp_path / p["table"]).read_text()
        assert table.startswith(f"threshold 0.9, {p['schedule']}: steps 3-4") and "aten::mm" in table


def test_step_shapes_counts_the_attention_padding_of_a_step_mixing_a_refresh_and_a_window(monkeypatch):
    # hand count: a refresh row (8 queries) beside a window row (2 queries), both against 8 keys. The step pads
    # every row to 8 queries: 2 rows x 8 x 8 = 128 pairs computed for 8 x 8 + 2 x 8 = 80 real; 10 packed
    # tokens are a bucket size already (no token padding)
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_shapes import WorkCounter

    from hf_dlm.generation.slot_cache import RaggedStep, SlotStorage

    storage = SlotStorage(torch.device("cpu"), 0)
    storage.reserve(2, 8)
    step = RaggedStep(storage, [0, 1], [0, 6], [8, 2], [8, 8], buckets=True)
    counter = WorkCounter(lambda graphs, forward, tensors, **fixed: "called")
    keys = [torch.zeros(2, storage.capacity + 1, 1, 1)]
    assert counter(None, None, step.tensors, keys=keys) == "called"
    assert counter.totals == {"tokens": 10, "real_tokens": 10, "pairs": 128, "real_pairs": 80}
    step = RaggedStep(storage, [0, 1, 0], [0, 6, 0], [8, 2, 7], [8, 8, 8], buckets=True)  # 17 tokens -> 18
    counter(None, None, step.tensors, keys=keys)
    assert counter.totals["tokens"] - 10 == 18 and counter.totals["real_tokens"] - 10 == 17
    assert counter.totals["pairs"] - 128 == 3 * 8 * 8 and counter.totals["real_pairs"] - 80 == 64 + 16 + 56
    # the engine's form: an additive bias (0 where a query sees a key, the dtype's lowest elsewhere), counted alike
    bias = RaggedStep(storage, [0, 1, 0], [0, 6, 0], [8, 2, 7], [8, 8, 8], buckets=True, mask_dtype=torch.bfloat16)
    lowest = torch.finfo(torch.bfloat16).min
    assert torch.equal(bias.tensors["mask"], torch.where(step.tensors["mask"], 0.0, lowest).to(torch.bfloat16))
    before = dict(counter.totals)
    counter(None, None, bias.tensors, keys=keys)
    assert {name: counter.totals[name] - before[name] for name in before} == {
        "tokens": 18, "real_tokens": 17, "pairs": 3 * 8 * 8, "real_pairs": 64 + 16 + 56}


def test_float8_decoding_takes_the_decoder_projections_and_refuses_without_a_float8_gpu():
    from hf_dlm.generation.float8 import float8_decoding_filter, quantize_float8_for_decoding

    model = tiny_model("sdpa", vocab_size=96, mask_token_id=95)  # a vocabulary the float8 GEMM takes (16 | 96)
    taken = {name for name, module in model.named_modules() if float8_decoding_filter(module, name)}
    assert "model.layers.0.self_attn.q_proj" in taken and "model.layers.1.mlp.down_proj" in taken
    assert "lm_head" not in taken and not any("embed" in name or "norm" in name for name in taken)
    with_head = {name for name, module in model.named_modules() if float8_decoding_filter(module, name, lm_head=True)}
    assert with_head == taken | {"lm_head"}
    if not torch.cuda.is_available():
        pytest.importorskip("torchao")
        with pytest.raises(RuntimeError, match="compute capability >= 8.9"):
            quantize_float8_for_decoding(model)


def test_float8_decoding_leaves_the_process_inductor_settings_alone(monkeypatch):
    # torchao's float8 config turns on Inductor's coordinate-descent tuning and lowers the float32 matmul precision
    # for the whole process by default: on the GPU the 8B decoder's first compile took 467 s instead of 107.
    # The float8 GEMM itself needs a float8 GPU; the weights convert on any device once the checks are bypassed.
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor_config
    from torchao.quantization import quant_api

    from hf_dlm.generation import float8

    monkeypatch.setattr(float8, "_require_float8_gpu", lambda device: None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    precision = torch.get_float32_matmul_precision()
    # Inductor's config module is patched through its own API (a monkeypatch of it leaves the option undefined)
    with inductor_config.patch(coordinate_descent_tuning=False, coordinate_descent_check_all_directions=False):
        try:
            for granularity in float8.GRANULARITIES:
                model = tiny_model("sdpa").to(torch.bfloat16)
                float8.quantize_float8_for_decoding(model, granularity)
                assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Float8Tensor"
                assert model.lm_head.weight.dtype == torch.bfloat16  # the head stays in its dtype
                with pytest.raises(ValueError, match=r"lm_head=True.*\(99, 32\)"):  # 99 words: no float8 GEMM
                    float8.quantize_float8_for_decoding(model, granularity, lm_head=True)
                model = tiny_model("sdpa", vocab_size=96, mask_token_id=95, tie_word_embeddings=True).to(torch.bfloat16)
                float8.quantize_float8_for_decoding(model, granularity, lm_head=True)
                assert type(model.lm_head.weight).__name__ == "Float8Tensor"
                assert type(model.model.embed_tokens.weight) is torch.nn.Parameter  # a tied head's embeddings stay
                assert model.model.embed_tokens.weight.dtype == torch.bfloat16
            assert inductor_config.coordinate_descent_tuning is False
            assert inductor_config.coordinate_descent_check_all_directions is False
            assert torch.get_float32_matmul_precision() == precision
        finally:
            torch.set_float32_matmul_precision(precision)
    with pytest.raises(ValueError, match="granularity must be one of"):
        float8.quantize_float8_for_decoding(tiny_model("sdpa"), "block")


def test_bucketed_step_whose_filler_rows_meet_an_exactly_bucketed_token_count_equals_the_plain_step():
    # 17 rows are bucketed to 18 (one filler row) while their 32 tokens are already a bucket size (no padding
    # token): the filler row's LM-head index must still point at a real packed token (an H100 run of the compiled
    # engine with staggered arrivals hit a device-side assert here)
    from hf_dlm.generation.slot_cache import RaggedStep, SlotStorage, first_ragged_forward, ragged_forward

    model = tiny_model("sdpa")
    rows, length = 17, 16
    storage = SlotStorage(torch.device("cpu"), model.config.mask_token_id)
    storage.reserve(rows + 1, length)
    storage.canvas[:rows, :length] = torch.randint(0, 90, (rows, length), generator=torch.Generator().manual_seed(0))

    def forward(starts, lengths, buckets, first=False):
        step = RaggedStep(storage, list(range(rows)), starts, lengths, [length] * rows, buckets=buckets,
                          heads=list(zip(starts, lengths)))
        tensors = dict(step.tensors)
        tensors["input_ids"] = storage.canvas[tensors["token_lane"], tensors["token_slot"]].unsqueeze(0)
        if first:
            return first_ragged_forward(model, storage, **tensors), step
        return ragged_forward(model, **tensors, keys=[storage.keys[i] for i in range(len(storage.keys))],
                              values=[storage.values[i] for i in range(len(storage.values))]), step

    with torch.no_grad():
        forward([0] * rows, [length] * rows, buckets=False, first=True)  # every row's keys / values stored
        starts, lengths = [0] + [5] * (rows - 1), [length] + [1] * (rows - 1)
        plain, _ = forward(starts, lengths, buckets=False)
        bucketed, step = forward(starts, lengths, buckets=True)
    assert (step.rows, step.num_tokens) == (18, 32)
    assert int(step.tensors["head_index"].max()) < step.num_tokens
    torch.testing.assert_close(bucketed[:rows, :length], plain[:rows, :length], rtol=1e-5, atol=1e-5)


# dInfer's credit decoding: rows of several credit settings (and plain threshold rows) share steps; a seeded row,
# a guided row and aligned blocks of two widths (a partial first block) among them
CREDIT_RULES = [dict(threshold=0.7, credit_alpha=0.7), dict(threshold=0.5, credit_alpha=1.5, credit_decay=0.5),
                dict(threshold=0.7), dict(threshold=0.7, credit_alpha=0.7, temperature=0.8, seed=3),
                dict(threshold=0.6, credit_alpha=0.7, align_blocks=True, max_new_tokens=14),
                dict(threshold=0.7, credit_alpha=0.7, credit_boost=0.5, cfg_scale=1.0)]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_credit_decoding_equals_generate_in_the_engine_with_rows_joining(cache):
    model = tiny_model("sdpa", eos_token_id=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # confident: several tokens per forward, credit that changes decisions
    engine = ContinuousBatchingEngine(model, max_batch_size=6)
    generator = torch.Generator().manual_seed(8)
    rows = []
    for i, rule in enumerate(CREDIT_RULES * 2):
        ids = torch.randint(0, 90, (3 + i,), generator=generator).tolist()
        rule = dict(rule)
        seed = rule.pop("seed", None)
        options = dict(max_new_tokens=16, block_length=8, cache=cache, stop_on_eos=False)
        options.update(rule)
        rows.append((ids, seed, options, GenerationRequest(ids, engine.sampling_params(seed=seed, **options))))
    forwards = run_arriving(engine, [r[-1] for r in rows], per_step=2)
    assert all(count == 1 for count, had_rows in forwards if had_rows)
    changed = 0
    for ids, seed, options, request in rows:
        assert request.error is None, options
        assert request.generated == reference(model, ids, seed, **options), options
        if "credit_alpha" in options:
            plain = {k: v for k, v in options.items() if not k.startswith("credit_")}
            changed += request.generated != reference(model, ids, seed, **plain)
    assert changed >= 2  # the credit decided tokens in the engine too


def test_step_seconds_count_each_steps_wall_time_also_when_a_step_raises(monkeypatch):
    # /metrics hf_dlm_engine_step_seconds_total: a fake clock that advances 0.25 s per reading makes each step
    # last exactly 0.25 s (one reading before, one after), a step whose forward raises included
    import hf_dlm.serving.engine as engine_module

    clock = iter(0.25 * i for i in range(10_000))
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: next(clock))
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    request = GenerationRequest([3, 4, 7], engine.sampling_params(max_new_tokens=8, block_length=4, steps=8,
                                                                   stop_on_eos=False))
    engine.submit([request])
    engine.run_until_idle()
    assert engine.stats["engine_steps"] >= 8 and request.finish_reason == "length"
    assert engine.stats["step_seconds"] == 0.25 * engine.stats["engine_steps"]
    monkeypatch.setattr(engine, "_admit", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert engine.stats["step_seconds"] == 0.25 * (engine.stats["engine_steps"] + 1)  # counted before it raised


def test_a_step_by_lane_puts_row_r_on_lane_r_and_attends_to_a_view_of_the_storage():
    # the engine's rows sit at their lanes' places, so attention reads the storage's first lanes as a view; gathering
    # the rows' lanes copied every layer's keys / values (11% of a batch-64 LLaDA-8B step on the H100)
    from hf_dlm.generation.slot_cache import RaggedKV, RaggedStep, SlotStorage

    storage = SlotStorage(torch.device("cpu"), 0)
    storage.reserve(4, 8)
    step = RaggedStep(storage, [2, 0], [5, 0], [2, 3], [8, 8], buckets=True, heads=[(6, 1), (0, 3)],
                      extra={"canvas_lanes": [2, 0]}, by_lane=True)
    tensors = step.tensors
    assert tensors["lanes"] is None and step.rows == 3
    assert tensors["token_row"][:5].tolist() == [0, 0, 0, 2, 2]  # lane 0's 3 tokens, then lane 2's 2
    assert tensors["token_slot"][:5].tolist() == [0, 1, 2, 5, 6] and tensors["token_lane"][:5].tolist() == [0, 0, 0, 2, 2]
    assert tensors["q_index"].tolist() == [[0, 1, 2], [0, 0, 0], [3, 4, 0]]  # lane 1: a filler row
    # the LM head's rows are the given rows, in their order: lane 2's head (slot 6 = token 4), then lane 0's;
    # the idle lane 1 costs no LM-head columns
    assert tensors["head_index"].tolist() == [[4, 4, 4], [0, 1, 2]]
    assert step.extra["canvas_lanes"].tolist() == [0, 2, 2]
    assert not tensors["mask"][1, 0, :, 1:].any()  # the filler row sees slot 0 only
    # attention against the view equals attention against the gathered lanes
    keys, values = torch.randn(4, 9, 1, 2), torch.randn(4, 9, 1, 2)
    module = type("Attention", (), {"layer_idx": 0, "scaling": 0.5})()
    query = torch.randn(1, 1, tensors["token_row"].numel(), 2)
    index = {name: tensors[name] for name in ("token_lane", "token_slot", "token_row", "token_qpos", "q_index")}
    by_view = RaggedKV([keys], [values], **index, mask=tensors["mask"], lanes=None).attention(module, query)
    gathered = RaggedKV([keys], [values], **index, mask=tensors["mask"], lanes=torch.arange(3)).attention(module, query)
    torch.testing.assert_close(by_view, gathered, rtol=0, atol=0)
    with pytest.raises(ValueError, match="a lane of its own"):
        RaggedStep(storage, [1, 1], [0, 0], [1, 1], [8, 8], by_lane=True)


def test_a_step_mixing_a_block_start_with_windows_attends_in_two_calls_without_padding_the_windows():
    # hand layout: lane 2 refreshes its whole canvas (24 queries), lanes 0, 1 and 3 query 4-token windows, all
    # against 24 keys. One call pads every row to 24 queries (4 x 24 x 24 = 2304 pairs); two calls compute
    # 4 x 4 x 24 + 1 x 24 x 24 = 960 (<= half): lane 2 is the long row, a filler row of the short call
    from hf_dlm.generation.slot_cache import RaggedKV, RaggedStep, SlotStorage, long_rows

    assert long_rows([24, 4, 4, 4], [24] * 4, buckets=False) == [0]
    assert long_rows([24, 20, 4, 4], [24] * 4, buckets=False) == []  # 4x20x24 + 2x24x24 > half of 4x24x24
    # bucketed, the GPU benchmark's arrivals: 4 block starts (320 queries) beside 28 windows (32), 320 keys:
    # 32 x 32 x 320 + 4 x 320 x 320 = 0.22 of 32 x 320 x 320. A lone block start beside three windows does not
    # pay: a bucketed second call has at least two rows (4 x 32 x 320 + 2 x 320 x 320 = 0.6 of 4 x 320 x 320)
    assert long_rows([320] * 4 + [32] * 28, [320] * 32, buckets=True) == [0, 1, 2, 3]
    assert long_rows([320, 32, 32, 32], [320] * 4, buckets=True) == []
    assert long_rows([320, 32, 32, 32], [320] * 4, buckets=False) == [0]  # unbucketed, one row: 0.35
    storage = SlotStorage(torch.device("cpu"), 0, round_to=8)
    storage.reserve(4, 24)
    lengths, starts = [4, 4, 24, 4], [16, 16, 0, 16]
    step = RaggedStep(storage, [0, 1, 2, 3], starts, lengths, [24] * 4, by_lane=True)
    tensors = step.tensors
    assert tensors["short_index"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0] * 4, [32, 33, 34, 35]]
    assert tensors["long_index"].tolist() == [list(range(8, 32))] and tensors["long_lanes"].tolist() == [2]
    assert tuple(tensors["mask"].shape) == (4, 1, 4, 24) and tuple(tensors["long_mask"].shape) == (1, 1, 24, 24)
    assert not tensors["mask"][2, 0, :, 1:].any() and tensors["mask"][[0, 1, 3]].all() and tensors["long_mask"].all()
    # outputs laid end to end, (4 rows x 4) then (1 x 24): the windows' tokens at 4 r + q, lane 2's at 16 + q
    assert tensors["token_out"].tolist() == [4 * r + q for r in (0, 1) for q in range(4)] + [16 + q for q in range(24)] \
        + [12 + q for q in range(4)]
    # attention equals softmax(q k / sqrt) v by hand, row by row (grouped queries: 2 heads on 1 kv head)
    torch.manual_seed(0)
    keys, values = torch.randn(4, 25, 1, 8), torch.randn(4, 25, 1, 8)
    module = type("Attention", (), {"layer_idx": 0, "scaling": 8 ** -0.5})()
    query = torch.randn(1, 2, 36, 8)
    index = {name: tensors[name] for name in ("token_lane", "token_slot", "token_row", "token_qpos", "q_index",
                                             "short_index", "long_index", "long_lanes", "long_mask", "token_out")}
    output = RaggedKV([keys], [values], **index, mask=tensors["mask"], lanes=None).attention(module, query)[0]
    first = 0
    for lane, count in enumerate(lengths):
        q = query[0, :, first : first + count]  # (2, count, 8)
        weights = torch.softmax(q @ keys[lane, :24, 0].T * 8 ** -0.5, -1)
        expected = (weights @ values[lane, :24, 0]).transpose(0, 1)  # (count, 2, 8)
        torch.testing.assert_close(output[first : first + count], expected, rtol=1e-5, atol=1e-5)
        first += count
    unsplit = RaggedStep(storage, [0, 1, 2, 3], starts, lengths, [24] * 4, by_lane=True, split=False)
    assert unsplit.tensors["long_index"] is None and tuple(unsplit.tensors["mask"].shape) == (4, 1, 24, 24)


def test_grouped_query_attention_reads_the_storage_keys_and_values_without_copies(monkeypatch):
    # 4 query heads on 2 kv heads: each SDPA call of the engine gets views of the slot storage (the query heads of a
    # kv head stacked along the query axis), not keys / values repeated per query head (a copy of every row's
    # canvas per layer and step); the tokens equal generate alone
    model = tiny_model("sdpa")
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    options = dict(max_new_tokens=8, block_length=4, steps=8, cache="dual", stop_on_eos=False)
    alone = [model.generate(torch.tensor([ids]), **options)[0, len(ids):].tolist() for ids in prompts]
    engine = ContinuousBatchingEngine(model, max_batch_size=2, preallocate=True, max_length=16)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], key.untyped_storage().data_ptr(),
                      value.untyped_storage().data_ptr()))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    requests = [GenerationRequest(ids, engine.sampling_params(**options)) for ids in prompts]
    engine.submit(requests)
    engine.run_until_idle()
    assert [r.generated for r in requests] == alone
    stored = {t.untyped_storage().data_ptr() for store in (engine.storage.keys, engine.storage.values)
              for t in store.values()}
    assert calls and all(q_heads == k_heads == 2 for q_heads, k_heads, _, _ in calls), calls
    assert all(k in stored and v in stored for _, _, k, v in calls), calls


@pytest.mark.parametrize("mode", ["bidirectional", "block"])
def test_seeded_sampled_rows_share_one_commit_call_and_each_draws_as_generate_alone(monkeypatch, mode):
    # each seeded row draws its Gumbel noise from its own generator, so rows with equal settings share one commit
    # call (they took one call each) and still decode as generate alone with their seed; block models' aligned
    # blocks give rows of different widths in one call. Random remasking draws inside the rule: a call per row.
    from hf_dlm.serving import engine as engine_module

    calls = []
    original = engine_module.decide_step

    def recording(logits, current, candidates, settings, *args, **kwargs):
        calls.append((settings.remasking, logits.shape[0]))
        return original(logits, current, candidates, settings, *args, **kwargs)

    monkeypatch.setattr(engine_module, "decide_step", recording)
    model = tiny_model("sdpa", eos_token_id=5, attention_mode=mode, **({"block_size": 4} if mode == "block" else {}))
    engine = ContinuousBatchingEngine(model, max_batch_size=6)
    generator = torch.Generator().manual_seed(7)
    sampled = dict(max_new_tokens=8, block_length=4, temperature=0.8, cache="dual", stop_on_eos=False,
                   align_blocks=mode == "block")  # aligned: prompts of 3, 6 and 5 tokens start with blocks of 1, 2, 3
    rows = []
    for seed, (length, extra) in enumerate([(3, {}), (6, {}), (5, {}), (4, dict(remasking="random")),
                                            (7, dict(remasking="random"))]):
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = {**sampled, **extra}
        request = GenerationRequest(ids, engine.sampling_params(seed=10 + seed, **options))
        rows.append((ids, 10 + seed, options, request))
    engine.submit([r[-1] for r in rows])
    engine.run_until_idle()
    assert all(r[-1].error is None for r in rows)
    # the three low-confidence rows together, each random-remasking row alone
    assert max(size for rule, size in calls if rule == "low_confidence") == 3
    assert {size for rule, size in calls if rule == "random"} == {1}
    for ids, seed, options, request in rows:
        assert request.generated == reference(model, ids, seed, **options), (seed, options)
