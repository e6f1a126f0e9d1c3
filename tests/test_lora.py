"""peft LoRA on DLM models: default targets, DLMTrainer with an adapter, save / reload, merge."""

import pytest
import torch

peft = pytest.importorskip("peft")  # the `trl` extra; CI installs it through the `test` extra

from hf_dlm.training.lora import (DLM_LORA_TARGET_MODULES, dlm_lora_config, get_dlm_peft_model,  # noqa: E402
                                  register_peft_defaults)
from tests.utils import MASK_ID, VOCAB, tiny_model  # noqa: E402
from tests.utils import make_args, random_dataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def trained_adapter(tmp_path):
    """A LoRA adapter trained for a few DLMTrainer steps (non-zero B, so the adapter changes the outputs)."""
    from hf_dlm import DLMTrainer

    model = get_dlm_peft_model(tiny_model(seed=1).train(), r=4, lora_alpha=8)
    trainer = DLMTrainer(model=model, args=make_args(tmp_path / "run", max_steps=6, t_buckets=0),
                         train_dataset=random_dataset())
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # base untouched
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the adapter trained
    return model.eval()


def test_default_targets_are_every_projection():
    register_peft_defaults()
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2))  # no target_modules: the DLM default
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(DLM_LORA_TARGET_MODULES)
    assert dlm_lora_config().target_modules == set(DLM_LORA_TARGET_MODULES)


def test_adapter_saved_reloaded_and_merged_give_identical_outputs(tmp_path):
    model = trained_adapter(tmp_path)
    ids = torch.randint(0, VOCAB - 1, (3, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 4:8] = MASK_ID
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        base_logits = tiny_model(seed=1)(input_ids=ids).logits
        tokens = model.generate(ids[:, :4], max_new_tokens=8, steps=8, temperature=0)
    assert not torch.allclose(logits, base_logits)  # the adapter matters
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(tiny_model(seed=1), tmp_path / "adapter").eval()
    with torch.no_grad():
        # a few fp32 ulps allowed: reloaded weights sit at other alignments (other CPU SIMD paths)
        torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=0, atol=1e-6)
        assert torch.equal(reloaded.generate(ids[:, :4], max_new_tokens=8, steps=8, temperature=0), tokens)
        merged = reloaded.merge_and_unload()
        assert not any("lora" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(merged.generate(ids[:, :4], max_new_tokens=8, steps=8, temperature=0), tokens)


def test_merged_lora_weights_run_the_adapter_as_one_gemm_and_restore_the_base_bit_exactly(tmp_path):
    from hf_dlm.training.lora import merged_lora_weights

    model = trained_adapter(tmp_path)
    ids = torch.randint(0, VOCAB - 1, (3, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 4:8] = MASK_ID
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    storages = [layer.get_base_layer().weight.data_ptr() for layer in layers]
    before = {n: p.clone() for n, p in model.named_parameters()}
    calls = []
    hooks = [layer.lora_A["default"].register_forward_hook(lambda *_: calls.append(1)) for layer in layers]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids[:, :4], max_new_tokens=8, steps=8, temperature=0)
        unmerged_calls = len(calls)
        with merged_lora_weights(model):
            merged_logits = model(input_ids=ids).logits
            merged_tokens = model.generate(ids[:, :4], max_new_tokens=8, steps=8, temperature=0)
            # every projection runs merged: W + scale * B @ A, and the adapter's own GEMMs never run
            q = layers[0]
            scale = q.scaling["default"]
            expected = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] + scale * (
                q.lora_B["default"].weight @ q.lora_A["default"].weight)
            torch.testing.assert_close(q.get_base_layer().weight, expected, rtol=0, atol=1e-6)
        assert len(calls) == unmerged_calls
        after_logits = model(input_ids=ids).logits
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(merged_logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged_tokens, tokens)
    # afterwards: the same storage, bit-identical weights, the adapter active again
    assert [layer.get_base_layer().weight.data_ptr() for layer in layers] == storages
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # exact: the same weights in the same storage through the same kernels, in one process
    assert torch.equal(after_logits, logits) and not any(layer.disable_adapters for layer in layers)
    assert all(p.requires_grad == before[n].requires_grad for n, p in model.named_parameters())


def test_lora_on_an_in_memory_base_saves_the_base_and_loads_with_auto_peft_model(tmp_path):
    """`hf-dlm sft --use_peft true` on the toy base (built in memory): the base is saved beside the adapter, the
    adapter names it, and peft's AutoPeftModel (no import allowlist) loads base + adapter with equal outputs."""
    import json

    from peft import AutoPeftModel

    from hf_dlm.training.post_training import run_sft

    out = tmp_path / "sft"
    trainer = run_sft(["--model_name_or_path", "toy", "--dataset_name", "toy-reverse", "--toy_examples", "32",
                       "--use_peft", "true", "--lora_r", "4", "--max_steps", "3", "--per_device_train_batch_size",
                       "8", "--learning_rate", "1e-2", "--output_dir", str(out), "--use_cpu", "true", "--bf16",
                       "false", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    assert (out / "base" / "model.safetensors").exists() and (out / "base" / "tokenizer.json").exists()
    loaded = AutoPeftModel.from_pretrained(out).eval()
    ids = torch.randint(5, 15, (2, 10), generator=torch.Generator().manual_seed(0))
    ids[:, 5:] = 2  # masks
    trained = trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)
        assert any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if "lora_B" in n)


def test_any_dlm_adapter_loads_with_auto_peft_model_and_the_allowlist(tmp_path):
    """An adapter saved by peft itself names hf_dlm's class: AutoPeftModel loads it with import_allowlist=["hf_dlm"]
    (peft refuses other packages by default); make_adapter_auto_loadable rewrites it to need none; an adapter whose
    base was never saved is refused with the fix named."""
    from peft import AutoPeftModel

    from hf_dlm.training.lora import make_adapter_auto_loadable
    from hf_dlm.utils.errors import FieldError

    base = tiny_model(seed=1)
    base.save_pretrained(tmp_path / "base")
    base = type(base).from_pretrained(tmp_path / "base")
    model = get_dlm_peft_model(base, r=4, lora_alpha=8)
    torch.nn.init.normal_(next(p for n, p in model.named_parameters() if "lora_B" in n))
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="allowlist"):
        AutoPeftModel.from_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, VOCAB - 1, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        loaded = AutoPeftModel.from_pretrained(tmp_path / "adapter", import_allowlist=["hf_dlm"]).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected)
        make_adapter_auto_loadable(tmp_path / "adapter")
        torch.testing.assert_close(AutoPeftModel.from_pretrained(tmp_path / "adapter").eval()(input_ids=ids).logits,
                                   expected)
    orphan = get_dlm_peft_model(tiny_model(seed=2), r=2)
    orphan.save_pretrained(tmp_path / "orphan")
    with pytest.raises(FieldError, match="save the base first"):
        make_adapter_auto_loadable(tmp_path / "orphan")
