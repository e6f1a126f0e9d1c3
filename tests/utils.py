"""Helpers shared by the tests, the worker scripts they launch and the test fixtures (conftest.py).

One module, so no test imports another test file or conftest: tiny models, free ports, multi-process
spawning, trainer builders, tiny saved checkpoints and servers, scripted models for the sampler tests.
Heavy imports (trl, datasets, uvicorn) stay inside the helpers that need them."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import TrainerCallback

import hf_dlm  # noqa: F401  (registers the Auto classes)
from hf_dlm import DLMConfig, DLMForDiffusionLM
from hf_dlm.data.corpus import train_bpe_tokenizer
from hf_dlm.data.memory_dataset import TokenWindowDataset
from hf_dlm.generation.sampler import DLMGenerationMixin
from hf_dlm.training.post_training import toy_reward as reversal_reward  # noqa: F401
from hf_dlm.training.post_training import toy_rows as reverse_rows  # noqa: F401
from hf_dlm.training.post_training import toy_tokenizer as digit_tokenizer  # noqa: F401
from hf_dlm.training.trainer import DLMTrainer
from hf_dlm.training.training_args import DLMTrainingArguments

VOCAB = 99
MASK_ID = 98


# -- tiny models ------------------------------------------------------------------------------------------
def tiny_config(**overrides) -> DLMConfig:
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, mask_token_id=MASK_ID, qk_norm=True,
                   max_position_embeddings=256)
    options.update(overrides)
    return DLMConfig(**options)


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides) -> DLMForDiffusionLM:
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    return DLMForDiffusionLM(config).eval()


FAMILY_VOCAB, FAMILY_MASK = 128, 126
_QWEN = dict(vocab_size=FAMILY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, mask_token_id=FAMILY_MASK)


def _family_models() -> dict:
    """Tiny models of every family hf-dlm loads natively (model_type -> constructor); the LLaDA2.1 copy with blocks
    of 8 (LLaDA2: the published 32)."""
    from hf_dlm.modeling import families as f

    llada2 = dict(**_QWEN, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, n_group=4,
                  topk_group=2, num_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, use_bias=False)
    return {
        "llada": lambda: f.LLaDAModelLM(f.LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2,
                                                      mlp_hidden_size=64, vocab_size=FAMILY_VOCAB,
                                                      max_sequence_length=128, mask_token_id=FAMILY_MASK)),
        "Dream": lambda: f.DreamModel(f.DreamConfig(**_QWEN)),
        "sdar": lambda: f.SDARForCausalLM(f.SDARConfig(**_QWEN, head_dim=16)),
        "sdar_moe": lambda: f.SDARMoeForCausalLM(f.SDARMoeConfig(**_QWEN, head_dim=16, num_experts=4,
                                                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                                                 norm_topk_prob=True)),
        "Fast_dLLM_Qwen": lambda: f.Fast_dLLM_QwenForCausalLM(f.FastDLLMQwenConfig(**_QWEN)),
        "lladamoe": lambda: f.LLaDAMoEModelLM(f.LLaDAMoEConfig(**_QWEN, expert_intermediate_size=16, num_experts=4,
                                                               num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                                               qk_layernorm=True)),
        "llada2_moe": lambda: f.LLaDA2MoeModelLM(f.LLaDA2MoeConfig(**llada2)),
        "llada21_moe": lambda: f.LLaDA21MoeModelLM(f.LLaDA21MoeConfig(**llada2, block_size=8)),
    }


FAMILY_NAMES = ("llada", "Dream", "sdar", "sdar_moe", "Fast_dLLM_Qwen", "lladamoe", "llada2_moe", "llada21_moe")


def tiny_family(name: str, seed: int = 0):
    """A tiny fp32 model of family `name` (eager attention), weights N(0, 0.3) so that confidences spread over (0, 1)."""
    torch.manual_seed(seed)
    model = _family_models()[name]()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" not in param_name:
                param.normal_(0, 0.3)
    return model.eval()


class EmulatedGraph:
    """Stands in for `CapturedStep` on CPU with a CUDA graph's semantics: the tensors are copied into buffers
    made at capture time, and the `fixed` arguments are the ones seen at capture (a graph holds their
    addresses: a cache re-allocated later would never be read)."""

    captures: list = []

    def __init__(self, forward, tensors, fixed, pool=None, warmups=None):
        self.forward, self.fixed, self.pool = forward, fixed, pool
        self.inputs = {name: None if t is None else t.clone() for name, t in tensors.items()}
        self.replays = 0
        EmulatedGraph.captures.append(self)

    @property
    def shapes(self) -> tuple:
        return tuple((name, None if t is None else tuple(t.shape)) for name, t in self.inputs.items())

    def __call__(self, tensors):
        for name, t in tensors.items():
            if t is not None:
                self.inputs[name].copy_(t)
        self.replays += 1
        return self.forward(**self.inputs, **self.fixed)


def emulate_step_graphs(monkeypatch) -> list:
    """From now on every `StepGraphs` (the samplers' and the engine's CUDA graphs) is enabled on CPU and captures
    `EmulatedGraph`s; -> the list of captures, in order."""
    from hf_dlm.generation import compiled_step

    EmulatedGraph.captures = []
    monkeypatch.setattr(compiled_step, "CapturedStep", EmulatedGraph)
    monkeypatch.setattr(compiled_step.torch.cuda, "graph_pool_handle", object)  # a CUDA build's pool handle
    init = compiled_step.StepGraphs.__init__
    monkeypatch.setattr(compiled_step.StepGraphs, "__init__", lambda self, model, enabled: init(self, model, True))
    return EmulatedGraph.captures


def eager_commit(monkeypatch) -> None:
    """The compiled sampler's and engine's commit scores run eagerly (`compiled_greedy_scores`,
    `compiled_sampled_scores`): a test that counts Dynamo's graphs then counts the model step's alone."""
    from hf_dlm.generation import commit_rules

    monkeypatch.setattr(commit_rules, "compiled_greedy_scores", lambda choice: commit_rules.greedy_scores)
    monkeypatch.setattr(commit_rules, "compiled_sampled_scores", lambda choice: commit_rules.sampled_scores)


def set_attn(model, implementation: str):
    model.config._attn_implementation = implementation
    return model


def left_padded(lengths, seed=1):
    """(prompts, input_ids, attention_mask) of random prompts of `lengths`, left-padded to the longest."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 90, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :], attention_mask[row, width - len(prompt) :] = prompt, 1
    return prompts, input_ids, attention_mask


# -- processes and ports ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (for torchrun / accelerate rendezvous and test servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_workers(worker, nprocs: int, *args):
    """Run `worker(rank, init_file, out_file, *args)` in `nprocs` processes; returns what rank 0 passed to
    `finish(results, out_file)`."""
    with tempfile.TemporaryDirectory() as folder:
        out_file = os.path.join(folder, "results.pt")
        mp.spawn(worker, args=(os.path.join(folder, "init"), out_file, *args), nprocs=nprocs, join=True)
        return torch.load(out_file)


def finish(results, out_file: str) -> None:
    """Rank 0 writes `results`; every rank then leaves the process group."""
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


# -- conversion: tiny AR models of the supported families ------------------------------------------------
AR_SHAPE = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
@functools.lru_cache(maxsize=1)
def ar_families() -> dict:
    """family -> (transformers model class, a tiny config of it), for the conversion tests."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**AR_SHAPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 16})),
        "mistral": (MistralForCausalLM, MistralConfig(**AR_SHAPE, head_dim=16, sliding_window=None, rms_norm_eps=1e-5)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**AR_SHAPE, tie_word_embeddings=True,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**AR_SHAPE, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    }


def randomize(model, seed=0):
    """Every tensor random, norms around 1 and biases non-zero, so a misplaced tensor shows in the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_((0.1 if "bias" in name else 0.2) * torch.randn_like(param))
    return model.eval()


def save_ar_checkpoint(family, folder, **save_options):
    """A tiny random model of `family` built with transformers' own class, saved to `folder`."""
    model_class, config = ar_families()[family]
    config._attn_implementation = "eager"
    model = randomize(model_class(config))
    model.save_pretrained(folder, **save_options)
    return model


# -- the sampler tests' scripted models -------------------------------------------------------------------
SCRIPTED_MASK, SCRIPTED_EOS, SCRIPTED_VOCAB = 15, 14, 16  # a 16-token vocabulary for ScriptedModel


class ScriptedModel(DLMGenerationMixin, nn.Module):
    """logits(input_ids) -> (B, L, V) from `script`; records every forward's input ids. Exposes only the
    config attributes the sampler reads."""

    def __init__(self, script, **config):
        super().__init__()
        options = dict(mask_token_id=SCRIPTED_MASK, eos_token_id=None, label_alignment="same",
                       attention_mode="bidirectional", block_size=None)
        options.update(config)
        self.config = SimpleNamespace(**options)
        self.script, self.inputs = script, []

    def forward(self, input_ids, attention_mask=None, kv_cache=None):
        self.inputs.append(input_ids.clone())
        return SimpleNamespace(logits=self.script(input_ids).to(torch.float32))


def peaked(tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(L,) tokens and scores -> (L, V) logits whose argmax is `tokens` with a probability rising with `score`."""
    logits = torch.zeros(tokens.shape[0], SCRIPTED_VOCAB)
    logits[torch.arange(tokens.shape[0]), tokens] = scores
    logits[:, SCRIPTED_MASK] = -1e4  # never predict the mask itself
    return logits


# -- trainers ---------------------------------------------------------------------------------------------
SEQ_LEN = 16


def random_dataset(n: int = 24, seed: int = 0) -> TokenWindowDataset:
    generator = torch.Generator().manual_seed(seed)
    return TokenWindowDataset(torch.randint(0, VOCAB - 1, (n, SEQ_LEN), generator=generator))


class StepRecorder:
    """Mixed into a diffusion trainer (DLMTrainer, DLMSFTTrainer): records the loss of every optimizer step
    (sum of its micro-batch losses, as the Trainer does), the sample indices it drew, its batches and the
    gradients just before each optimizer step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses, self.sample_indices, self.grads, self.batches = [], [], [], []
        self._step_loss = 0.0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.batches.append(batches)
        return batches, num_items

    def _corrupt(self, batch, device, t_group=None):
        self.sample_indices.extend(int(i) for i in batch["sample_index"])
        return super()._corrupt(batch, device, t_group)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss += float(loss)
        if self.accelerator.sync_gradients:
            self.step_losses.append(self._step_loss)
            self._step_loss = 0.0
            model = self.accelerator.unwrap_model(self.model)
            self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return loss


class RecordingTrainer(StepRecorder, DLMTrainer):
    pass


def window_stream(ids: torch.Tensor, seed: int = 0):
    """The production stream stack (`build_pretraining_dataset` without the files): windows shuffled per
    epoch with (seed, epoch), endless, position in `state_dict()`; accelerate shards it over ranks."""
    from hf_dlm.data.streams import DistributedSampleStream, ShuffledSamples

    return DistributedSampleStream(ShuffledSamples(TokenWindowDataset(ids), seed=seed, num_epochs=None))


def make_args(output_dir, **overrides) -> DLMTrainingArguments:
    options = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
                   per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2,
                   logging_steps=1, save_strategy="no", max_steps=10, dataloader_num_workers=0)
    options.update(overrides)
    return DLMTrainingArguments(**options)


def make_trainer(output_dir, dataset=None, model_seed: int = 0, trainer_class=RecordingTrainer, eval_dataset=None,
                 **overrides):
    model = tiny_model(seed=model_seed).train()
    return trainer_class(model=model, args=make_args(output_dir, **overrides),
                         train_dataset=random_dataset() if dataset is None else dataset, eval_dataset=eval_dataset)


def flat_params(model) -> torch.Tensor:
    """Every parameter in one vector (sharded DTensors gathered)."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


class StopAfter(TrainerCallback):
    """Ends training after `step` optimizer steps, as an interruption would (the schedule still spans max_steps)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


# -- post-training (trl): the toy digit-reversal task -----------------------------------------------------
def toy_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       max_position_embeddings=64)
    return DLMForDiffusionLM(config)


def sft_dataset(n, seed):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in reverse_rows(n, seed)])


def prompt_dataset(n, seed):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in reverse_rows(n, seed)])


def common(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                   disable_tqdm=True, seed=0, logging_steps=5)
    options.update(overrides)
    return options


def sft_args(tmp_path, **overrides):
    options = common(tmp_path, max_steps=300, per_device_train_batch_size=16, learning_rate=3e-3, max_length=16)
    options.update(overrides)
    from hf_dlm.training.sft_config import DLMSFTConfig

    return DLMSFTConfig(**options)


def sft_one_step(out_dir, tokenizer, micro, accumulation, normalization="token", t_sampling="antithetic", **extra):
    """One SGD step of DLMSFTTrainer on the first 8 rows of a shuffled toy set -> (parameters, trainer).
    Padding is excluded: with LLaDA's EOS padding the padded length, so the data, depends on the micro-batch."""
    from hf_dlm.training.sft_trainer import DLMSFTTrainer

    model = toy_model(tokenizer)
    trainer = DLMSFTTrainer(model=model, args=sft_args(
        out_dir, max_steps=1, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        padding_policy="exclude", normalization=normalization, t_sampling=t_sampling,
        **extra), train_dataset=sft_dataset(64, 3), processing_class=tokenizer)
    trainer.train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, trainer


# -- tiny saved checkpoints, chat templates and a threaded server -----------------------------------------
SFT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = {"attn_implementation": "sdpa",
         "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "max_position_embeddings": 128}}
TRAINING = {"use_cpu": True, "max_steps": 4, "per_device_train_batch_size": 4, "save_steps": 2,
            "logging_steps": 2, "report_to": "none", "disable_tqdm": True, "learning_rate": 1e-3}
TEXTS = ["the quick brown fox jumps over the lazy dog", "a diffusion model fills in masked tokens"] * 20
SERVING_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_served_model(**config):
    """(model, tokenizer): a tiny DLM over a BPE tokenizer with a chat template; `config` overrides DLMConfig."""
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    tokenizer.chat_template = SERVING_CHAT_TEMPLATE
    model = tiny_model("sdpa", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **config)
    return model, tokenizer


def save_tiny_checkpoint(path, **config):
    model, tokenizer = tiny_served_model(**config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


class ThreadedServer:
    """uvicorn.Server on a thread; `stop()` is what SIGTERM does (should_exit), then waits for the drain."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60):
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not drain in time"


def wait_until_serving(process, url: str, timeout: float = 120):
    """Wait for a server subprocess to answer /health; fail if it exits or takes longer than `timeout`."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


# -- DLMSFTTrainer on the toy 'reverse the digits' task (single process and the torchrun worker) ----------
def sft_model(tokenizer, seed: int = 0) -> DLMForDiffusionLM:
    torch.manual_seed(seed)
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       max_position_embeddings=64, attn_implementation="sdpa")
    return DLMForDiffusionLM(config).train()


def sft_rows(n: int, seed: int = 3):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in reverse_rows(n, seed)])


@functools.cache
def recording_sft_trainer_class():
    """DLMSFTTrainer with StepRecorder (each optimizer step's loss, the noise keys drawn, the first step's
    gradients). Built on first use: importing DLMSFTTrainer imports trl."""
    from hf_dlm.training.sft_trainer import DLMSFTTrainer

    class RecordingSFTTrainer(StepRecorder, DLMSFTTrainer):
        pass

    return RecordingSFTTrainer


def sft_config(output_dir, **overrides):
    """Adam with a constant, non-zero learning rate; EOS padding off (the padded length, so the data, would
    depend on how rows are split into micro-batches and ranks)."""
    from hf_dlm.training.sft_config import DLMSFTConfig

    options = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                   disable_tqdm=True, seed=0, logging_steps=1, max_steps=4, per_device_train_batch_size=4,
                   learning_rate=1e-2, lr_scheduler_type="constant", max_length=16, padding_policy="exclude",
                   dataloader_num_workers=0, max_grad_norm=0.5)
    options.update(overrides)
    return DLMSFTConfig(**options)


def sft_trainer(output_dir, rows: int = 16, model_seed: int = 0, tokenizer=None, streaming: bool = False,
                **overrides):
    """streaming: the rows as a `datasets.IterableDataset` (one shard, no shuffle buffer)."""
    tokenizer = tokenizer or digit_tokenizer()
    train_dataset = sft_rows(rows)
    if streaming:
        train_dataset = train_dataset.to_iterable_dataset(num_shards=1)
    return recording_sft_trainer_class()(model=sft_model(tokenizer, model_seed),
                                         args=sft_config(output_dir, **overrides),
                                         train_dataset=train_dataset, processing_class=tokenizer)


def logged(trainer, key: str, after_step: int = 0) -> list:
    return [log[key] for log in trainer.state.log_history if key in log and log.get("step", 0) > after_step]


def counting(model):
    """Counts the backbone's forwards (every engine forward goes through forward_window)."""
    calls = []
    original = model.model.forward_window

    def forward_window(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.model.forward_window = forward_window
    return calls


TESTS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, check: bool = True):
    """`python -m torch.distributed.run` of `script` (a path under the repository root) on gloo CPU processes of one
    thread each -> the CompletedProcess; `check`: assert it exited 0, with its output's tail as the message."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), os.path.join(TESTS_ROOT, script), *args]
    result = subprocess.run(command, env=env, cwd=TESTS_ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def count_host_reads(monkeypatch, reads: list):
    """Appends to `reads` each tensor read back to Python (bool, int, item, tolist): a host sync on a GPU."""
    for name in ("__bool__", "__int__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
