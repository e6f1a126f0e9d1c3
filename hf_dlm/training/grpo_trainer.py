"""`DiffuGRPOTrainer`: trl's `GRPOTrainer` for masked-diffusion LMs (diffu-GRPO, d1 and successors).

trl 1.16's loop, rewards, advantages, clipping, KL and importance sampling stay as they are; three hooks
change (trl no longer calls `_get_per_token_logps`, the hook every public d1 copy overrides):
- `_generate_single_turn`: rollouts through the DLM's batched mixed-length sampler (`model.generate` with the
  `DLMGenerationConfig` of `DiffuGRPOConfig.rollout_generation_config`: left-padded prompts, threshold decoding,
  caches, compile; LoRA adapters folded into merged copies of the base weights, `merged_lora_weights`), cut
  after the first EOS as trl does.
- `_get_per_token_logps_and_entropies`: completion log-probabilities from a pluggable estimator
  (`logp_estimators`: d1's one-step, DiffuCoder's coupled masks, Monte Carlo ELBO), never trl's causal head.
  The estimator sees the canvas as it was sampled: completion padding is the EOS the sampler wrote. Its
  temperature is `DiffuGRPOConfig.estimator_temperature` (the rollout's unless `logp_temperature` is set).
- `_generate_and_score_completions` / `compute_loss`: every inner iteration (`num_iterations`) gets its own
  masks, as in d1; the old-policy and reference log-probabilities are computed at rollout time for every
  iteration's masks, and each optimisation pass reads its own slice, so ratios compare like with like.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch

from ..utils.import_utils import require

require("trl", "DiffuGRPOTrainer")

from accelerate.utils import is_peft_model  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402
from trl.trainer.utils import disable_dropout_in_model, pad  # noqa: E402

from .grpo_config import DiffuGRPOConfig  # noqa: E402
from ..diffusion.logp_estimators import build_estimator  # noqa: E402
from .lora import merged_lora_weights  # noqa: E402
from ..diffusion.noise import mix32  # noqa: E402
from .trl_compat import load_dlm, without_causal_lm_head  # noqa: E402

_STACKED = ("old_per_token_logps", "ref_per_token_logps")  # (B, num_iterations, K) from rollout time


class DiffuGRPOTrainer(GRPOTrainer):
    """GRPO for DLMs. Arguments as `trl.GRPOTrainer`; `args` is a `DiffuGRPOConfig`. A reference model for
    `beta > 0` is a frozen copy of the policy (or, with peft, the policy with adapters disabled)."""

    _tag_names = ["trl", "grpo", "hf-dlm", "diffusion"]

    def __init__(self, model, reward_funcs=None, args: DiffuGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, **kwargs):
        if args is None:
            args = DiffuGRPOConfig(output_dir="outputs/dlm-grpo")
        if not isinstance(args, DiffuGRPOConfig):
            raise TypeError(f"DiffuGRPOTrainer needs a DiffuGRPOConfig, got {type(args).__name__}")
        model = load_dlm(model, args.model_init_kwargs, "DiffuGRPOTrainer")
        # trl would load the reference model by name as an AutoModelForCausalLM: keep a frozen copy instead
        copy_reference = args.beta != 0.0 and peft_config is None and not is_peft_model(model)
        reference = copy.deepcopy(model).eval().requires_grad_(False) if copy_reference else None
        beta, sync = args.beta, args.sync_ref_model
        if copy_reference:
            args.beta, args.sync_ref_model = 0.0, False
        try:
            with without_causal_lm_head("trl.trainer.grpo_trainer"):
                super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                                 eval_dataset=eval_dataset, processing_class=processing_class,
                                 reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                                 optimizers=optimizers, peft_config=peft_config, **kwargs)
        finally:
            args.beta, args.sync_ref_model = beta, sync
        if reference is not None:
            from trl.trainer.callbacks import SyncRefModelCallback

            self.beta = beta
            if args.disable_dropout:
                disable_dropout_in_model(reference)
            self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
            if sync:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        config = self.accelerator.unwrap_model(self.model).config
        # trl enables its MoE auxiliary loss for any config with `router_aux_loss_coef` (DLMConfig has one); the
        # estimators return no router losses, so a dense model has none to add and an MoE model is refused
        if getattr(config, "num_experts", 0) and (config.router_aux_loss_coef or config.router_z_loss_coef):
            raise ValueError("DiffuGRPOTrainer: the log-probability estimators do not return MoE router losses yet; "
                             "set router_aux_loss_coef=0 and router_z_loss_coef=0 on the model config to train "
                             "this mixture-of-experts model without them")
        self.aux_loss_enabled = False
        mask_token_id = config.mask_token_id
        self.estimator = build_estimator(args.logp_estimator, mask_token_id, temperature=args.estimator_temperature,
                                         **args.estimator_options())
        self._score_all_iterations = False

    # -- which masks --------------------------------------------------------------------------------
    def _current_iteration(self) -> int:
        """Index of the optimisation pass over the current rollout batch (0 .. num_iterations - 1)."""
        if not self.model.training:
            return 0
        return (self._step % (self.args.steps_per_generation * self.num_iterations)) // self.args.steps_per_generation

    def estimator_seed(self, iteration: int) -> int:
        """Seed of the masks of inner iteration `iteration` of the current rollout batch (its own per batch)."""
        base = self.args.seed if self.args.estimator_seed is None else self.args.estimator_seed
        rollout = self._step // (self.args.steps_per_generation * self.num_iterations) if self.model.training else -1
        step_key = torch.tensor([(rollout * 0x10001 + iteration) & 0xFFFFFFFF])
        key = mix32(torch.tensor([base & 0xFFFFFFFF]) ^ mix32(step_key))
        return int(key)

    # -- rollouts -------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("DiffuGRPOTrainer: DLM rollouts take text prompts only (no images or multimodal fields)")
        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                        pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        attention_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self.accelerator.autocast(),
            merged_lora_weights(unwrapped_model) if self.args.generation_merge_adapters else nullcontext(),
        ):
            generation_config = self.args.rollout_generation_config(eos_token_id=self.eos_token_ids,
                                                                    pad_token_id=self._tokenizer.pad_token_id)
            sequences = unwrapped_model.generate(input_ids, attention_mask=attention_mask,
                                                 generation_config=generation_config)
        completion = sequences[:, input_ids.shape[1]:]
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rollout/tokens_per_second"].append(completion.numel() / (time.perf_counter() - start))
        # keep everything up to and including the first EOS (trl's convention); the rest is EOS fill
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=device))
        length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1]).tolist()
        return [row[:n].tolist() for row, n in zip(completion.cpu(), length)], None

    # -- log-probabilities --------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal_inputs):
        """(B, P + K) prompt (left-padded) + completion (right-padded) -> estimated log p per completion token
        (B, K), or (B, num_iterations, K) while scoring a rollout batch for every inner iteration."""
        if any(value is not None for value in multimodal_inputs.values()):
            raise ValueError("DiffuGRPOTrainer: DLMs take text only (no pixel values / token type ids)")
        completion_mask = attention_mask[:, -logits_to_keep:]
        # the sampler's canvas: the completion's padding is the EOS fill the sampler wrote, and is attended to
        canvas = input_ids.clone()
        canvas[:, -logits_to_keep:] = input_ids[:, -logits_to_keep:].masked_fill(completion_mask == 0,
                                                                                 self.eos_token_ids[0])
        canvas_mask = attention_mask.clone()
        canvas_mask[:, -logits_to_keep:] = 1
        iterations = range(self.num_iterations) if self._score_all_iterations else [self._current_iteration()]
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for iteration in iterations:
            seed = self.estimator_seed(iteration)
            parts = []
            for start in range(0, input_ids.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                with self.accelerator.autocast():
                    parts.append(self.estimator(model, canvas[rows], canvas_mask[rows], logits_to_keep, seed,
                                                scored=completion_mask[rows], compute_entropy=compute_entropy))
            logps.append(torch.cat([p[0] for p in parts]))
            if compute_entropy:
                entropies.append(torch.cat([p[1] for p in parts]))
        if self._score_all_iterations:
            return torch.stack(logps, 1), (torch.stack(entropies, 1) if compute_entropy else None), None
        return logps[0], (entropies[0] if compute_entropy else None), None

    def _generate_and_score_completions(self, inputs):
        self._score_all_iterations = self.model.training
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._score_all_iterations = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        iteration = self._current_iteration()
        inputs = {key: value[:, iteration] if key in _STACKED and value.dim() == 3 else value
                  for key, value in inputs.items()}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


__all__ = ["DiffuGRPOTrainer"]
