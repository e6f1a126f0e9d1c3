"""lm-evaluation-harness model `hf-dlm`: diffusion LMs scored the way LLaDA evaluates them.

- `loglikelihood`: minus the Monte Carlo ELBO of the continuation given the context (`elbo_nll`,
  `mc_num` stratified draws). Each request draws its masks from a generator seeded by a hash of
  (seed, its tokens), so scores do not change with the batch size or the order of requests (lm-eval
  forks that share one generator report scores that move with the batch size). `is_greedy`, by
  `greedy_check`: "one_forward" (default): every continuation token is the argmax when the whole
  continuation is masked; "iterative": LLaDA's `suffix_greedy_prediction` (eval_llada.py): the continuation
  is decoded from all masks one token per forward, the most confident masked position first, and must come
  out equal. Only tasks that read `is_greedy` (LAMBADA accuracy) differ; the iterative check costs one
  forward per continuation token. `subs=True`: [MASK] out of the softmax in both (MDLM SUBS models).
  The scoring is `scoring.score_continuations`, a plain function benchmarks share; a causal model
  (`attention_mode="causal"`) gets its exact log-likelihood there.
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows of `max_length`, each window's tokens
  scored by the ELBO given the window's context.
- `generate_until`: the continuous-batching engine (the sampler's semantics, per-request seeds), cut
  at EOS and at the first stop sequence; a row stops decoding once a stop sequence appears.

    lm_eval --model hf-dlm --model_args pretrained=PATH,mc_num=32,peft=ADAPTER --tasks ... --include_path DIR
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..serving.engine import ContinuousBatchingEngine
from ..serving.requests import GenerationRequest, decode_answer
from ..utils.errors import FieldError
from .scoring import GREEDY_CHECKS, greedy_iterative, greedy_one_forward, request_seed, score_continuations  # noqa: F401


def _to_bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("hf-dlm")
class DLMEvalHarness(LM):
    def __init__(self, pretrained=None, model=None, tokenizer=None, peft: str | None = None, device: str | None = None,
                 dtype: str = "auto", batch_size: int | str = 8, max_batch_size: int | None = None, mc_num: int = 128,
                 seed: int = 1234, max_length: int | None = None, max_gen_toks: int = 128, block_length: int = 32,
                 steps: int | None = None, threshold: float | None = None, temperature: float = 0.0,
                 remasking: str | None = None, cache: str | None = None, greedy_check: str = "one_forward",
                 subs: bool | str = False, factor: float | None = None, entropy_bound: float | None = None,
                 editing_threshold: float | None = None, hierarchy_threshold: float | None = None,
                 credit_alpha: float | None = None,
                 credit_boost: float | None = None, credit_decay: float | None = None, compile=None, **unused):
        """pretrained: checkpoint folder (or pass `model` and `tokenizer` objects); peft: a LoRA adapter folder;
        mc_num: ELBO draws per request (LLaDA uses 128); steps: sampler steps for generate_until (default:
        one token per step); greedy_check: "one_forward" (default) or "iterative" (LLaDA's
        suffix_greedy_prediction), see the module docstring; subs: the model was trained with the objective's
        subs=True (the `mdlm` preset): [MASK] is removed from the softmax when scoring; remaining generation
        knobs as in `model.generate` (generate_until runs the decoding core's engine: factor / entropy_bound /
        hierarchy_threshold / editing_threshold / credit_* commit rules, compile for its compiled step)."""
        super().__init__()
        if unused:
            raise TypeError(f"hf-dlm lm-eval model: unknown model_args {sorted(unused)}")
        if model is None:
            if pretrained is None:
                raise ValueError("hf-dlm lm-eval model: pass pretrained=PATH (or model= and tokenizer=)")
            from ..hub.loading import load_model

            model, tokenizer = load_model(pretrained, device, dtype, peft)
        elif peft:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, peft).merge_and_unload().eval()
        if greedy_check not in GREEDY_CHECKS:
            raise FieldError("greedy_check", f"hf-dlm lm-eval model: greedy_check must be one of {GREEDY_CHECKS}, "
                             f"got {greedy_check!r}", greedy_check)
        self.greedy_check, self.subs = greedy_check, _to_bool(subs)
        self.model, self.tokenizer = model, tokenizer
        self._device = next(model.parameters()).device
        if str(batch_size).startswith("auto"):
            raise ValueError("hf-dlm lm-eval model: batch_size='auto' is not supported; pass a number")
        self.batch_size = int(batch_size)
        self.mc_num, self.seed = int(mc_num), int(seed)
        self.max_length = int(max_length or getattr(model.config, "max_position_embeddings", 2048))
        self.max_gen_toks, self.block_length = int(max_gen_toks), int(block_length)
        self.steps = None if steps is None else int(steps)
        self.threshold = None if threshold is None else float(threshold)
        self.temperature, self.remasking, self.cache = float(temperature), remasking, cache
        rules = dict(factor=factor, entropy_bound=entropy_bound, editing_threshold=editing_threshold,
                     hierarchy_threshold=hierarchy_threshold,
                     credit_alpha=credit_alpha, credit_boost=credit_boost, credit_decay=credit_decay)
        # unset credit_boost / credit_decay keep the sampler's defaults (dInfer's)
        self.rules = {name: None if value is None else float(value) for name, value in rules.items()
                      if value is not None or name not in ("credit_boost", "credit_decay")}
        self.compile = {"true": True, "false": None, "none": None}.get(str(compile).lower(), compile)
        self.max_batch_size = int(max_batch_size or self.batch_size)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.prefix_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos

    # ---- lm-eval plumbing ------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template=False):
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _request_seed(self, *token_lists) -> int:
        return request_seed(self.seed, *token_lists)

    # ---- scoring ---------------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], progress: str | None = None) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (log-likelihood bound, is_greedy), in the input order
        (`scoring.score_continuations`: the ELBO for diffusion models, the exact value for causal ones)."""
        return score_continuations(self.model, pairs, pad_token_id=self.tokenizer.pad_token_id or 0,
                                   prefix_token_id=self.prefix_token_id, max_length=self.max_length,
                                   batch_size=self.batch_size, mc_num=self.mc_num, seed=self.seed, subs=self.subs,
                                   greedy_check=self.greedy_check, progress=progress)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, context_ids = self._encode(context + continuation), self._encode(context)
            pairs.append((context_ids, whole[len(context_ids) :]))
        results = self._score(pairs, None if disable_tqdm else "loglikelihood (ELBO)")
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owners = [], []
        for n, request in enumerate(requests):
            windows = get_rolling_token_windows(self._encode(request.args[0]), self.prefix_token_id,
                                                self.max_length, context_len=1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owners.append(n)
        scores = self._score(pairs, None if disable_tqdm else "loglikelihood_rolling (ELBO)")
        totals = [0.0] * len(requests)
        for owner, (value, _) in zip(owners, scores):
            totals[owner] += value
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(gen_kwargs.pop("temperature", self.temperature))
            if not _to_bool(gen_kwargs.pop("do_sample", temperature > 0)):
                temperature = 0.0
            block_length = min(self.block_length, max_tokens)
            canvas = -(-max_tokens // block_length) * block_length
            ids = self._encode(context)[-(self.max_length - canvas) :] or [self.prefix_token_id]
            params = ContinuousBatchingEngine.sampling_params_for(
                self.model,
                max_new_tokens=canvas, block_length=block_length,
                steps=self.steps or canvas, temperature=temperature, top_p=gen_kwargs.pop("top_p", None),
                top_k=gen_kwargs.pop("top_k", None), threshold=self.threshold, remasking=self.remasking,
                cache=self.cache, **self.rules,
                seed=self._request_seed(ids, until))
            if gen_kwargs:
                raise ValueError(f"hf-dlm generate_until: unsupported gen_kwargs {sorted(gen_kwargs)} "
                                 "(supported: until, max_gen_toks, temperature, do_sample, top_p, top_k)")

            def stop_check(generated, until=until, max_tokens=max_tokens):  # `engine`: built below, before any step
                return decode_answer(self.tokenizer, generated, engine.eos_ids, until, max_tokens)[1] is not None

            jobs.append((GenerationRequest(ids, params, stop_check=stop_check), until, max_tokens))
        # the engine's storage sized for the longest row, not the model's positions: compiled on CUDA it is
        # preallocated for max_batch_size lanes of max_length slots
        longest = max((ContinuousBatchingEngine.canvas_length(len(job[0].prompt_ids), job[0].params) for job in jobs),
                      default=1)
        engine = ContinuousBatchingEngine(self.model, max_batch_size=self.max_batch_size, max_waiting=len(requests),
                                          eos_token_id=self.tokenizer.eos_token_id, compile=self.compile,
                                          max_length=longest)
        engine.submit([job[0] for job in jobs])
        with tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm) as bar, torch.no_grad():
            while engine.has_work():
                engine.step()
                bar.n = sum(engine.stats[k] for k in ("requests_finished", "requests_failed", "requests_cancelled"))
                bar.refresh()
        outputs = []
        for request, (job, until, max_tokens) in zip(requests, jobs):
            if job.finish_reason == "error":
                raise RuntimeError(f"generate_until failed for {request.args[0][:80]!r}") from job.error
            text = decode_answer(self.tokenizer, job.generated, engine.eos_ids, until, max_tokens)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs
