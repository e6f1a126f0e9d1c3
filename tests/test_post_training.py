"""DLMSFTTrainer and DiffuGRPOTrainer on trl: the toy 'reverse the digits' task, SFT then GRPO."""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from unittest import mock

import pytest
import torch

pytest.importorskip("trl")  # the `trl` extra; CI installs it through the `test` extra

from datasets import Dataset  # noqa: E402

from hf_dlm import DLMConfig, DLMForDiffusionLM, elbo_nll  # noqa: E402
from hf_dlm.training.grpo_config import DiffuGRPOConfig  # noqa: E402
from hf_dlm.training.grpo_trainer import DiffuGRPOTrainer  # noqa: E402
from hf_dlm.training.sft_config import DLMSFTConfig  # noqa: E402
from hf_dlm.training.sft_trainer import DLMSFTTrainer  # noqa: E402
from tests.utils import (  # noqa: E402,F401
    common,
    digit_tokenizer,
    prompt_dataset,
    reversal_reward,
    reverse_rows,
    sft_args,
    sft_dataset,
    sft_one_step,
    toy_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return digit_tokenizer()


def heldout_nll(model, trainer, rows):
    """ELBO bound on the response NLL of held-out rows (prompt tokens conditioned on, not scored)."""
    batch = trainer.data_collator([dict(trainer._prepare_dataset(rows, trainer.processing_class, trainer.args, False,
                                                                 None, "heldout")[i]) for i in range(len(rows))])
    return elbo_nll(model.eval(), batch["input_ids"], batch["attention_mask"], batch["prompt_mask"], mc_num=8)


def test_sft_lowers_response_nll_and_never_noises_the_prompt(tmp_path, tokenizer):
    model = toy_model(tokenizer)
    hooks = ["_prepare_dataset", "_set_signature_columns_if_needed", "get_batch_samples", "compute_loss"]
    with contextlib.ExitStack() as stack:  # trl calls every hook DLMSFTTrainer overrides
        spies = {name: stack.enter_context(mock.patch.object(DLMSFTTrainer, name, autospec=True,
                                                             side_effect=getattr(DLMSFTTrainer, name)))
                 for name in hooks}
        trainer = DLMSFTTrainer(model=model, args=sft_args(tmp_path, max_steps=120),
                                train_dataset=sft_dataset(256, 0), processing_class=tokenizer)
        before = heldout_nll(model, trainer, sft_dataset(32, 99))["nll_per_token"]
        seen = []
        corrupt = trainer.objective.corrupt

        def spy(input_ids, sample_index, attention_mask=None, prompt_mask=None, *t_group):
            out = corrupt(input_ids, sample_index, attention_mask, prompt_mask, *t_group)
            seen.append((input_ids, prompt_mask, out))
            return out

        with mock.patch.object(trainer.objective, "corrupt", side_effect=spy):
            trainer.train()
    assert all(spies[name].called for name in hooks)
    after = heldout_nll(model, trainer, sft_dataset(32, 99))["nll_per_token"]
    assert after < before - 0.5, (before, after)
    assert len(seen) == 120
    for input_ids, prompt_mask, out in seen:
        assert prompt_mask.sum() > 0
        assert not (out["masked"] & prompt_mask).any()  # never noised
        assert (out["labels"][prompt_mask] == -100).all()  # never supervised
        assert torch.equal(out["input_ids"][prompt_mask], input_ids[prompt_mask])
        # the response (answer, its EOS and the EOS padding) is what gets noised
        assert out["masked"][~prompt_mask].any()
    # the prompt is exactly what the chat template renders before the answer: <|user|> digits <|assistant|>
    first_ids, first_prompt, _ = seen[0]
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    for row, prompt in zip(first_ids, first_prompt):
        assert int(prompt.sum()) == int((row == assistant).nonzero()[0]) + 1


@pytest.mark.parametrize("normalization,t_sampling", [("token", "antithetic"), ("masked", "uniform")])
def test_sft_gradient_accumulation_equals_one_big_batch(tmp_path, tokenizer, normalization, t_sampling):
    """One SGD step on 8 rows of different completion lengths: 4 micro-batches of 2 and 2 of 4 move the weights
    exactly as 1 micro-batch of 8 (the normaliser counts the whole step; antithetic t is stratified over it)."""
    weights = {micro: sft_one_step(tmp_path / f"{micro}", tokenizer, micro, 8 // micro, normalization, t_sampling)[0]
               for micro in (8, 4, 2)}
    start = dict(toy_model(tokenizer).named_parameters())
    moved = max(float((weights[8][name] - start[name]).abs().max()) for name in start)
    assert moved > 1e-3  # the step really changed the weights
    for micro in (4, 2):
        for name, value in weights[8].items():
            torch.testing.assert_close(weights[micro][name], value, rtol=0, atol=2e-6,
                                       msg=lambda m: f"{micro} x: {name}: {m}")


@pytest.mark.skipif(shutil.which("accelerate") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "accelerate")),
                    reason="the accelerate launcher is not installed")
def test_sft_on_two_ddp_ranks_equals_one_process(tmp_path, tokenizer):
    """2 gloo ranks x 2 micro-batches of 2 rows (`accelerate launch`) = 1 process x 1 micro-batch of 8: the
    normaliser is summed over ranks and DDP's gradient average is undone."""
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    launcher = launcher if os.path.exists(launcher) else shutil.which("accelerate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [launcher, "launch", "--config_file", os.path.join(ROOT, "examples", "accelerate", "ddp_cpu.yaml"),
               "--multi_gpu", "--num_processes", "2", "--main_process_port", str(port),
               os.path.join(ROOT, "tests", "sft_ddp_worker.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"sft_params_rank{r}.pt") for r in range(2)]
    single, _ = sft_one_step(tmp_path / "single", tokenizer, 8, 1)
    for name, value in single.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], value, rtol=0, atol=2e-6, msg=lambda m: f"{name}: {m}")


def test_sft_padding_policies_and_packing(tmp_path, tokenizer):
    rows = sft_dataset(4, 1)
    for policy in ("eos", "exclude"):
        trainer = DLMSFTTrainer(model=toy_model(tokenizer), args=sft_args(tmp_path, padding_policy=policy),
                                train_dataset=rows, processing_class=tokenizer)
        batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(4)])
        lengths = [len(trainer.train_dataset[i]["input_ids"]) for i in range(4)]
        assert len(set(lengths)) > 1 and batch["sample_index"].tolist() == [0, 1, 2, 3]
        for row, n in enumerate(lengths):
            tail = slice(n, None)
            if policy == "eos":  # padding is EOS, attended and supervised (the model learns to stop)
                assert (batch["input_ids"][row, tail] == tokenizer.eos_token_id).all()
                assert batch["attention_mask"][row].all() and not batch["prompt_mask"][row, tail].any()
            else:
                assert not batch["attention_mask"][row, tail].any() and not batch["prompt_mask"][row, tail].any()
    packed = DLMSFTTrainer(model=toy_model(tokenizer), args=sft_args(tmp_path, packing=True, max_length=24,
                                                                     per_device_train_batch_size=2, max_steps=2),
                           train_dataset=sft_dataset(16, 2), processing_class=tokenizer)
    batch = packed.data_collator([dict(packed.train_dataset[i]) for i in range(2)])
    assert "position_ids" in batch and batch["input_ids"].shape[0] == 2  # rows kept, not one flattened row
    assert (batch["position_ids"][:, 1:] == 0).any()  # documents restart: attention stays inside each
    packed.train()
    with pytest.raises(ValueError, match="padding_free"):
        sft_args(tmp_path, padding_free=True)


def test_plain_trl_sft_trainer_refuses_a_dlm(tmp_path, tokenizer):
    from trl import SFTConfig, SFTTrainer

    with pytest.raises(TypeError, match="causal fused LM head"):
        SFTTrainer(model=toy_model(tokenizer), args=SFTConfig(**common(tmp_path, max_steps=1)),
                   train_dataset=sft_dataset(8, 0), processing_class=tokenizer)


def grpo_args(tmp_path, **overrides):
    options = common(tmp_path, max_steps=40, per_device_train_batch_size=64, num_generations=8,
                     max_completion_length=6, generation_kwargs={"steps": 6}, learning_rate=1e-3, temperature=1.0,
                     logp_estimator="coupled", beta=0.0)
    options.update(overrides)
    return DiffuGRPOConfig(**options)


def test_sft_then_grpo_raises_reward(tmp_path, tokenizer):
    """The worked pipeline: SFT teaches the format and part of the task (about half the digits right), then GRPO
    with the coupled estimator raises the mean reward of its rollouts over 40 steps (mixed-length prompts, so the
    sampler batches left-padded rows). With learning_rate=0 the same run stays flat (checked when writing this)."""
    model = toy_model(tokenizer)
    DLMSFTTrainer(model=model, args=sft_args(tmp_path / "sft"), train_dataset=sft_dataset(256, 0),
                  processing_class=tokenizer).train()
    trainer = DiffuGRPOTrainer(model=model.train(), reward_funcs=reversal_reward, args=grpo_args(tmp_path / "grpo"),
                               train_dataset=prompt_dataset(64, 1), processing_class=tokenizer)
    assert "forward" not in vars(model)  # trl's causal fused head never installed
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]  # every 5 steps, 8 prompts x 8
    assert len(rewards) == 8
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards


def test_trl_calls_every_overridden_hook_and_iterations_use_their_own_masks(tmp_path, tokenizer):
    """Spies on each hook; with num_iterations=2 and beta > 0 the old and reference log-probabilities are computed
    for both iterations' masks at rollout time, and each pass reads its own (learning rate 0 here, so the current
    log-probabilities must equal the stored old ones exactly, which they do only with the right masks)."""
    model = toy_model(tokenizer)
    args = grpo_args(tmp_path, max_steps=4, per_device_train_batch_size=8, num_generations=4, num_iterations=2,
                     beta=0.04, learning_rate=0.0, logp_estimator="d1")
    trainer = DiffuGRPOTrainer(model=model, reward_funcs=reversal_reward, args=args,
                               train_dataset=prompt_dataset(16, 3), processing_class=tokenizer)
    assert trainer.ref_model is not None and "forward" not in vars(model)
    checked = []
    original_compute = type(trainer).__mro__[1]._compute_loss

    def check_compute(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            current, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask, ids.shape[1] - inputs[
                "prompt_ids"].shape[1])
        scored = inputs["completion_mask"].bool()
        assert inputs["old_per_token_logps"].shape == current.shape == inputs["ref_per_token_logps"].shape
        torch.testing.assert_close(current[scored], inputs["old_per_token_logps"][scored])
        checked.append((self._current_iteration(), self.estimator_seed(self._current_iteration())))
        return original_compute(self, model, inputs)

    hooks = ["_generate_single_turn", "_get_per_token_logps_and_entropies", "_generate_and_score_completions",
             "compute_loss"]
    canvases = []
    estimate = trainer.estimator

    def record_canvas(model, input_ids, attention_mask, completion_length, *args, **kwargs):
        canvases.append((input_ids[:, -completion_length:], attention_mask[:, -completion_length:]))
        return estimate(model, input_ids, attention_mask, completion_length, *args, **kwargs)

    trainer.estimator = record_canvas
    with contextlib.ExitStack() as stack:
        spies = {name: stack.enter_context(mock.patch.object(DiffuGRPOTrainer, name, autospec=True,
                                                             side_effect=getattr(DiffuGRPOTrainer, name)))
                 for name in hooks}
        stack.enter_context(mock.patch.object(DiffuGRPOTrainer, "_compute_loss", check_compute))
        trainer.train()
    for name in hooks:
        assert spies[name].called, name
    assert [c[0] for c in checked] == [0, 1, 0, 1]
    # the estimator sees the sampler's canvas: after a completion's first EOS comes EOS fill, attended (trl's
    # padding of the truncated completions is replaced)
    eos = tokenizer.eos_token_id
    assert any((completion == eos).any() for completion, _ in canvases)
    for completion, attention in canvases:
        after_eos = (completion == eos).long().cummax(1).values.bool()
        assert attention.all() and (completion[after_eos] == eos).all()
    assert len({c[1] for c in checked}) == 4  # every rollout batch and inner iteration has its own masks


def test_grpo_with_lora_and_mc_elbo(tmp_path, tokenizer):
    from peft import LoraConfig

    model = toy_model(tokenizer)
    args = grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=8, num_generations=4, beta=0.04,
                     logp_estimator="mc_elbo", mc_num=2,
                     generation_kwargs={"threshold": 0.9, "block_length": 3, "cache": "dual"})
    trainer = DiffuGRPOTrainer(model=model, reward_funcs=reversal_reward, args=args,
                               train_dataset=prompt_dataset(8, 4), processing_class=tokenizer,
                               peft_config=LoraConfig(r=4, lora_alpha=8))  # default targets: the DLM's projections
    base = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0}
    assert changed and trainer.ref_model is None  # the reference is the policy with the adapter disabled
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)  # base weights frozen


def test_cli_sft_then_grpo_from_the_example_configs(tmp_path):
    """`hf-dlm sft` / `hf-dlm grpo` with the toy YAML configs (the examples' code path), a few steps each."""
    from pathlib import Path

    from hf_dlm.cli import main

    configs = Path(__file__).resolve().parents[1] / "examples" / "configs"
    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    assert main(["sft", "--config", str(configs / "sft_toy.yaml"), "--max_steps", "3",
                 "--output_dir", str(sft_dir)]) == 0
    assert (sft_dir / "model.safetensors").exists() and (sft_dir / "tokenizer.json").exists()
    assert main(["grpo", "--config", str(configs / "grpo_toy.yaml"), "--max_steps", "2", "--model_name_or_path",
                 str(sft_dir), "--output_dir", str(grpo_dir), "--logp_estimator", "mc_elbo",
                 "--per_device_train_batch_size", "16"]) == 0
    from transformers import AutoModelForMaskedLM

    assert AutoModelForMaskedLM.from_pretrained(grpo_dir).config.mask_token_id == 2


def test_grpo_refuses_router_losses_it_cannot_add_and_leaves_trl_aux_off_for_dense(tmp_path, tokenizer):
    """trl switches its MoE auxiliary loss on for any config with a `router_aux_loss_coef` (DLMConfig has one,
    dense or not); the estimators return no router losses, so a dense DLM trains with trl's aux loss off and an
    MoE DLM with router-loss coefficients is refused by name."""
    model = toy_model(tokenizer)
    model.config.output_router_logits = False  # as trl's SFTTrainer leaves it
    dense = DiffuGRPOTrainer(model=model, reward_funcs=reversal_reward,
                             args=grpo_args(tmp_path / "dense", max_steps=1), train_dataset=prompt_dataset(8, 1),
                             processing_class=tokenizer)
    assert dense.aux_loss_enabled is False
    moe = toy_model(tokenizer)
    moe_config = DLMConfig(**{**moe.config.to_dict(), "num_experts": 2, "num_experts_per_tok": 1,
                              "moe_intermediate_size": 32})
    with pytest.raises(ValueError, match="router_aux_loss_coef=0"):
        DiffuGRPOTrainer(model=DLMForDiffusionLM(moe_config), reward_funcs=reversal_reward,
                         args=grpo_args(tmp_path / "moe", max_steps=1), train_dataset=prompt_dataset(8, 1),
                         processing_class=tokenizer)
