"""Mixture of experts: the block against hand-computed routing, the router losses against the published
formulas (and transformers' own function), grouped GEMM against the loop, the training loss, save / load,
and the Qwen3-MoE converter against transformers' model in both directions."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_dlm import DLMConfig, DLMForDiffusionLM
from hf_dlm.conversion.convert import ConversionOptions, convert_checkpoint, load_as_dlm
from hf_dlm.modeling.moe import DLMSparseMoeBlock, router_aux_losses
from hf_dlm.modeling.modeling_dlm import DLMMLP
from tests.utils import tiny_config, tiny_model
from tests.utils import randomize

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _swiglu(x, gate_up, down):
    gate, up = (gate_up @ x).chunk(2)
    return down @ (F.silu(gate) * up)


def _token_by_token(block, x):
    """The MoE output computed one token at a time, straight from the definition."""
    outputs = []
    for token in x:
        probabilities = torch.softmax(block.gate.weight @ token, dim=0)
        weights, experts = probabilities.topk(block.top_k)
        if block.norm_topk_prob:
            weights = weights / weights.sum()
        out = sum(w * _swiglu(token, block.experts.gate_up_proj[e], block.experts.down_proj[e])
                  for w, e in zip(weights, experts.tolist()))
        if block.shared_expert is not None:
            out = out + torch.sigmoid(block.shared_expert_gate.weight @ token) * block.shared_expert(token)
        outputs.append(out)
    return torch.stack(outputs)


@pytest.mark.parametrize("norm_topk_prob,shared", [(False, False), (True, True)])
def test_block_equals_token_by_token_routing(norm_topk_prob, shared):
    torch.manual_seed(0)
    config = tiny_config(**MOE, norm_topk_prob=norm_topk_prob)
    block = DLMSparseMoeBlock(config, DLMMLP(config, 24) if shared else None)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.3)
    x = torch.randn(2, 5, 32, requires_grad=True)
    expected = _token_by_token(block, x.reshape(-1, 32)).reshape(2, 5, 32)
    out = block(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # and the gradients of the input, the router and the experts (the dispatch / combine have their own backward)
    cotangent = torch.randn_like(out)
    parameters = [x] + list(block.parameters())
    grads = torch.autograd.grad((out * cotangent).sum(), parameters)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), parameters)
    for name, grad, want in zip(["input"] + [n for n, _ in block.named_parameters()], grads, expected_grads):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_block_on_a_hand_built_case():
    """Two experts of width 1, hidden 2, top-1: the router sends token (1, 0) to expert 0 and (0, 1) to
    expert 1 with probability sigmoid(4); expert e returns silu(x_e) * x_e on coordinate e."""
    config = tiny_config(hidden_size=2, num_attention_heads=1, num_key_value_heads=1, num_experts=2,
                         num_experts_per_tok=1, moe_intermediate_size=1)
    block = DLMSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor([[2.0, -2.0], [-2.0, 2.0]]))
        block.experts.gate_up_proj.copy_(torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]))
        block.experts.down_proj.copy_(torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]]))
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]]])
    p = torch.sigmoid(torch.tensor(4.0))  # softmax of logits (2, -2)
    p3 = torch.sigmoid(torch.tensor(12.0))
    expected = torch.tensor([[[p * F.silu(torch.tensor(1.0)), 0.0], [0.0, p * F.silu(torch.tensor(1.0))],
                              [p3 * 3 * F.silu(torch.tensor(3.0)), 0.0]]])
    torch.testing.assert_close(block(x), expected, atol=1e-6, rtol=0)


def test_router_losses_follow_the_published_formulas():
    """Switch / transformers load balancing E * sum_e f_e P_e and ST-MoE's z-loss, by hand on 3 tokens."""
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    top = logits.topk(2, dim=-1).indices  # experts {0, 1}, {1, 0 or 2}, {1, 2}
    probabilities = logits.softmax(-1)
    counts = torch.zeros(3).index_add_(0, top.reshape(-1), torch.ones(6))
    balance, z_loss = router_aux_losses(logits, top, 3)
    torch.testing.assert_close(balance, 3 * ((counts / 3) * probabilities.mean(0)).sum())
    lse = [torch.log(torch.exp(row).sum()) for row in logits]
    torch.testing.assert_close(z_loss, torch.stack(lse).square().mean())
    # transformers' load_balancing_loss_func for one layer gives the same number
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.testing.assert_close(balance, load_balancing_loss_func((logits,), num_experts=3, top_k=2))
    # padding left out, as transformers' attention_mask argument does
    mask = torch.tensor([1, 0, 1])
    balance, z_loss = router_aux_losses(logits, top, 3, mask)
    torch.testing.assert_close(balance, load_balancing_loss_func((logits,), num_experts=3, top_k=2,
                                                                 attention_mask=mask[None]))
    torch.testing.assert_close(z_loss, (lse[0] ** 2 + lse[2] ** 2) / 2)
    # a uniform router scores k
    even = router_aux_losses(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), 4)[0]
    torch.testing.assert_close(even, torch.tensor(2.0))


def test_grouped_mm_matches_the_loop():
    torch.manual_seed(0)
    config = tiny_config(**MOE)
    block = DLMSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.3)
    x = torch.randn(3, 7, 32)
    block.experts.implementation = "loop"
    expected = block(x)
    block.experts.implementation = "grouped_mm"  # PyTorch's CPU grouped_mm (forward) in fp32
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)



def test_the_grouped_mm_block_compiles_once_whatever_the_routing():
    # the GPU's bf16 path (grouped_mm) reads no count on the host, so a compiled decoding step keeps each MoE
    # layer inside its graph and new routings reuse it; the CPU's fp32 loop runs eagerly (see test_engine_graphs)
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = DLMSparseMoeBlock(tiny_config(**MOE)).to(torch.bfloat16).eval()
    block.experts.implementation = "grouped_mm"
    inputs = [torch.randn(3, 7, 32, dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.3)
        try:
            expected = [block(x) for x in inputs]
        except RuntimeError as error:  # bf16 grouped_mm on a CPU is recent
            pytest.skip(f"this torch has no CPU bf16 grouped_mm: {error}")
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
        for x, want in zip(inputs, expected):
            torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

def test_model_loss_adds_the_weighted_router_losses_and_dense_stays_dense():
    model = tiny_model(**MOE, decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.1,
                       router_z_loss_coef=0.01)
    assert isinstance(model.model.layers[0].mlp, DLMSparseMoeBlock) and isinstance(model.model.layers[1].mlp, DLMMLP)
    ids = torch.randint(0, 98, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(9) % 3 == 0, ids, -100)
    out = model(input_ids=ids, labels=labels)
    hidden = model.model(input_ids=ids).last_hidden_state
    ce = F.cross_entropy(model.lm_head(hidden)[labels != -100], labels[labels != -100])
    torch.testing.assert_close(out.loss, ce + 0.1 * out.aux_loss + 0.01 * out.router_z_loss)
    torch.testing.assert_close(out.router_loss, 0.1 * out.aux_loss + 0.01 * out.router_z_loss)
    assert tiny_model()(input_ids=ids, labels=labels).aux_loss is None
    # padded positions do not count: other token ids there leave both router losses unchanged
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :4] = 0
    other_ids = ids.clone()
    other_ids[1, :4] = (ids[1, :4] + 7) % 98
    first, second = (model(input_ids=x, attention_mask=attention_mask, labels=labels) for x in (ids, other_ids))
    torch.testing.assert_close(first.aux_loss, second.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(first.router_z_loss, second.router_z_loss, rtol=0, atol=1e-6)
    assert model(input_ids=other_ids, labels=labels).router_z_loss != second.router_z_loss
    assert not tiny_config().num_experts and "mlp.gate.weight" not in str(list(tiny_model().state_dict()))


def _import_generated_code(folder):
    """hf-dlm's generated remote-code files imported as a package of their own (they import no hf_dlm)."""
    import importlib
    import sys

    from hf_dlm.hub.remote_code import generate_remote_code

    package = folder / "generated_dlm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    files = generate_remote_code()
    assert "# ---- from hf_dlm/modeling/moe.py ----" in files["modeling_dlm.py"]  # the MoE block pasted in
    for name, source in files.items():
        (package / name).write_text(source)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("generated_dlm.modeling_dlm")
    finally:
        sys.path.remove(str(folder))


def test_save_load_round_trip_and_remote_code(tmp_path):
    model = tiny_model(**MOE, shared_expert_intermediate_size=24, router_z_loss_coef=0.001)
    randomize(model)
    model.save_pretrained(tmp_path / "saved")
    assert DLMConfig.from_pretrained(tmp_path / "saved").to_dict()["num_experts"] == 4
    ids = torch.randint(0, 98, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        loaded = DLMForDiffusionLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
        # same weights, but freshly allocated ones may take other CPU kernel paths (alignment): 1e-6, not bits
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-6, rtol=0)
        # the self-contained remote code carries the MoE block too
        generated = _import_generated_code(tmp_path)
        remote = generated.DLMForDiffusionLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
        assert type(remote.model.layers[0].mlp).__module__ == "generated_dlm.modeling_dlm"
        torch.testing.assert_close(remote(input_ids=ids).logits, expected, atol=1e-6, rtol=0)


def test_qwen3_moe_converts_both_ways_at_1e5(tmp_path):
    """transformers' tiny random Qwen3-MoE -> hf-dlm (causal, same logits) -> Qwen3-MoE (same logits again);
    one dense layer (mlp_only_layers) and renormalised top-k, so every path of the layout is exercised."""
    config = Qwen3MoeConfig(vocab_size=99, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    source = randomize(Qwen3MoeForCausalLM(config))
    source.save_pretrained(tmp_path / "qwen3_moe")
    assert any(".mlp.experts.3.up_proj.weight" in key for key in load_file(tmp_path / "qwen3_moe" / "model.safetensors"))
    dlm, *_ = load_as_dlm("qwen3_moe", tmp_path / "qwen3_moe", ConversionOptions(attention_mode="causal"))
    assert dlm.config.num_experts == 4 and dlm.config.norm_topk_prob and dlm.config.mlp_only_layers == [1]
    ids = torch.randint(0, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source(input_ids=ids).logits
        torch.testing.assert_close(dlm(input_ids=ids).logits[..., :99], expected, atol=1e-5, rtol=0)

    dlm.save_pretrained(tmp_path / "dlm")
    convert_checkpoint("dlm", tmp_path / "dlm", tmp_path / "back", to="qwen3_moe")
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits[..., :99], expected, atol=1e-5, rtol=0)
    with pytest.raises(NotImplementedError, match="MoE"):  # the dense Megatron map would drop the experts
        convert_checkpoint("dlm", tmp_path / "dlm", tmp_path / "megatron", to="megatron")


def test_trainer_averages_router_losses_over_accumulation_and_logs_them(tmp_path):
    """DLMTrainer, 2 accumulated micro-batches: the step's gradient is that of the CE (global normaliser) plus
    the mean of the micro-batches' router losses, and the log shows their unweighted losses."""
    import copy

    from tests.utils import RecordingTrainer, make_args, random_dataset

    model = tiny_model(**MOE, router_aux_loss_coef=0.5, router_z_loss_coef=0.1).train()
    initial = copy.deepcopy(model)
    trainer = RecordingTrainer(model=model, train_dataset=random_dataset(),
                               args=make_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                              max_steps=1, optim="sgd", max_grad_norm=0.0, random_length_prob=0.0))
    trainer.train()
    batches = trainer.batches[0]
    num_items = sum(b["_dlm_stats"]["items"] for b in batches).clamp(min=1)
    aux, z = [], []
    for batch in batches:
        out = initial(**{k: v for k, v in batch.items() if k != "_dlm_stats"}, num_items_in_batch=num_items)
        (out.loss - out.router_loss + out.router_loss / len(batches)).backward()
        aux.append(out.aux_loss.item())
        z.append(out.router_z_loss.item())
    for name, parameter in initial.named_parameters():
        torch.testing.assert_close(trainer.grads[0][name], parameter.grad, rtol=1e-5, atol=1e-7, msg=name)
    log = trainer.state.log_history[0]
    assert log["aux_loss"] == pytest.approx(sum(aux) / 2, rel=1e-5)
    assert log["router_z_loss"] == pytest.approx(sum(z) / 2, rel=1e-5)


def test_compiled_and_checkpointed_layers_give_the_same_loss_and_gradients():
    """parallelize_dlm's per-block compile and activation checkpointing around MoE layers: the router losses
    still reach the output (the blocks' attribute survives both) and nothing changes numerically."""
    from hf_dlm.parallel.parallelize import parallelize_dlm

    options = dict(MOE, router_z_loss_coef=0.01)
    ids = torch.randint(0, 98, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(9) % 2 == 0, ids, -100)
    reference = tiny_model("sdpa", **options).train()
    expected = reference(input_ids=ids, labels=labels)
    expected.loss.backward()
    model = parallelize_dlm(tiny_model("sdpa", **options).train(), compile=True, activation_checkpointing=True,
                            compile_options={"backend": "aot_eager"})
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.router_z_loss, expected.router_z_loss, rtol=0, atol=1e-6)
    for (name, parameter), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, ref.grad, rtol=0, atol=1e-6, msg=name)


def test_active_parameters_count_top_k_of_the_experts():
    from hf_dlm.modeling.moe import active_parameter_count

    model = tiny_model(**MOE, mlp_only_layers=[1])
    experts = 4 * (2 * 16 * 32 + 32 * 16)  # one MoE layer: gate_up (E, 2I, H) + down (E, H, I)
    total = sum(p.numel() for p in model.parameters())
    assert active_parameter_count(model) == total - experts // 2  # top-2 of 4: half of the experts idle
    assert active_parameter_count(tiny_model()) == sum(p.numel() for p in tiny_model().parameters())
