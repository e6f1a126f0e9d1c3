"""The lm-eval model `hf-dlm`: the ELBO log-likelihood against hand-computed values, scores independent of
the batch size, and lm-eval's `simple_evaluate` on tiny local tasks end to end on CPU."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.utils import save_tiny_checkpoint

pytest.importorskip("lm_eval")

TASKS = {
    "tiny_choice": """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["dog"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""",
    "tiny_ppl": """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}"
metric_list:
  - metric: word_perplexity
""",
}
DOCS = [{"question": q, "choices": [" fox", " dog", " model"], "answer": a}
        for q, a in [("the quick brown", 0), ("over the lazy", 1), ("a diffusion", 2), ("fills in masked", 2),
                     ("the lazy", 1), ("jumps over the", 1), ("quick", 0), ("masked tokens", 2)]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model, tokenizer = save_tiny_checkpoint(root / "model")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tasks").mkdir()
    for name, text in TASKS.items():
        (root / "tasks" / f"{name}.yaml").write_text(text.format(data=data))
    return root, model, tokenizer


def make_lm(setup, **kwargs):
    from hf_dlm.evaluation.lm_eval_model import DLMEvalHarness

    _, model, tokenizer = setup
    return DLMEvalHarness(model=model, tokenizer=tokenizer, **kwargs)


def flat(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from flat(item)
    else:
        yield value


class _Request:
    def __init__(self, *args):
        self.args = args


def test_elbo_loglikelihood_matches_hand_computed_values(setup):
    _, model, tokenizer = setup
    lm = make_lm(setup, mc_num=2, batch_size=4)
    mask = model.config.mask_token_id
    context = tokenizer("the quick brown", add_special_tokens=False)["input_ids"]

    def masked_log_probs(ids, positions):
        noisy = torch.tensor([ids])
        noisy[0, positions] = mask
        with torch.no_grad():
            log_probs = F.log_softmax(model(input_ids=noisy).logits[0].double(), -1)
        return [float(log_probs[p, ids[p]]) for p in positions]

    # one continuation token: l = 1 always, the bound is exactly log p(token | context, token masked)
    one = [tokenizer.convert_tokens_to_ids("Ġthe")]
    (value, greedy), = lm._score([(context, one)])
    ids = context + one
    assert value == pytest.approx(masked_log_probs(ids, [len(context)])[0], abs=1e-6)
    with torch.no_grad():
        noisy = torch.tensor([context + [mask]])
        argmax = int(model(input_ids=noisy).logits[0, -1].argmax())
    assert greedy == (argmax == one[0])

    # two tokens, mc_num = 2: stratified l = 1 then l = 2, so the estimate is
    # ((2/1) * -log p(masked one | ...) + (2/2) * (sum over both masked)) / 2, for the one token drawn
    two = tokenizer.convert_tokens_to_ids(["Ġlaz", "y"])
    (value, _), = lm._score([(context, two)])
    ids, a, b = context + two, len(context), len(context) + 1
    both = sum(masked_log_probs(ids, [a, b]))
    candidates = [(2 * masked_log_probs(ids, [p])[0] + both) / 2 for p in (a, b)]
    assert min(abs(value - c) for c in candidates) < 1e-6, (value, candidates)


def test_scores_do_not_depend_on_batch_size_or_order(setup):
    requests = [_Request(d["question"], choice) for d in DOCS for choice in d["choices"]]
    one = make_lm(setup, mc_num=4, batch_size=1).loglikelihood(requests, disable_tqdm=True)
    eight = make_lm(setup, mc_num=4, batch_size=8).loglikelihood(requests[::-1], disable_tqdm=True)[::-1]
    for (a, greedy_a), (b, greedy_b) in zip(one, eight):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b
    assert len({round(a, 3) for a, _ in one}) > 5  # real, distinct scores


def test_simple_evaluate_runs_local_tasks_end_to_end_and_batch_size_does_not_matter(setup):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    root, model, tokenizer = setup
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    outputs = {}
    for batch_size in (1, 8):
        lm = make_lm(setup, mc_num=4, batch_size=batch_size, max_gen_toks=8, block_length=4)
        outputs[batch_size] = simple_evaluate(model=lm, tasks=list(TASKS), task_manager=manager, log_samples=True,
                                              random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    results = outputs[1]["results"]
    assert 0.0 <= results["tiny_choice"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["tiny_gen"]
    perplexity = results["tiny_ppl"]["word_perplexity,none"]
    assert math.isfinite(perplexity) and perplexity > 1
    for task in TASKS:
        a, b = outputs[1]["samples"][task], outputs[8]["samples"][task]
        assert len(a) == len(DOCS)
        for x, y in zip(a, b):  # the same answers and scores, sample by sample
            for p, q in zip(flat(x["filtered_resps"]), flat(y["filtered_resps"])):
                assert p == q if isinstance(p, (str, bool)) else abs(p - q) < 1e-5, (task, x, y)
    for task, metric in (("tiny_choice", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert outputs[8]["results"][task][metric] == results[task][metric]
    assert outputs[8]["results"]["tiny_ppl"]["word_perplexity,none"] == pytest.approx(
        results["tiny_ppl"]["word_perplexity,none"], rel=1e-5)


def test_lora_adapter_loads_through_model_args(setup, tmp_path):
    peft = pytest.importorskip("peft")
    from lm_eval.api.registry import get_model

    from hf_dlm.evaluation.lm_eval_model import DLMEvalHarness

    root, model, tokenizer = setup
    torch.manual_seed(1)
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))  # random B: a real change
    lora.save_pretrained(tmp_path / "adapter")
    merged = lora.merge_and_unload().eval()  # the same weights, merged by hand
    requests = [_Request(d["question"], d["choices"][0]) for d in DOCS[:3]]
    adapted = get_model("hf-dlm").create_from_arg_string(
        f"pretrained={root / 'model'},peft={tmp_path / 'adapter'},mc_num=2,device=cpu,dtype=float32")
    got = adapted.loglikelihood(requests, disable_tqdm=True)
    want = DLMEvalHarness(model=merged, tokenizer=tokenizer, mc_num=2).loglikelihood(requests, disable_tqdm=True)
    base = make_lm(setup, mc_num=2).loglikelihood(requests, disable_tqdm=True)
    for (a, _), (b, _), (c, _) in zip(got, want, base):
        assert a == pytest.approx(b, abs=1e-5) and abs(a - c) > 1e-4



def test_eval_command_writes_results_and_names_unknown_tasks(setup, tmp_path, capsys):
    from hf_dlm.cli import main

    root, _, _ = setup
    common = ["eval", "--model", str(root / "model"), "--include-path", str(root / "tasks"), "--only-include-path",
              "--device", "cpu", "--mc-num", "2", "--batch-size", "4"]
    assert main([*common, "--tasks", "tiny_nope"]) == 2
    assert "unknown task(s) ['tiny_nope']" in capsys.readouterr().err
    output = tmp_path / "results.json"
    assert main([*common, "--tasks", "tiny_choice", "--limit", "4", "--output", str(output)]) == 0
    assert "tiny_choice" in capsys.readouterr().out
    results = json.loads(output.read_text())["results"]["tiny_choice"]
    assert 0.0 <= results["acc,none"] <= 1.0
    assert main([*common, "--tasks", "tiny_choice", "--limit", "2", "--greedy-check", "iterative", "--subs"]) == 0


def llada_suffix_greedy_prediction(model, prefix, target, mask_id):
    """LLaDA eval_llada.py `suffix_greedy_prediction` (batch 1, no CFG), from its description: start from
    prefix + len(target) masks; len(target) times: x0 = argmax of the masked positions' logits, confidence =
    softmax(x0); keep x0 only at the most confident masked position; finally compare with the target."""
    seq = torch.full((1, len(prefix) + len(target)), mask_id)
    seq[0, :len(prefix)] = torch.tensor(prefix)
    for _ in range(len(target)):
        mask_index = seq == mask_id
        with torch.no_grad():
            logits = model(input_ids=seq).logits[mask_index]
        x0 = torch.argmax(logits, dim=-1)
        p = torch.softmax(logits.to(torch.float32), dim=-1)
        confidence = torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)
        _, index = torch.sort(confidence, descending=True)
        x0[index[1:]] = mask_id
        seq[mask_index] = x0.clone()
    return bool((torch.tensor(target) == seq[0, len(prefix):]).all()), seq[0, len(prefix):].tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iterative_greedy_check_is_llada_suffix_greedy_prediction(seed):
    """greedy_check="iterative" equals LLaDA's suffix_greedy_prediction on tiny models, batched with mixed
    lengths and right padding; targets include each model's own iterative decode (greedy) and perturbations."""
    from hf_dlm.evaluation.lm_eval_model import DLMEvalHarness

    from tests.utils import MASK_ID, VOCAB, tiny_model

    model = tiny_model(seed=seed)
    tokenizer = type("Tok", (), {"eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0})()
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for n in range(8):
        prefix = torch.randint(1, VOCAB - 1, (int(torch.randint(2, 7, (1,), generator=generator)),),
                               generator=generator).tolist()
        length = int(torch.randint(1, 5, (1,), generator=generator))
        _, decoded = llada_suffix_greedy_prediction(model, prefix, [1] * length, MASK_ID)
        target = decoded if n % 2 == 0 else decoded[:-1] + [(decoded[-1] + 1) % (VOCAB - 1)]
        pairs.append((prefix, target))
    lm = DLMEvalHarness(model=model, tokenizer=tokenizer, mc_num=1, batch_size=8, greedy_check="iterative")
    ours = [greedy for _, greedy in lm._score(pairs)]
    expected = [llada_suffix_greedy_prediction(model, p, t, MASK_ID)[0] for p, t in pairs]
    assert ours == expected and any(expected) and not all(expected)
    # the default one-forward check is another test: it accepts a different set (here or on another seed)
    one_forward = [greedy for _, greedy in DLMEvalHarness(model=model, tokenizer=tokenizer, mc_num=1,
                                                          batch_size=8)._score(pairs)]
    if seed == 0:
        assert one_forward != expected


def test_greedy_check_is_validated_by_name(setup):
    from hf_dlm.utils.errors import FieldError

    with pytest.raises(FieldError, match="greedy_check"):
        make_lm(setup, greedy_check="sometimes")


@pytest.mark.parametrize("rule", [dict(factor=1.0, cache="dual"), dict(threshold=0.5, editing_threshold=0.3),
                                  # credit: a setting whose tokens differ from plain threshold 0.05 on this model
                                  dict(threshold=0.05, credit_alpha=5.0, credit_decay=1.0, cache="dual")])
def test_generate_until_runs_the_decoding_core_with_its_commit_rules(setup, rule):
    # model args as lm-eval passes them (strings) reach the engine: the answer equals model.generate's
    _, model, tokenizer = setup
    lm = make_lm(setup, max_gen_toks=8, block_length=4, **{k: str(v) for k, v in rule.items() if k != "cache"},
                 cache=rule.get("cache"))
    context = "the quick brown"
    (answer,) = lm.generate_until([_Request(context, {"until": ["\n\n"]})], disable_tqdm=True)
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, block_length=4, steps=8, stop_on_eos=False, **rule)
    tokens = out[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    expected = tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens, skip_special_tokens=True)
    assert answer == expected.split("\n\n")[0]
    with pytest.raises(ValueError, match="editing_threshold"):
        make_lm(setup, editing_threshold="0.5").generate_until([_Request(context, {})], disable_tqdm=True)


def test_generate_until_sizes_the_engine_for_its_longest_row(setup, monkeypatch):
    # a compiled engine on CUDA preallocates max_batch_size x max_length slots: the harness asks for the longest
    # row's canvas (prompt + max_gen_toks rounded up to blocks), not the model's positions
    from hf_dlm.evaluation import lm_eval_model

    _, model, tokenizer = setup
    built = []

    class Recording(lm_eval_model.ContinuousBatchingEngine):
        def __init__(self, *args, **kwargs):
            built.append(kwargs["max_length"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval_model, "ContinuousBatchingEngine", Recording)
    lm = make_lm(setup, max_gen_toks=8, block_length=4)
    contexts = ["the quick brown", "the quick brown fox jumps over"]
    lm.generate_until([_Request(c, {"max_gen_toks": 6}) for c in contexts], disable_tqdm=True)
    longest = max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts)
    assert built == [longest + 8]  # 6 new tokens in whole blocks of 4
    assert built[0] < model.config.max_position_embeddings


def test_causal_scores_by_hand():
    """AR log-likelihood of the continuation: token j is scored by the logits at j - 1, prompt and padding
    not at all (a transcription over the full forward; the same call, so exact up to float64 summation)."""
    import torch

    from hf_dlm.evaluation.scoring import _batch_rows, _causal_scores
    from tests.utils import tiny_model

    model = tiny_model(attention_mode="causal", seed=4).eval()
    rows = [([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15])]  # row 0 right-padded by one
    input_ids, attention_mask, prompt_mask = _batch_rows(rows, pad_token_id=0)
    total, greedy = _causal_scores(model, input_ids, attention_mask, prompt_mask)
    with torch.no_grad():
        logp = model(input_ids=input_ids, attention_mask=attention_mask).logits.float().log_softmax(-1)
    for r, (context, continuation) in enumerate(rows):
        positions = range(len(context), len(context) + len(continuation))
        expected = sum(float(logp[r, j - 1, input_ids[r, j]]) for j in positions)
        assert float(total[r]) == pytest.approx(expected, rel=1e-6, abs=1e-6)
        assert bool(greedy[r]) == all(int(logp[r, j - 1].argmax()) == int(input_ids[r, j]) for j in positions)


def test_greedy_one_forward_checks_only_the_answer():
    """A stand-in model that predicts every token right except position 0 (a prompt token): the answer is
    greedy; predicting one answer token wrong makes it not greedy."""
    from types import SimpleNamespace

    import torch

    from hf_dlm.evaluation.scoring import greedy_one_forward

    ids = torch.tensor([[1, 2, 3, 4]])
    answer = torch.tensor([[False, False, True, True]])

    class StandIn:
        def __init__(self, wrong):
            self.wrong = wrong

        def denoising_logits(self, noisy, attention_mask=None):
            target = ids.clone()
            target[0, self.wrong] = 0
            return torch.nn.functional.one_hot(target, 8).float()

    assert greedy_one_forward(StandIn(0), ids, None, answer, mask_id=7).tolist() == [True]
    assert greedy_one_forward(StandIn(3), ids, None, answer, mask_id=7).tolist() == [False]
