"""DLMSFTTrainer gets what DLMTrainer has, through the same hooks (training/diffusion_batch.py and
training/checkpointing.py): atomic checkpoints and exact resume across an epoch boundary, float8 (hf-dlm's
delayed recipe, its amax histories restored on resume), per-block compile, and tokens/s, MFU and
masked-token cross-entropy by t in the logs (the latter checked against a forward pass by hand)."""

import math
import os

import pytest
import torch

pytest.importorskip("trl")

from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from hf_dlm.training.checkpointing import FLOAT8_STATE_NAME, OBJECTIVE_NAME, STAGING_DIR  # noqa: E402
from tests.utils import digit_tokenizer, flat_params, logged, sft_trainer  # noqa: E402
from tests.utils import StopAfter  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps over 8 rows, 4 per step: 3 epochs, so the resume below crosses an epoch boundary."""
    trainer = sft_trainer(tmp_path_factory.mktemp("straight"), rows=8, max_steps=6)
    trainer.train()
    return trainer


def test_sft_resume_reproduces_the_uninterrupted_run(straight, tmp_path):
    assert len(straight.step_losses) == 6 and logged(straight, "learning_rate")[2] > 0
    # every pass over the 8 rows draws new noise: keys epoch * 8 + row
    assert sorted(straight.sample_indices) == list(range(24))
    first = sft_trainer(tmp_path, rows=8, max_steps=6, save_strategy="steps", save_steps=3)
    first.add_callback(StopAfter(3))
    first.train()
    checkpoint = tmp_path / "checkpoint-3"
    assert (checkpoint / OBJECTIVE_NAME).is_file() and not (tmp_path / STAGING_DIR).exists()
    resumed = sft_trainer(tmp_path, rows=8, max_steps=6, save_strategy="steps", save_steps=3, model_seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert first.sample_indices + resumed.sample_indices == straight.sample_indices
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses, dtype=torch.float64),
                               torch.tensor(straight.step_losses, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)


def test_sft_streaming_resume_continues_from_the_saved_stream_position(tmp_path):
    """A streaming train set (datasets.IterableDataset) resumes from the position saved in the checkpoint:
    6 steps of 4 over 8 streamed rows (3 passes) interrupted after step 3 (mid second pass) give the same
    batches, losses and parameters as the uninterrupted run, and rows are keyed pass * 2**40 + row."""
    from hf_dlm.data.hf_stream import EPOCH_STRIDE, HFRowStream
    from hf_dlm.training.checkpointing import DATA_STATE_NAME

    options = dict(rows=8, streaming=True, max_steps=6, save_strategy="steps", save_steps=3)
    straight = sft_trainer(tmp_path / "straight", **options)
    assert isinstance(straight.train_dataset, HFRowStream)
    straight.train()
    assert sorted(straight.sample_indices) == [p * EPOCH_STRIDE + row for p in range(3) for row in range(8)]
    first = sft_trainer(tmp_path / "split", **options)
    first.add_callback(StopAfter(3))
    first.train()
    state = torch.load(tmp_path / "split" / "checkpoint-3" / DATA_STATE_NAME.format(rank=0), weights_only=True)
    assert (state["epoch"], state["row"]) == (1, 4)
    resumed = sft_trainer(tmp_path / "split", model_seed=1, **options)
    resumed.train(resume_from_checkpoint=True)
    assert first.sample_indices + resumed.sample_indices == straight.sample_indices
    for got, want in zip(first.batches + resumed.batches, straight.batches, strict=True):
        for key in ("input_ids", "labels"):
            assert all(torch.equal(g[key], w[key]) for g, w in zip(got, want, strict=True))
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses, dtype=torch.float64),
                               torch.tensor(straight.step_losses, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)


def test_sft_interrupted_save_leaves_the_previous_checkpoint(straight, tmp_path):
    trainer = sft_trainer(tmp_path, rows=8, max_steps=6, save_strategy="steps", save_steps=3)

    def crash(output_dir):  # the process dies after the model and optimizer of step 6 were written
        if trainer.state.global_step == 6:
            raise RuntimeError("simulated crash during save")

    trainer._save_rng_state = crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.train()
    assert os.path.isfile(tmp_path / STAGING_DIR / "checkpoint-6" / "model.safetensors")  # the partial save
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match="already holds checkpoint-3"):  # never trained over by accident
        sft_trainer(tmp_path, rows=8, max_steps=6).train()
    resumed = sft_trainer(tmp_path, rows=8, max_steps=6, save_strategy="steps", save_steps=3, model_seed=1)
    resumed.train(resume_from_checkpoint=True)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6") and not (tmp_path / STAGING_DIR).exists()


def test_sft_delayed_float8_trains_and_resumes_its_amax_histories(straight, tmp_path):
    """fp8_recipe='delayed' converts the linears before accelerate wraps the model; 2 + resume + 2 steps equal
    4 straight (the resumed first step would scale dynamically without the saved histories)."""
    from hf_dlm.parallel.float8_delayed import DelayedFloat8Linear

    common = dict(rows=8, max_steps=4, save_strategy="steps", save_steps=2, fp8_recipe="delayed", fp8_min_features=16)
    fp8 = sft_trainer(tmp_path / "straight", **common)
    layer = fp8.accelerator.unwrap_model(fp8.model).model.layers[0].mlp.up_proj
    assert isinstance(layer, DelayedFloat8Linear)
    fp8.train()
    assert (layer.amax_history[:, :4] > 0).all() and (layer.amax_history[:, 4:] == 0).all()
    torch.testing.assert_close(torch.tensor(fp8.step_losses), torch.tensor(straight.step_losses[:4]), rtol=0.05, atol=0)
    first = sft_trainer(tmp_path / "split", **common)
    first.add_callback(StopAfter(2))
    first.train()
    assert (tmp_path / "split" / "checkpoint-2" / FLOAT8_STATE_NAME.format(rank=0)).is_file()
    resumed = sft_trainer(tmp_path / "split", model_seed=1, **common)
    resumed.train(resume_from_checkpoint=True)
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses, dtype=torch.float64),
                               torch.tensor(fp8.step_losses, dtype=torch.float64), rtol=0, atol=1e-6)


def test_sft_compile_blocks_equals_eager(straight, tmp_path, monkeypatch):
    """compile_blocks compiles every decoder layer in place through parallelize.apply_compile (here with
    dynamo's aot_eager backend: the same graphs without inductor's minutes of C++ builds on a busy CPU)."""
    from hf_dlm.parallel import parallelize

    apply_compile = parallelize.apply_compile
    monkeypatch.setattr(parallelize, "apply_compile",
                        lambda model, options=None: apply_compile(model, {"backend": "aot_eager"}))
    compiled = sft_trainer(tmp_path, rows=8, max_steps=2, compile_blocks=True)
    layers = compiled.accelerator.unwrap_model(compiled.model).model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    compiled.train()
    torch.testing.assert_close(torch.tensor(compiled.step_losses), torch.tensor(straight.step_losses[:2]),
                               rtol=1e-5, atol=1e-5)


def test_sft_logs_throughput_mfu_and_cross_entropy_by_t(tmp_path):
    """One step, one t bucket: the logged `ce_t/0.00-1.00` (read from d loss / d label_weights) equals the
    masked tokens' mean cross-entropy of a forward pass by hand; masked_fraction counts them over real tokens;
    MFU is tokens/s x (6N + 12 L h s) / peak."""
    trainer = sft_trainer(tmp_path, rows=8, max_steps=1, per_device_train_batch_size=8, t_buckets=1, peak_flops=1e9)
    model = trainer.accelerator.unwrap_model(trainer.model)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen = []
    corrupt = trainer._corrupt
    trainer._corrupt = lambda batch, device, t_group=None: seen.append(corrupt(batch, device, t_group)) or seen[-1]
    trainer.train()
    (inputs,) = seen
    log = trainer.state.log_history[0]
    reference = type(model)(model.config)
    reference.load_state_dict(start)
    with torch.no_grad():
        logits = reference(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    labels = inputs["labels"]
    masked = labels != -100
    ce = torch.nn.functional.cross_entropy(logits[masked].double(), labels[masked], reduction="sum")
    assert masked.sum() > 0
    assert log["ce_t/0.00-1.00"] == pytest.approx(float(ce / masked.sum()), rel=1e-4)
    real = int(inputs["attention_mask"].sum())
    assert real < inputs["attention_mask"].numel()  # rows of several lengths: padding, excluded
    assert log["masked_fraction"] == pytest.approx(float(masked.sum()) / real, rel=1e-6)
    config, length = model.config, inputs["input_ids"].shape[1]
    flops = 6 * sum(p.numel() for p in model.parameters()) + 12 * config.num_hidden_layers * config.hidden_size * length
    assert log["mfu"] == pytest.approx(log["tokens_per_second"] * flops / 1e9, rel=1e-6)
    assert log["supervised_fraction"] < 1 and log["num_tokens"] == real


def test_one_spelling_per_setting_in_both_trainers_arguments(tmp_path):
    """Objective fields, layout fields and the padding policy are spelled the same in DLMTrainingArguments and
    DLMSFTConfig; the old spellings (objective_overrides, SFTDataConfig.padding, parallelism_config) are
    turned into them, the deprecated ones with a FutureWarning, disagreeing pairs refused by field."""
    import warnings

    from accelerate.parallelism_config import ParallelismConfig

    from hf_dlm import DLMConfig
    from hf_dlm.data.sft_data import SFTDataConfig
    from hf_dlm.training.training_args import DLMTrainingArguments
    from hf_dlm.utils.errors import FieldError
    from tests.utils import sft_config

    config = DLMConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, mask_token_id=31)
    fields = dict(normalization="token", t_sampling="antithetic", eps=0.01, objective_seed=5)
    sft = sft_config(tmp_path, **fields).build_objective(config)
    pretrain = DLMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, objective_preset="llada",
                                    random_length_prob=0.0, **fields).build_objective(config)
    assert sft.to_dict() == pretrain.to_dict()
    assert (sft.normalization, sft.t_sampling, sft.eps, sft.seed) == ("token", "antithetic", 0.01, 5)
    # the SFT defaults (LLaDA's recipe) apply where a field is not set
    default = sft_config(tmp_path).build_objective(config)
    assert (default.normalization, default.random_length_prob, default.seed) == ("sequence", 0.0, 0)
    with pytest.warns(FutureWarning, match="objective_overrides is deprecated"):
        old = sft_config(tmp_path, objective_overrides={"normalization": "token", "t_sampling": "antithetic",
                                                        "eps": 0.01, "seed": 5})
    assert old.objective_overrides is None and old.build_objective(config).to_dict() == sft.to_dict()
    with pytest.raises(FieldError, match="normalization") as error, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        sft_config(tmp_path, normalization="masked", objective_overrides={"normalization": "token"})
    assert error.value.field == "normalization"
    with pytest.raises(FieldError, match="DLMSFTConfig.schedule must be") as error:
        sft_config(tmp_path, schedule="square")
    assert (error.value.field, error.value.value) == ("schedule", "square")

    # one layout spelling: accelerate's ParallelismConfig becomes hf-dlm's fields, in both argument classes
    for build in (lambda **kw: sft_config(tmp_path, **kw),
                  lambda **kw: DLMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)):
        args = build(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2))
        assert (args.dp_shard_size, args.tp_size, args.cp_size, args.parallelism_config) == (2, 2, 2, None)
        with pytest.raises(FieldError, match="tp_size=4 disagrees with parallelism_config.tp_size=2") as error:
            build(tp_size=4, parallelism_config=ParallelismConfig(tp_size=2))
        assert error.value.field == "tp_size"

    # one padding spelling: padding_policy (SFTDataConfig.padding is the deprecated alias)
    assert SFTDataConfig(padding_policy="exclude").padding_policy == "exclude"
    with pytest.warns(FutureWarning, match="use padding_policy"):
        assert SFTDataConfig(padding="exclude").padding_policy == "exclude"
    with pytest.raises(FieldError, match="padding_policy must be one of") as error:
        sft_config(tmp_path, padding_policy="left")
    assert error.value.field == "padding_policy"


def _llada_elbo_by_hand(model, batches, mc_num: int, seed: int) -> tuple[float, int]:
    """LLaDA's ELBO estimator written out: batch k (rows of token lists, scored positions) draws with
    Generator(seed + k); draw j of a batch: u_b = (j + U[0, 1)) / mc_num, l_b = min(floor(u_b n_b) + 1, n_b)
    masked scored positions, the l_b with the smallest of a row of U[0, 1) keys (unscored positions get key 2),
    keys drawn for the batch's padded (B, L) shape; a row's bound is the mean over draws of
    (n_b / l_b) * sum of the masked positions' cross-entropy, read from one unpadded forward of that row alone."""
    total, tokens = 0.0, 0
    for k, rows in enumerate(batches):
        generator = torch.Generator().manual_seed(seed + k)
        width = max(len(ids) for ids, _ in rows)
        n = [len(scored) for _, scored in rows]
        bounds = [0.0] * len(rows)
        for j in range(mc_num):
            u = (j + torch.rand(len(rows), generator=generator)) / mc_num
            keys = torch.rand(len(rows), width, generator=generator)
            for b, (ids, scored) in enumerate(rows):
                count = min(math.floor(float(u[b]) * n[b]) + 1, n[b])
                row_keys = {p: float(keys[b, p]) for p in scored}
                masked = sorted(scored, key=lambda p: row_keys[p])[:count]
                noisy = torch.tensor([model.config.mask_token_id if p in masked else t for p, t in enumerate(ids)])
                with torch.no_grad():
                    logp = torch.log_softmax(model.denoising_logits(noisy[None]).double()[0], -1)
                bounds[b] += n[b] / count * -sum(float(logp[p, ids[p]]) for p in masked) / mc_num
        total, tokens = total + sum(bounds), tokens + sum(n)
    return total / tokens, tokens


def test_sft_evaluate_reports_the_elbo_over_the_completion_tokens(tmp_path):
    """`evaluate` is DLMTrainer's seeded, stratified ELBO bound (the shared mixin's), scored on what SFT trains
    on: the completion and its EOS, never the prompt. Checked against the estimator written out by hand on
    rows tokenized by hand; a dataset handed to evaluate is prepared as trl prepares its own, and the trainer's
    training metrics are not swept into the evaluation log."""
    from datasets import Dataset

    tokenizer = digit_tokenizer()
    pairs = [("12", "21"), ("345", "543"), ("9", "9")]
    trainer = sft_trainer(tmp_path, rows=8, tokenizer=tokenizer, per_device_eval_batch_size=2, eval_mc_num=3,
                          eval_seed=11)
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    assert not trainer.objective.subs
    rows = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((ids, list(range(len(prompt_ids), len(ids)))))  # scored: the completion and its EOS
    expected, tokens = _llada_elbo_by_hand(model, [rows[:2], rows[2:]], mc_num=3, seed=11)
    assert tokens == 3 + 4 + 2
    trainer._metrics["train"]["supervised_fraction"].append(0.5)  # a training window in progress
    model.train()
    metrics = trainer.evaluate(Dataset.from_list([{"prompt": p, "completion": c} for p, c in pairs]))
    assert metrics["eval_num_tokens"] == tokens
    assert metrics["eval_loss"] == metrics["eval_nll_per_token"] == pytest.approx(expected, rel=1e-5)
    assert metrics["eval_perplexity_bound"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert model.training and trainer._metrics["train"]["supervised_fraction"] == [0.5]
    assert "supervised_fraction" not in trainer.state.log_history[-1]


def test_sft_final_save_writes_the_dlm_model_card(tmp_path):
    """The final save of DLMSFTTrainer writes hf-dlm's model card with the training details DLMTrainer's has
    (one implementation, CheckpointingMixin's); checkpoints write none (trl's causal-LM card included)."""
    import json

    from huggingface_hub import ModelCard

    from tests.utils import make_trainer

    trainer = sft_trainer(tmp_path / "sft", rows=8, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    assert (tmp_path / "sft" / "checkpoint-2").is_dir() and not (tmp_path / "sft" / "README.md").exists()
    trainer.save_model()
    expected = {"trainer": "hf_dlm.DLMSFTTrainer", "objective_preset": "llada", "mode": "diffusion",
                "schedule": "linear", "weighting": "elbo", "t_sampling": "uniform", "eps": 0.001,
                "normalization": "sequence", "label_alignment": "same", "global_step": 2, "epochs": 1.0,
                "learning_rate": 0.01, "lr_scheduler_type": "constant", "global_batch_size": 4, "world_size": 1,
                "seed": 0, "precision": "fp32"}  # 8 rows, 4 a step: 2 steps are one epoch; LLaDA's SFT recipe
    assert json.loads((tmp_path / "sft" / "hf_dlm_info.json").read_text())["training"] == expected
    card = ModelCard.load(tmp_path / "sft" / "README.md")
    assert card.data.pipeline_tag == "fill-mask" and "hf-dlm" in card.data.tags
    details = card.text.split("## Training details")[1]
    for field, value in expected.items():
        assert f"| {field} | `{value if isinstance(value, str) else json.dumps(value)}` |" in details
    # DLMTrainer's final card: the same fields, its own trainer name and objective
    pretrain = make_trainer(tmp_path / "pretrain", max_steps=1)
    pretrain.train()
    pretrain.save_model()
    record = json.loads((tmp_path / "pretrain" / "hf_dlm_info.json").read_text())["training"]
    assert record.keys() == expected.keys() and record["trainer"] == "hf_dlm.DLMTrainer"


def test_sft_pipeline_options_are_refused_with_the_field(tmp_path):
    """pp_size > 1 in DLMSFTConfig: DLMTrainingArguments' pipeline checks (one implementation), plus max_length,
    which fixes the shape of every batch a pipeline sends."""
    from hf_dlm.utils.errors import FieldError
    from tests.utils import sft_config

    for options, field in ((dict(pp_size=2, gradient_accumulation_steps=2, max_length=None), "max_length"),
                           (dict(pp_size=2, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=1),
                            "eval_strategy"),
                           (dict(pp_size=2, gradient_accumulation_steps=1), "gradient_accumulation_steps"),
                           (dict(pp_schedule="zero_bubble"), "pp_schedule")):
        with pytest.raises(FieldError, match=f"DLMSFTConfig.{field} must be") as error:
            sft_config(tmp_path, **options)
        assert error.value.field == field
