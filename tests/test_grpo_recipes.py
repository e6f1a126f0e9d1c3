"""DiffuGRPOConfig's rollout settings (trl's spelling, refusals by name, reaching model.generate) and the
published recipes against transcriptions of their sources' loss: d1's `compute_loss` bit for bit in fp32."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from hf_dlm import DLMConfig, DLMForDiffusionLM  # noqa: E402
from hf_dlm.diffusion.logp_estimators import row_keys  # noqa: E402
from hf_dlm.diffusion.noise import hashed_uniform  # noqa: E402
from hf_dlm.generation.configuration import DLMGenerationConfig  # noqa: E402
from hf_dlm.training.grpo_config import RECIPES, DiffuGRPOConfig  # noqa: E402
from hf_dlm.training.grpo_trainer import DiffuGRPOTrainer  # noqa: E402
from hf_dlm.training.post_training import toy_reward, toy_rows, toy_tokenizer  # noqa: E402
from hf_dlm.utils.errors import FieldError  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def small_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       max_position_embeddings=64)
    return DLMForDiffusionLM(config)


def config(tmp_path, recipe=None, **overrides):
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                   disable_tqdm=True, seed=0, max_steps=1, per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=4, learning_rate=1e-3)
    options.update(overrides)
    return DiffuGRPOConfig.from_recipe(recipe, **options) if recipe else DiffuGRPOConfig(**options)


def trainer_for(tmp_path, tokenizer, args, seed=0):
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in toy_rows(4, seed)]
    return DiffuGRPOTrainer(model=small_model(tokenizer, seed), reward_funcs=toy_reward, args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


# -- rollout settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,field", [
    (dict(min_p=0.1), "min_p"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(cache_implementation="static"), "cache_implementation"),
    (dict(generation_kwargs={"bogus_option": 1}), "generation_kwargs.bogus_option"),
    (dict(generation_kwargs={"threshold": 2.0}), "generation_kwargs.threshold"),
    (dict(generation_kwargs={"num_beams": 2}), "generation_kwargs.num_beams"),
    (dict(generation_kwargs={"max_new_tokens": 9}), "generation_kwargs.max_new_tokens"),
    (dict(generation_kwargs={"remasking": "sideways"}), "generation_kwargs.remasking"),
    (dict(top_p=1.5), "top_p"),
    (dict(logp_temperature=0.0), "logp_temperature"),
])
def test_unsupported_rollout_settings_are_refused_by_name(tmp_path, options, field):
    with pytest.raises(FieldError) as caught:
        config(tmp_path, **options)
    assert caught.value.field == field
    assert field.split(".")[-1] in str(caught.value)


def test_duplicate_sampler_fields_are_gone():
    names = set(DiffuGRPOConfig.__dataclass_fields__)
    assert not names & {"diffusion_steps", "block_length", "remasking", "threshold", "generation_cache",
                        "generation_compile"}


def test_generation_kwargs_reach_the_rollouts(tmp_path, tokenizer):
    """The rollouts call model.generate with one DLMGenerationConfig carrying trl's fields and every supported
    generation_kwargs key; the completions are those of model.generate called with the same settings."""
    kwargs = {"steps": 2, "block_length": 2, "threshold": 0.7, "remasking": "margin", "cache": "prefix",
              "cfg_scale": 0.5}
    args = config(tmp_path, generation_kwargs=kwargs, temperature=0.5, top_k=3, top_p=0.8, max_completion_length=4)
    trainer = trainer_for(tmp_path, tokenizer, args)
    model = trainer.model
    seen = []
    generate = model.generate

    def spy(*a, **k):
        seen.append(k)
        return generate(*a, **k)

    model.generate = spy
    prompts = [[5, 6, 7], [8, 9]]
    torch.manual_seed(3)
    completions, _ = trainer._generate_single_turn(prompts, None, None, 1)
    (call,) = seen
    assert set(call) == {"attention_mask", "generation_config"}
    gen = call["generation_config"]
    assert isinstance(gen, DLMGenerationConfig)
    for key, value in kwargs.items():
        assert getattr(gen, key) == value, key
    assert (gen.max_new_tokens, gen.top_k, gen.top_p, gen.sampling_temperature) == (4, 3, 0.8, 0.5)
    assert gen.eos_token_id == [tokenizer.eos_token_id]
    # the same completions as a direct call with these settings from the same random state
    ids = torch.tensor([prompts[0], [tokenizer.pad_token_id] + prompts[1]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    torch.manual_seed(3)
    direct = generate(ids, attention_mask=mask, max_new_tokens=4, temperature=0.5, top_k=3, top_p=0.8, **kwargs)
    for row, completion in zip(direct[:, 3:].tolist(), completions):
        assert row[:len(completion)] == completion


def test_estimator_temperature_defaults_to_the_rollout_temperature(tmp_path, tokenizer):
    assert config(tmp_path, temperature=0.7).estimator_temperature == 0.7  # trl's convention
    assert config(tmp_path, generation_kwargs={"temperature": 0.6}).estimator_temperature == 0.6
    assert config(tmp_path, temperature=0.7, logp_temperature=1.0).estimator_temperature == 1.0
    assert config(tmp_path, recipe="d1").estimator_temperature == 1.0
    trainer = trainer_for(tmp_path, tokenizer, config(tmp_path, temperature=0.7))
    assert trainer.estimator.temperature == 0.7


# -- d1's compute_loss ---------------------------------------------------------------------------------------------
def d1_forward_process_noisy(canvas, completion_length, seed, p_mask_prompt, mask_id):
    """d1 `forward_process`: prompt tokens masked where a uniform < p_mask_prompt, every completion token masked.
    The uniforms here are the estimator's documented stream (hashed_uniform(seed, 0, row key, position)), so both
    sides use the same draws."""
    positions = torch.arange(canvas.shape[1])
    prompt_index = positions < canvas.shape[1] - completion_length
    random_matrix = hashed_uniform(seed, 0, row_keys(canvas), positions)
    is_mask = (prompt_index & (random_matrix < p_mask_prompt)) | ~prompt_index
    return torch.where(is_mask, mask_id, canvas)


def d1_per_token_logps(model, noisy, attention_mask, targets):
    """d1 `_get_per_token_logps`: raw logits of the completion positions, -cross_entropy per token, float32."""
    logits = model(input_ids=noisy, attention_mask=attention_mask, logits_to_keep=targets.shape[1]).logits
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (-flat).view(targets.shape).to(torch.float32)


def d1_compute_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask, beta,
                    epsilon):
    """d1 `compute_loss` (diffu-GRPO), from its equations."""
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    return (per_token_loss * completion_mask).sum() / completion_mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("rollout_temperature", [0.9, 1.0])
def test_d1_recipe_is_d1_compute_loss_bit_for_bit(tmp_path, tokenizer, beta, rollout_temperature):
    args = config(tmp_path, recipe="d1", beta=beta, temperature=rollout_temperature, num_iterations=2)
    assert (args.use_bias_correction_kl, args.scale_rewards, args.loss_type) == (False, "none", "bnpo")
    trainer = trainer_for(tmp_path, tokenizer, args)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    generator = torch.Generator().manual_seed(int(beta * 100) + int(rollout_temperature * 10))
    B, P, K = 4, 5, 4
    prompt_ids = torch.randint(5, len(tokenizer), (B, P), generator=generator)
    completion_ids = torch.randint(5, len(tokenizer), (B, K), generator=generator)
    completion_ids[1, 2:] = tokenizer.eos_token_id  # EOS, then fill
    completion_mask = torch.ones(B, K, dtype=torch.long)
    completion_mask[1, 3:] = 0
    advantages = torch.tensor([0.5, -0.25, 1.0, -1.25])
    canvas = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.ones_like(canvas)
    seed = trainer.estimator_seed(trainer._current_iteration())
    with torch.no_grad():
        noisy = d1_forward_process_noisy(canvas, K, seed, 0.15, tokenizer.mask_token_id)
        current = d1_per_token_logps(model, noisy, attention, completion_ids)
    old = current + 0.3 * torch.randn(B, K, generator=generator)  # ratios away from 1: clipping acts
    ref = current + 0.2 * torch.randn(B, K, generator=generator)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                  ref_per_token_logps=ref, num_items_in_batch=completion_mask.sum())
    loss = trainer.compute_loss(model, inputs)
    logps = d1_per_token_logps(model, noisy, attention, completion_ids)
    expected = d1_compute_loss(logps, old, ref, advantages, completion_mask.float(), beta, 0.2)
    assert torch.equal(loss.detach(), expected.detach()), (loss.item(), expected.item())
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected.backward()
    for name, param in model.named_parameters():  # other backward kernels (log_softmax + gather vs cross_entropy)
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-5, atol=1e-8, msg=name)
    # the defaults are another algorithm: estimator at the rollout temperature, trl's bias-corrected KL
    if rollout_temperature != 1.0 or beta:
        plain = trainer_for(tmp_path, tokenizer, config(tmp_path, beta=beta, temperature=rollout_temperature,
                                                        num_iterations=2, loss_type="bnpo"))
        plain.current_gradient_accumulation_steps = 1
        plain.model.load_state_dict(model.state_dict())
        assert not torch.equal(plain.compute_loss(plain.model.train(), inputs).detach(), expected.detach())


def test_d1_recipe_advantages_are_reward_minus_group_mean(tmp_path, tokenizer):
    """scale_rewards='none': trl's advantages equal d1's (reward - mean of its group, no division by the std)."""
    args = config(tmp_path, recipe="d1", learning_rate=0.0, per_device_train_batch_size=8, num_generations=4)
    rewards = []

    def reward(completions, **kwargs):  # varies on a random model: the digits' sum of each completion
        text = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        values = [sum(int(ch) for ch in t if ch.isdigit()) / 7.0 for t in text]
        rewards.extend(values)
        return values

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in toy_rows(2, 5)]
    trainer = DiffuGRPOTrainer(model=small_model(tokenizer), reward_funcs=reward, args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    outputs = []
    score = trainer._generate_and_score_completions

    def spy(inputs):
        out = score(inputs)
        outputs.append(out)
        return out

    trainer._generate_and_score_completions = spy
    trainer.train()
    values = torch.tensor(rewards[:8])
    grouped = values.view(-1, 4).mean(1).repeat_interleave(4)
    assert values.std() > 0
    assert torch.equal(outputs[0]["advantages"], values - grouped)


def test_coupled_grpo_recipe_settings():
    """DiffuCoder's coupled-GRPO recipe (recipes/config_coupled_code.yaml and its coupled estimator)."""
    recipe = RECIPES["coupled_grpo"]
    assert recipe["logp_estimator"] == "coupled" and recipe["coupled_with_full_mask"]
    assert (recipe["coupled_t_min"], recipe["coupled_t_max"]) == (0.2, 0.8)
    assert (recipe["beta"], recipe["epsilon"], recipe["num_iterations"], recipe["scale_rewards"]) == (0.01, 0.5, 2, "none")
    assert recipe["temperature"] == recipe["logp_temperature"] == 1.0
    with pytest.raises(FieldError, match="unknown GRPO recipe"):
        DiffuGRPOConfig.from_recipe("d2", output_dir="x")
