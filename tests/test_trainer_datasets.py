"""DLMTrainer on an ordinary tokenized dataset, and antithetic t over the optimizer step's global batch."""

import pytest
import torch

from hf_dlm.diffusion.noise import hashed_uniform
from hf_dlm.training.trainer import _STATS
from tests.utils import VOCAB
from tests.utils import SEQ_LEN, StopAfter, flat_params, make_trainer

N = 12


def tokenized_dataset():
    """What `dataset.map(tokenizer)` gives: lists of ids, an attention mask, a text column."""
    from datasets import Dataset

    ids = torch.randint(0, VOCAB - 1, (N, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    return Dataset.from_dict({"text": [f"row {i}" for i in range(N)], "input_ids": ids.tolist(),
                              "attention_mask": torch.ones(N, SEQ_LEN, dtype=torch.long).tolist()})


def test_map_style_dataset_keys_noise_by_index_and_epoch_and_resumes(tmp_path):
    # 12 rows, batch 4: 3 steps per epoch, 7 steps = 2 passes and a third started
    straight = make_trainer(tmp_path / "straight", dataset=tokenized_dataset(), max_steps=7)
    straight.train()
    keys = straight.sample_indices
    for epoch in range(2):  # every pass draws each row once, under a new key: epoch * N + row
        assert sorted(keys[epoch * N:(epoch + 1) * N]) == list(range(epoch * N, (epoch + 1) * N))
    assert all(2 * N <= k < 3 * N for k in keys[2 * N:])
    assert [round(log["epoch"], 4) for log in straight.state.log_history if "loss" in log][2::3] == [1.0, 2.0]

    first = make_trainer(tmp_path / "resumed", dataset=tokenized_dataset(), max_steps=7, save_strategy="steps",
                         save_steps=4)
    first.add_callback(StopAfter(4))  # interrupted inside the second pass
    first.train()
    resumed = make_trainer(tmp_path / "resumed", dataset=tokenized_dataset(), model_seed=1, max_steps=7,
                           save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert first.sample_indices + resumed.sample_indices == keys
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses), torch.tensor(straight.step_losses),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)


def test_items_without_input_ids_are_named():
    from hf_dlm.training.trainer import _IndexedSamples

    with pytest.raises(ValueError, match=r"train_dataset\[0\].*'text'"):
        _IndexedSamples([{"text": "a"}])[0]


@pytest.mark.parametrize("batch,accumulation", [(2, 2), (4, 1), (1, 4)])
def test_antithetic_t_is_stratified_over_the_step_global_batch(tmp_path, batch, accumulation):
    """mdlm: the 4 samples of an optimizer step take one stratum [j/4, (j+1)/4) each, in the order of
    their keys, whatever the micro-batch split (MDLM stratifies over its batch)."""
    trainer = make_trainer(tmp_path, objective_preset="mdlm", per_device_train_batch_size=batch,
                           gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=1e-3)
    trainer.train()
    for step in trainer.batches:
        t = torch.cat([b[_STATS]["t"] for b in step])
        assert t.numel() == 4
        strata = ((t - 1e-3) / (1 - 1e-3) * 4).floor().long()
        assert sorted(strata.tolist()) == [0, 1, 2, 3]
    keys = torch.tensor(trainer.sample_indices).view(3, 4)
    t = torch.stack([torch.cat([b[_STATS]["t"] for b in step]) for step in trainer.batches])
    slot = torch.argsort(torch.argsort(keys, dim=1), dim=1)
    expected = 1e-3 + (1 - 1e-3) * (hashed_uniform(0, 0, keys.flatten()).view(3, 4) + slot) / 4
    torch.testing.assert_close(t, expected)


def _random_yaml(tmp_path, seed):
    path = tmp_path / f"run{seed}.yaml"
    path.write_text("model:\n  config: {vocab_size: 99, mask_token_id: 98, hidden_size: 32, intermediate_size: 64,\n"
                    "           num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,\n"
                    "           tie_word_embeddings: true}\n"
                    "data: {kind: random, seq_len: 16, num_samples: 32}\n"
                    f"training: {{output_dir: {tmp_path / 'out'}, use_cpu: true, max_steps: 2, seed: {seed},\n"
                    "           per_device_train_batch_size: 4, learning_rate: 1.0e-2, report_to: none,\n"
                    "           save_strategy: 'no', logging_steps: 1, disable_tqdm: true}\n")
    return str(path)


def test_the_same_yaml_twice_gives_the_same_run_and_the_seed_matters(tmp_path):
    from hf_dlm.training.runner import build_trainer, load_config

    runs = []
    for seed in (0, 0, 1):
        path = _random_yaml(tmp_path, seed)
        trainer, _ = build_trainer(load_config(path), path)
        initial = flat_params(trainer.model).clone()
        trainer.train()
        runs.append((initial, [log["loss"] for log in trainer.state.log_history if "loss" in log]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert not torch.equal(runs[0][0], runs[2][0])


def test_resuming_a_tied_model_warns_about_nothing_and_an_output_dir_with_checkpoints_is_refused(tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    from tests.utils import tiny_model
    from tests.utils import RecordingTrainer, make_args, random_dataset

    def trainer(**overrides):
        model = tiny_model(tie_word_embeddings=True).train()
        return RecordingTrainer(model=model, args=make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2,
                                                            **overrides), train_dataset=random_dataset())

    first = trainer()
    first.add_callback(StopAfter(2))
    first.train()
    with pytest.raises(ValueError, match=r"already holds checkpoint-2: pass resume_from_checkpoint=True"):
        trainer().train()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            resumed = trainer()
            resumed.train(resume_from_checkpoint=True)
    finally:
        hf_logging.disable_propagation()
    assert "missing keys" not in caplog.text
    model = resumed.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    trainer(overwrite_output_dir=True).train()  # told to start over: allowed
