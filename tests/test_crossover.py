"""benchmarks/crossover.py: the --tiny study's JSON (both curves, epochs, matched data order, the MoE study),
the AR NLL and AR continuation scores against a hand computation (one forward per prefix), the DLM's
multiple-choice scores through the lm-eval model's path, the crossover / over-fit rules and the plot."""

import importlib.util
import json
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch

from hf_dlm.data.memory_dataset import pack_documents
from hf_dlm.evaluation.scoring import score_continuations
from hf_dlm.modeling import DLMConfig, DLMForDiffusionLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark():
    spec = importlib.util.spec_from_file_location("crossover", os.path.join(ROOT, "benchmarks", "crossover.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(attention_mode: str, seed: int = 0) -> DLMForDiffusionLM:
    config = DLMConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=32, mask_token_id=39, pad_token_id=0, attention_mode=attention_mode)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return DLMForDiffusionLM(config).eval()


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("crossover") / "tiny.json"
    status = load_benchmark().main(["--tiny", "--out", str(out)])
    return status, json.loads(out.read_text()), out


def test_tiny_study_writes_both_curves_with_matched_settings(tiny_results):
    status, results, _ = tiny_results
    assert status == 0, [r.get("error") for r in results["runs"]]
    study = results["study"]
    training, seq_len = study["training"], study["corpus"]["seq_len"]
    tokens_per_step = training["batch_size"] * seq_len
    crossover = [r for r in results["runs"] if r["study"] == "crossover"]
    assert len(crossover) == 2 * len(study["budgets"]) * len(study["sizes"])
    for run in crossover:
        assert run["unique_tokens"] <= run["budget"] and run["unique_tokens"] % tokens_per_step == 0
        assert run["epochs"] == pytest.approx(training["steps"] * tokens_per_step / run["unique_tokens"], abs=1e-3)
        # every trained window was read (plus, at most, the data loader's one-batch look-ahead)
        assert 0 <= run["samples_read"] - training["steps"] * training["batch_size"] <= training["batch_size"]
        assert run["objective_preset"] == ("ar" if run["objective"] == "ar" else "megadlms")
        curve = run["curve"]
        assert [p["step"] for p in curve] == [4, 8, 12]
        metric = "heldout_nll" if run["objective"] == "ar" else "heldout_elbo"
        for point in curve:
            assert point["epoch"] == pytest.approx(point["step"] * tokens_per_step / run["unique_tokens"], abs=1e-3)
            assert math.isfinite(point[metric]) and 0 < point[metric] < 2 * math.log(results["corpus"]["vocab_size"])
            assert 0.0 <= point["mc_accuracy"] <= 1.0
        assert curve[-1][metric] < math.log(results["corpus"]["vocab_size"])  # it learned something
    pairs = {}
    for run in crossover:  # AR and DLM: same data order, same shape, same tokens per step
        pairs.setdefault((run["size"], run["budget"]), []).append(run)
    for ar, dlm in pairs.values():
        assert ar["data_order_sha1"] == dlm["data_order_sha1"]
        assert ar["initial_weights_fingerprint"] == dlm["initial_weights_fingerprint"]
        assert ar["parameters"] == dlm["parameters"] and ar["tokens_per_step"] == dlm["tokens_per_step"]
    epochs = sorted((r["unique_tokens"], r["epochs"]) for r in crossover)
    assert epochs[0][1] > epochs[-1][1]  # the smaller budget is repeated more
    assert len(results["summary"]) == len(pairs)
    assert results["corpus"]["heldout_documents"] > 0 and results["corpus"]["train_documents"] > 0


def test_tiny_moe_study_has_equal_active_parameters(tiny_results):
    _, results, _ = tiny_results
    study = results["study"]
    moe = [r for r in results["runs"] if r["study"] == "moe"]
    assert [r["router"] for r in moe] == study["moe"]["routers"]
    dense = next(r for r in results["runs"] if r["study"] == "crossover" and r["objective"] == "dlm"
                 and r["budget"] == min(study["budgets"]) and r["size"] == study["moe"]["size"])
    size = study["sizes"][study["moe"]["size"]]
    router_weights = size["num_hidden_layers"] * size["hidden_size"] * study["moe"]["num_experts"]
    for run in moe:
        # the experts a token runs hold as many weights as the dense MLP: only the routers are extra
        assert run["active_parameters"] == dense["active_parameters"] + router_weights
        assert run["parameters"] > run["active_parameters"]
        assert run["data_order_sha1"] == dense["data_order_sha1"]
        assert math.isfinite(run["curve"][-1]["heldout_elbo"])


def test_corpus_split_by_document_and_passages_with_their_true_continuation():
    bench = load_benchmark()
    corpus = dict(max_files=20, heldout_fraction=0.2, vocab_size=300, seq_len=16, eval_windows=4, mc_passages=6,
                  mc_context=8, mc_continuation=4)
    data = bench.build_data(corpus, seed=0, log=lambda *_: None)
    from hf_dlm.data.corpus import split_documents, stdlib_documents

    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=20), 0.2)
    assert not set(train_docs) & set(heldout_docs) and data["stats"]["heldout_documents"] == len(heldout_docs)
    encode = lambda texts: data["tokenizer"](texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    heldout = [ids for ids in encode(heldout_docs) if len(ids) >= 12]
    assert len(data["passages"]) == min(6, len(heldout)) >= 2
    for passage in data["passages"]:
        truth = passage["context"] + passage["candidates"][passage["answer"]]
        assert truth in [ids[:12] for ids in heldout]  # the true continuation follows its context
        for n, candidate in enumerate(passage["candidates"]):  # the others come from other held-out documents
            assert len(candidate) == 4 and (n == passage["answer"] or passage["context"] + candidate not in
                                            [ids[:12] for ids in heldout])
    assert sorted(p["answer"] for p in data["passages"]) != [0] * len(data["passages"])  # the slot varies
    # the training windows are the training documents only, shuffled once, joined by EOS (budgets: prefixes)
    random.Random(0).shuffle(train_docs)
    expected = pack_documents(encode(train_docs), 16, data["tokenizer"].eos_token_id)[0]
    assert torch.equal(data["train"], expected)
    assert data["windows"].shape == (4, 16)


def test_ar_nll_and_continuation_scores_equal_a_hand_computation():
    bench = load_benchmark()
    model = tiny_model("causal")
    torch.manual_seed(1)
    windows = torch.randint(1, 39, (3, 9))
    passages = [{"context": torch.randint(1, 39, (5,)).tolist(),
                 "candidates": [torch.randint(1, 39, (3,)).tolist() for _ in range(4)], "answer": a} for a in (0, 2)]

    def logp_next(prefix, token):  # the model on the prefix alone, its last position's log-probability of token
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix])).logits[0, -1].double()
        return float(torch.log_softmax(logits, -1)[token])

    hand_sum = sum(logp_next(w[:j], w[j]) for w in windows.tolist() for j in range(1, 9))
    data = {"tokenizer": SimpleNamespace(pad_token_id=0), "windows": windows, "passages": passages}
    training = {"eval_batch_size": 2, "seed": 0, "elbo_mc_num": 1, "mc_mc_num": 1}
    metrics = bench.heldout_metrics(model, data, training)
    assert metrics["heldout_nll"] == pytest.approx(-hand_sum / (3 * 8), abs=1e-5)

    pairs = [(p["context"], c) for p in passages for c in p["candidates"]]
    hand = [sum(logp_next(ctx + cont[:k], cont[k]) for k in range(len(cont))) for ctx, cont in pairs]
    scores = score_continuations(model, pairs, batch_size=3)
    assert [s for s, _ in scores] == pytest.approx(hand, abs=1e-5)
    predicted = [max(range(4), key=lambda c: hand[4 * n + c]) for n in range(2)]
    assert metrics["mc_accuracy"] == sum(p == q["answer"] for p, q in zip(predicted, passages)) / 2
    # greedy: every continuation token is the next-token argmax (a continuation made of the argmaxes is)
    ctx = passages[0]["context"]
    greedy = []
    for _ in range(3):
        with torch.no_grad():
            greedy.append(int(model(input_ids=torch.tensor([ctx + greedy])).logits[0, -1].argmax()))
    assert score_continuations(model, [(ctx, greedy), (ctx, greedy[:2] + [(greedy[2] + 1) % 39])])[0][1] is True
    assert score_continuations(model, [(ctx, greedy[:2] + [(greedy[2] + 1) % 39])])[0][1] is False


def test_dlm_heldout_elbo_and_choices_go_through_the_lm_eval_scoring_path():
    bench = load_benchmark()
    model = tiny_model("bidirectional")
    torch.manual_seed(2)
    windows = torch.randint(1, 39, (2, 6))
    passages = [{"context": torch.randint(1, 39, (4,)).tolist(),
                 "candidates": [torch.randint(1, 39, (1,)).tolist() for _ in range(4)], "answer": 1}]
    data = {"tokenizer": SimpleNamespace(pad_token_id=0), "windows": windows, "passages": passages}
    metrics = bench.heldout_metrics(model, data, {"eval_batch_size": 4, "seed": 0, "elbo_mc_num": 3, "mc_mc_num": 2})
    # one-token continuations: the ELBO is exact, log p(token | context, token masked)
    ctx = passages[0]["context"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + [39]])).logits[0, -1].double(), -1)
    values = [float(logp[c[0]]) for c in passages[0]["candidates"]]
    assert metrics["mc_accuracy"] == float(max(range(4), key=values.__getitem__) == 1)
    # the held-out ELBO is the lm-eval model's scoring of (first token, rest of the window)
    pytest.importorskip("lm_eval")
    from hf_dlm.evaluation.lm_eval_model import DLMEvalHarness

    lm = DLMEvalHarness(model=model, tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=1, bos_token_id=None),
                        mc_num=3, seed=0, batch_size=1)
    scores = lm._score([(w[:1], w[1:]) for w in windows.tolist()])
    assert metrics["heldout_elbo"] == pytest.approx(-sum(s for s, _ in scores) / 10, abs=1e-6)


def test_crossover_and_overfit_rules_on_hand_cases():
    bench = load_benchmark()
    epochs = [1, 2, 3, 4, 5]
    # accuracy: DLM behind, level, then ahead for good from epoch 3
    assert bench.crossover_epoch(epochs, [.3, .4, .4, .5, .5], [.2, .3, .4, .6, .7], True) == 3
    # ahead, behind again at epoch 4, ahead at the end: the crossover is the last one (epoch 5)
    assert bench.crossover_epoch(epochs, [.3, .4, .4, .5, .5], [.2, .5, .5, .4, .6], True) == 5
    assert bench.crossover_epoch(epochs, [.3, .4, .4, .5, .5], [.2, .5, .5, .6, .5], True) is None  # level at the end
    assert bench.crossover_epoch(epochs, [.3] * 5, [.4] * 5, True) == 1  # ahead throughout
    # losses: lower is better
    assert bench.crossover_epoch(epochs, [5, 4, 3, 3.5, 4], [6, 5, 3.2, 3.1, 3.0], False) == 4
    assert bench.overfit_epoch(epochs, [5, 4, 3, 3.5, 4]) == 3
    assert bench.overfit_epoch(epochs, [5, 4, 3, 3.02, 3.01]) is None  # within 1% of the minimum
    assert bench.overfit_epoch(epochs, [5, 4, 3, 2, 1]) is None


def test_plot_renders_one_panel_per_budget(tiny_results, tmp_path):
    pytest.importorskip("matplotlib")
    _, results, path = tiny_results
    png = tmp_path / "crossover.png"
    assert load_benchmark().main(["--plot", str(path), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_runner_pair_differs_only_in_attention_objective_and_output_and_trains(tmp_path):
    from hf_dlm.training.runner import build_trainer, load_config

    tiny = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
            "model.config.max_position_embeddings=32", "data.seq_len=32", "data.vocab_size=300", "data.max_files=20",
            "training.bf16=false", "training.compile_blocks=false", "training.use_cpu=true", "training.max_steps=3",
            "training.per_device_train_batch_size=4", "training.warmup_steps=1", "training.disable_tqdm=true"]
    configs = {}
    for name in ("ar", "dlm"):
        path = os.path.join(ROOT, "examples", "crossover", f"{name}.yaml")
        configs[name] = load_config(path, [*tiny, f"training.output_dir={tmp_path / name}"])
    ar, dlm = configs["ar"], configs["dlm"]
    assert {k: v for k, v in ar["model"]["config"].items() if k != "attention_mode"} == \
        {k: v for k, v in dlm["model"]["config"].items() if k != "attention_mode"}
    assert ar["data"] == dlm["data"]
    differ = {k for k in set(ar["training"]) | set(dlm["training"]) if ar["training"].get(k) != dlm["training"].get(k)}
    assert differ == {"output_dir", "objective_preset"}
    assert (ar["model"]["config"]["attention_mode"], dlm["model"]["config"]["attention_mode"]) == ("causal", "bidirectional")
    losses = {}
    for name, config in configs.items():
        trainer, _ = build_trainer(config, name)
        assert trainer.objective.mode == ("ar" if name == "ar" else "diffusion")
        losses[name] = trainer.train().training_loss
    assert all(math.isfinite(v) and v > 0 for v in losses.values())
