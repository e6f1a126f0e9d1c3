"""`DLMGenerationConfig`: the diffusion sampler's settings, saved with the model as generation_config.json."""

from __future__ import annotations

import math

from transformers import GenerationConfig

from ..utils.errors import FieldError
from .commit_rules import COUNT_RULES, REMASKING
from .sampling import SCHEDULES
from .compiled_step import COMPILE_CHOICES, is_compile_choice

CACHE_MODES = ("none", "prefix", "dual")

# field -> (default, help); kept in one table so the CLI and the docs read the same text
DLM_GENERATION_FIELDS = {
    "steps": (None, "forward passes in total (default: max_new_tokens, one token per step), split evenly over blocks"),
    "block_length": (None, "semi-autoregressive block length (default: max_new_tokens, one block)"),
    "remasking": ("low_confidence", f"which masked positions to commit first: one of {REMASKING}"),
    "schedule": ("even", f"how many masks each step of a block commits under LLaDA's budget (no count rule set): one "
                 f"of {SCHEDULES}; 'even': masks // steps per step, the remainder first (LLaDA "
                 "get_num_transfer_tokens); 'dream': Dream's `_sample`, timesteps linspace(1, schedule_eps, steps + 1), "
                 "step i commits int(m * (1 - t[i+1] / t[i])) of the m masks left (float32), all at the last step"),
    "schedule_eps": (1e-3, "schedule='dream': the last timestep (Dream's eps)"),
    "align_blocks": (False, "blocks aligned to multiples of block_length in the row's positions (LLaDA2.x, SDAR, "
                     "Fast-dLLM v2): the prompt's partial last block is decoded first, the last block is decoded whole "
                     "(its masks past max_new_tokens take part, as in those generate codes) and the output cut at "
                     "max_new_tokens; False: blocks start at the prompt end (LLaDA). steps, when set, is split over the "
                     "row's blocks"),
    "sub_block_length": (None, "Fast-dLLM v2: a block's masks are decided in sub-blocks of this length (aligned to the "
                         "block start), left to right: a step's candidates are the masks of the first sub-block that "
                         "has any; needs a count rule (threshold, factor or entropy_bound)"),
    "first_token_alone": (False, "Fast-dLLM v2: when a block's first position (an aligned block start) is masked, the "
                          "block's first step commits it alone (shifted models: the next-token prediction of the "
                          "previous block's last position); needs a count rule (threshold, factor or entropy_bound)"),
    "cfg_scale": (0.0, "classifier-free guidance: un + (s + 1) * (cond - un), the prompt masked for un"),
    "threshold": (None, "Fast-dLLM parallel decoding: commit every masked token of the block whose confidence "
                  "is >= threshold (at least the most confident one) until the block is done; steps is then ignored"),
    "factor": (None, "Fast-dLLM's factor rule (get_transfer_index_dynamic): commit the longest prefix of the block's "
               "masks sorted by confidence whose i-th (from 1) is >= 1 - factor / (i + 1), at least one; steps ignored"),
    "entropy_bound": (None, "entropy-bounded sampler (arXiv 2505.24857): commit the k lowest-entropy masks of the block "
                      "whose entropies, less the largest, sum to <= entropy_bound (at least one); steps ignored"),
    "hierarchy_threshold": (None, "dInfer's hierarchical decoding (HierarchyDecoder, its low_threshold; 0.4 there): "
                            "in each run of contiguous masks of the block, the most confident commits when its "
                            "confidence is > hierarchy_threshold, and the block's most confident always; with "
                            "threshold beside it, every mask > threshold too; steps ignored"),
    "editing_threshold": (None, "LLaDA2.1 token editing, beside threshold: each step also replaces committed tokens of "
                          "the current block whose new prediction differs with probability > editing_threshold; a block "
                          "ends at a mask-free step without edits or after max_post_steps mask-free steps"),
    "credit_alpha": (None, "dInfer's credit decoding (CreditThresholdParallelDecoder, its credit_alpha; 0.7 there), "
                     "beside threshold: each step of a block adds to a credit per position and token (the masks' "
                     "top-1 token gains p ** credit_boost, the whole credit decays by credit_decay first) and "
                     "decides on logits + credit_alpha * log(1 + credit), so tokens predicted at earlier steps commit "
                     "sooner; reset at every block; keeps block x vocabulary floats per row"),
    "credit_boost": (0.2, "credit_alpha: the exponent of the top-1 probability added to the credit (dInfer boost_gamma)"),
    "credit_decay": (0.8, "credit_alpha: the credit's decay per step (dInfer decay_beta)"),
    "max_post_steps": (16, "token editing: mask-free forwards a block may take at most (LLaDA2.1's max_post_steps)"),
    "cache": ("none", f"KV cache, one of {CACHE_MODES}; approximate for bidirectional models (Fast-dLLM), "
              "exact for attention_mode='block' models (prefix and dual mean the same there)"),
    "stop_on_eos": (False, "opt-in early stop (changes outputs against LLaDA's reference sampler, which the default "
                    "reproduces): after each block, a row whose decoded block ends in an EOS run (every token "
                    "after the block's first EOS is EOS) is done: its remaining masks become EOS and it leaves "
                    "the forward batch"),
    "mask_token_id": (None, "default: model.config.mask_token_id"),
    "compile": (None, "run the sampler's forward through torch.compile with static shapes (fixed batch, block-sized "
                "windows): True (Inductor's default mode; on CUDA each static shape is then replayed as one CUDA "
                "graph), a torch.compile mode "
                "('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs') or a backend "
                "('cudagraphs': CUDA graphs without Inductor, compiles in seconds; 'eager': tracing only); "
                "same tokens as eager; not for infilling or attention_mode='block' caches"),
}


# transformers generation options a diffusion sampler cannot honour: name -> the value that means "off"
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "length_penalty": 1.0, "early_stopping": False,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "constraints": None,
    "sequence_bias": None, "penalty_alpha": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "min_p": None, "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "stop_strings": None,
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "prompt_lookup_num_tokens": None, "assistant_early_exit": None, "watermarking_config": None,
    "max_time": None,
}
# generate() keywords that are not GenerationConfig fields but come from transformers callers: a tokenizer
# (for stop strings, unsupported anyway), compile switches, and `model.generate(**tokenizer(...))`'s
# token_type_ids (a DLM has no token types); accepted and not used
EXTRA_GENERATE_KWARGS = ("tokenizer", "disable_compile", "token_type_ids")


class DLMGenerationConfig(GenerationConfig):
    """GenerationConfig plus the diffusion fields (`DLM_GENERATION_FIELDS`). Fields that keep their
    transformers meaning: max_new_tokens (default 64), max_length (prompt + new tokens, when
    max_new_tokens is not set), do_sample (False: greedy, whatever the temperature), temperature
    (sampling: Gumbel-max in float64; 0 = greedy), top_k, top_p, num_return_sequences, eos_token_id (an
    id or a list), pad_token_id, return_dict_in_generate. The options in `UNSUPPORTED` raise a ValueError
    unless left at their "off" value. Passing a temperature without do_sample turns sampling on (off for 0)."""

    def __init__(self, **kwargs):
        for name, (default, _) in DLM_GENERATION_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        # transformers rejects a temperature without do_sample: temperature 0 is stored as greedy
        if kwargs.get("temperature") is not None and "do_sample" not in kwargs:
            if float(kwargs["temperature"]) == 0.0:
                kwargs["temperature"], kwargs["do_sample"] = None, False
            else:
                kwargs["do_sample"] = True
        super().__init__(**kwargs)

    @property
    def sampling_temperature(self) -> float:
        """0 means argmax (greedy): do_sample=False is greedy whatever the temperature."""
        return float(self.temperature or 0.0) if self.do_sample else 0.0

    @classmethod
    def from_any(cls, config: GenerationConfig | None, validate: bool = True, **overrides) -> "DLMGenerationConfig":
        """A DLMGenerationConfig from a plain GenerationConfig (as `from_pretrained` loads it: the
        diffusion keys survive there as extra attributes) with keyword overrides on top."""
        values = {} if config is None else config.to_dict()
        if "temperature" in overrides and "do_sample" not in overrides:
            values.pop("do_sample", None)  # a temperature passed alone decides (see the class docstring)
        values.update({k: v for k, v in overrides.items() if v is not None or k in DLM_GENERATION_FIELDS})
        for key in ("transformers_version", "_from_model_config"):
            values.pop(key, None)
        out = cls(**values)
        if validate:
            out.validate_dlm()
        return out

    def validate_dlm(self):
        """Raise a ValueError naming every option out of range or not supported by a diffusion sampler."""
        def fail(name, expected):
            raise FieldError(name, f"DLMGenerationConfig.{name} must be {expected}, got {getattr(self, name)!r}",
                             getattr(self, name))

        unsupported = [f"{name}={getattr(self, name)!r}" for name, off in UNSUPPORTED.items()
                       if getattr(self, name, None) not in (off, None)]
        if unsupported:
            raise ValueError(f"generate: not supported by the diffusion sampler: {', '.join(unsupported)} "
                             f"(leave them at their defaults)")
        if self.remasking not in REMASKING:
            fail("remasking", f"one of {REMASKING}")
        if self.schedule not in SCHEDULES:
            fail("schedule", f"one of {SCHEDULES}")
        if not 0.0 < float(self.schedule_eps) < 1.0:
            fail("schedule_eps", "in (0, 1)")
        if not isinstance(self.align_blocks, bool):
            fail("align_blocks", "a bool")
        if not isinstance(self.first_token_alone, bool):
            fail("first_token_alone", "a bool")
        for name in ("sub_block_length", "first_token_alone"):
            if getattr(self, name) and not any(getattr(self, rule) is not None for rule in COUNT_RULES):
                fail(name, f"used with a count rule ({', '.join(COUNT_RULES)}): LLaDA's per-step budget counts the "
                     "whole block; set one of them or unset")
        if self.cache not in CACHE_MODES:
            fail("cache", f"one of {CACHE_MODES}")
        if not is_compile_choice(self.compile):
            fail("compile", f"a bool or one of {tuple(COMPILE_CHOICES)}")
        if self.threshold is not None and not 0.0 <= float(self.threshold) <= 1.0:
            fail("threshold", "in [0, 1]")
        if self.factor is not None and not float(self.factor) > 0:
            fail("factor", "> 0")
        if self.entropy_bound is not None and not float(self.entropy_bound) >= 0:
            fail("entropy_bound", ">= 0")
        if self.hierarchy_threshold is not None and not 0.0 <= float(self.hierarchy_threshold) <= 1.0:
            fail("hierarchy_threshold", "in [0, 1]")
        count_rules = [name for name in COUNT_RULES if getattr(self, name) is not None]
        if "hierarchy_threshold" in count_rules and "threshold" in count_rules:
            count_rules.remove("threshold")  # dInfer's second bound beside the hierarchy, not a count rule of its own
        if len(count_rules) > 1:
            raise FieldError(count_rules[1], f"DLMGenerationConfig: {' and '.join(count_rules)} each decide how many "
                             "tokens a step commits; set one of them", getattr(self, count_rules[1]))
        if self.editing_threshold is not None:
            if not 0.0 <= float(self.editing_threshold) <= 1.0:
                fail("editing_threshold", "in [0, 1]")
            if self.threshold is None or self.hierarchy_threshold is not None:
                fail("editing_threshold", "used beside threshold (LLaDA2.1: threshold for masks, editing_threshold "
                     "for committed tokens); set threshold too or")
        self._validate_credit(fail)
        if not isinstance(self.max_post_steps, int) or isinstance(self.max_post_steps, bool) or self.max_post_steps < 1:
            fail("max_post_steps", "an integer >= 1")
        for name in ("steps", "block_length", "max_new_tokens", "sub_block_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                fail(name, "an integer >= 1")
        if self.num_return_sequences is not None and (not isinstance(self.num_return_sequences, int)
                                                      or self.num_return_sequences < 1):
            fail("num_return_sequences", "an integer >= 1")
        if self.temperature is not None and float(self.temperature) < 0:
            fail("temperature", ">= 0")
        if self.top_p is not None and not 0.0 < float(self.top_p) <= 1.0:
            fail("top_p", "in (0, 1]")
        if self.top_k is not None and int(self.top_k) < 0:
            fail("top_k", ">= 0")
        if float(self.cfg_scale or 0.0) < 0:
            fail("cfg_scale", ">= 0")
        if (self.num_return_sequences or 1) > 1 and not self.do_sample:
            raise ValueError(f"DLMGenerationConfig.num_return_sequences={self.num_return_sequences} needs "
                             "do_sample=True (greedy decoding would return identical copies), as in transformers")

    def _validate_credit(self, fail):
        if not 0.0 <= float(self.credit_boost) < math.inf:
            fail("credit_boost", ">= 0 and finite")
        if not 0.0 <= float(self.credit_decay) <= 1.0:
            fail("credit_decay", "in [0, 1]")
        if self.credit_alpha is None:
            return
        if not 0.0 <= float(self.credit_alpha) < math.inf:
            fail("credit_alpha", ">= 0 and finite")
        # dInfer's credit is a threshold decoder's over a whole block's masks, ranked by probability
        others = {"factor": self.factor, "entropy_bound": self.entropy_bound, "editing_threshold": self.editing_threshold,
                  "hierarchy_threshold": self.hierarchy_threshold,
                  "sub_block_length": self.sub_block_length, "first_token_alone": self.first_token_alone or None}
        given = [name for name, value in others.items() if value is not None]
        if given:
            raise FieldError("credit_alpha", f"DLMGenerationConfig.credit_alpha (dInfer's credit decoding) works with "
                             f"threshold only, not with {', '.join(given)}; unset one of them", self.credit_alpha)
        if self.threshold is None:
            raise FieldError("credit_alpha", "DLMGenerationConfig.credit_alpha (dInfer's credit decoding) is used beside "
                             f"threshold; set threshold too, got credit_alpha={self.credit_alpha!r} alone",
                             self.credit_alpha)
        if self.remasking != "low_confidence":
            raise FieldError("credit_alpha", "DLMGenerationConfig.credit_alpha decides on token probabilities "
                             f"(remasking='low_confidence'), got remasking={self.remasking!r}", self.credit_alpha)


__all__ = ["DLMGenerationConfig", "DLM_GENERATION_FIELDS", "REMASKING", "UNSUPPORTED"]
