"""The trainer's real data paths against the objective and the ELBO called directly: packed windows
(position_ids), the SFT path with excluded padding, and block-diffusion (two-stream) training."""

import copy

import pytest
import torch

from hf_dlm import MaskedDiffusionObjective
from hf_dlm.data.memory_dataset import TokenWindowDataset, pack_documents
from hf_dlm.diffusion.elbo import elbo_nll
from hf_dlm.training.trainer import DLMTrainer
from tests.utils import MASK_ID, VOCAB, tiny_model
from tests.utils import RecordingTrainer, make_args

N, L = 8, 16


def packed_windows(seed=0):
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB - 2, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 12, (40,), generator=generator)]
    ids, positions = pack_documents(docs, L, eos_token_id=VOCAB - 2)
    return ids[:N], positions[:N]


def first_step_by_hand(trainer, initial, dataset, **forward_kwargs):
    """The trainer's first-step loss recomputed with the objective on the same rows and keys."""
    keys = torch.tensor(trainer.sample_indices[:N])
    rows = keys % len(dataset)
    objective = MaskedDiffusionObjective.from_model_config(initial.config, preset="mdlm")
    extra = {k: v[rows] for k, v in forward_kwargs.items()}
    with torch.no_grad():
        loss, _ = objective(initial, dataset.input_ids[rows], keys, **extra)
    return loss


def test_trainer_and_evaluate_on_packed_windows_use_position_ids(tmp_path):
    ids, positions = packed_windows()
    dataset = TokenWindowDataset(ids, positions)
    model = tiny_model(seed=1, attn_implementation="sdpa").train()
    initial = copy.deepcopy(model).eval()
    args = make_args(tmp_path, per_device_train_batch_size=N, max_steps=1, warmup_steps=0,
                     lr_scheduler_type="constant", per_device_eval_batch_size=N, eval_mc_num=2)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    expected = first_step_by_hand(trainer, initial, dataset, position_ids=positions)
    unpacked = first_step_by_hand(trainer, initial, dataset)
    assert not torch.isclose(expected, unpacked)  # the documents' boundaries matter to this loss
    torch.testing.assert_close(torch.tensor(trainer.step_losses[0]), expected, rtol=1e-5, atol=1e-6)

    metrics = trainer.evaluate(TokenWindowDataset(ids, positions))
    trained = trainer.model.eval()
    bound = elbo_nll(trained, ids, mc_num=2, seed=0, batch_size=N, position_ids=positions, subs=True)
    plain = elbo_nll(trained, ids, mc_num=2, seed=0, batch_size=N, subs=True)
    assert metrics["eval_nll_per_token"] == pytest.approx(float(bound["per_sequence"].sum() / bound["num_tokens"]),
                                                          rel=1e-5)
    assert metrics["eval_nll_per_token"] != pytest.approx(float(plain["per_sequence"].sum() / plain["num_tokens"]),
                                                          rel=1e-5)


def test_block_diffusion_training_through_the_trainer_is_the_two_stream_objective(tmp_path):
    ids = torch.randint(0, VOCAB - 1, (N, L), generator=torch.Generator().manual_seed(4))
    dataset = TokenWindowDataset(ids)
    model = tiny_model(seed=2, attention_mode="block", block_size=4, attn_implementation="sdpa").train()
    initial = copy.deepcopy(model).eval()
    args = make_args(tmp_path, per_device_train_batch_size=N, max_steps=1, warmup_steps=0,
                     lr_scheduler_type="constant")
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    expected = first_step_by_hand(trainer, initial, dataset)  # the objective adds clean_input_ids (x_t ++ x_0)
    torch.testing.assert_close(torch.tensor(trainer.step_losses[0]), expected, rtol=1e-5, atol=1e-6)
    keys = torch.tensor(trainer.sample_indices[:N])
    inputs = MaskedDiffusionObjective.from_model_config(initial.config, preset="mdlm").corrupt(ids[keys % N], keys)
    with torch.no_grad():  # without the clean stream the loss is another number: the comparison has teeth
        one_stream = initial(**{k: inputs[k] for k in ("input_ids", "labels", "label_weights", "num_items_in_batch",
                                                 "suppressed_token_id")})
    assert not torch.isclose(one_stream.loss, expected)


def test_sft_with_excluded_padding_never_attends_noises_or_supervises_padding_or_prompt(tmp_path, tokenizer_dir):  # noqa: F811
    from transformers import AutoTokenizer

    from hf_dlm.data.collator import DLMDataCollator
    from hf_dlm.data.sft_data import SFTDataConfig, SFTDataset

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir[0])
    rows = [{"messages": [{"role": "user", "content": f"What does statement {i} do?" + " yes" * (i % 2)},
                          {"role": "assistant", "content": "It runs a loop." * (1 + i % 3)}]} for i in range(6)]
    dataset = SFTDataset(rows, tokenizer, SFTDataConfig(max_length=96, padding_policy="exclude"))
    model = tiny_model(seed=3, vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id).train()
    args = make_args(tmp_path, per_device_train_batch_size=6, max_steps=1, eps=0.9)  # t >= 0.9: most answers masked
    trainer = DLMTrainer(model=model, args=args, train_dataset=dataset,
                         data_collator=DLMDataCollator(pad_token_id=tokenizer.pad_token_id))
    batch = trainer.data_collator([dataset[i] for i in range(6)])
    padding, prompt = batch["attention_mask"] == 0, batch["prompt_mask"]
    assert padding.any() and prompt.any()
    for i, row in enumerate(rows):  # the prompt mask is exactly the rendered prompt, the rest of the row is answer
        prompt_text = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        assert prompt[i].tolist() == [True] * len(prompt_ids) + [False] * (prompt.shape[1] - len(prompt_ids))
        assert batch["input_ids"][i, :len(prompt_ids)].tolist() == prompt_ids
    inputs = trainer._corrupt(batch, torch.device("cpu"))
    untouched = padding | prompt
    assert torch.equal(inputs["input_ids"][untouched], batch["input_ids"][untouched])  # never noised
    assert (inputs["labels"][untouched] == -100).all()  # never supervised
    assert (inputs["input_ids"][~untouched] == tokenizer.mask_token_id).any()
    # the per-token normaliser counts real answer tokens only
    assert inputs["_dlm_stats"]["items"] == (~untouched).sum()
    # never attended to: other ids in the padding leave the loss unchanged
    stats = inputs.pop("_dlm_stats")
    model.eval()
    with torch.no_grad():
        loss = model(**inputs, num_items_in_batch=stats["items"]).loss
        scrambled = dict(inputs, input_ids=torch.where(padding, (inputs["input_ids"] + 7) % 50, inputs["input_ids"]))
        torch.testing.assert_close(model(**scrambled, num_items_in_batch=stats["items"]).loss, loss)
    model.train()
    assert trainer.train().training_loss > 0
