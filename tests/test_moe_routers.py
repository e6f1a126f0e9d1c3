"""MoE routers against transcriptions of their published algorithms: expert choice (MegaDLMs'
`expert_choice_softmax_with_capacity` and `ec_load_balancing_loss_func`, written here in MegaDLMs' own
sequence-major token order), on hand-built cases, with padding, and the row independence of sequence level."""

import pytest
import torch
import torch.nn.functional as F

from hf_dlm.modeling.moe import DLMSparseMoeBlock, expert_capacity
from tests.utils import tiny_config, tiny_model

H = 32


def _swiglu(x, gate_up, down):
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def _randomized_block(**overrides):
    torch.manual_seed(0)
    options = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    block = DLMSparseMoeBlock(tiny_config(**{**options, **overrides}))
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.3)
    return block


def _mixture(block, x, gates):
    """sum_e gates[t, e] * expert_e(x_t) for every token: x (N, H), gates (N, E)."""
    experts = block.experts
    outputs = torch.stack([_swiglu(x, experts.gate_up_proj[e], experts.down_proj[e])
                           for e in range(block.num_experts)], dim=1)  # (N, E, H)
    return (gates[..., None] * outputs).sum(1)


def megadlms_expert_choice(logits, bsz, seq_length, topk, batch_level, pre_softmax):
    """MegaDLMs' expert choice, transcribed: logits (S * B, E) in Megatron's [seq, batch] order.
    -> gates (S * B, E), routing map (S * B, E), the expert-choice load-balancing loss."""
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32) if pre_softmax else logits
    if batch_level:
        topk_ec = max(num_tokens * topk // num_experts, 1)
        values, top_indices = torch.topk(scores, k=topk_ec, dim=0)
    else:
        topk_ec = max(seq_length * topk // num_experts, 1)
        values, local_seq = torch.topk(scores.view(seq_length, bsz, num_experts), k=topk_ec, dim=0)
        values = values.reshape(topk_ec * bsz, num_experts)
        top_indices = (local_seq * bsz + torch.arange(bsz).view(1, bsz, 1)).reshape(topk_ec * bsz, num_experts)
    routing_map = torch.zeros_like(logits).int().scatter(0, top_indices, 1).bool()
    if pre_softmax:
        gates = torch.zeros_like(logits).scatter(0, top_indices, values)
    else:
        selected = torch.zeros_like(logits).scatter(0, top_indices, values)
        selected[~routing_map] = -float("inf")
        gates = torch.softmax(selected, dim=-1, dtype=torch.float32)
        gates[torch.isnan(gates)] = 0.0
    experts_per_token = routing_map.sum(dim=1)
    over_tokens = torch.softmax(logits, dim=0, dtype=torch.float32)
    aux = torch.sum(over_tokens.sum(dim=1) * experts_per_token) / (num_experts * topk)
    return gates, routing_map, aux


@pytest.mark.parametrize("level", ["sequence", "batch"])
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_expert_choice_equals_the_megadlms_transcription(level, pre_softmax):
    block = _randomized_block(moe_router="expert_choice", expert_choice_level=level,
                              expert_choice_pre_softmax=pre_softmax)
    batch, length = 3, 10
    x = torch.randn(batch, length, H)
    output = block(x)
    balance, z_loss = block.router_losses

    # the transcription runs in Megatron's [seq, batch] order; map its per-token results back
    seq_major = x.transpose(0, 1).reshape(-1, H)
    logits = seq_major @ block.gate.weight.T
    gates, routing_map, aux = megadlms_expert_choice(logits, batch, length, 2, level == "batch", pre_softmax)
    expected = _mixture(block, seq_major, gates).reshape(length, batch, H).transpose(0, 1)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(balance, aux, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(z_loss, torch.logsumexp(logits, -1).square().mean())
    capacity = (length if level == "sequence" else batch * length) * 2 // 4
    assert routing_map.sum(0).tolist() == [capacity * (batch if level == "sequence" else 1)] * 4
    # the test has teeth: some tokens got fewer experts than k, some more
    per_token = routing_map.sum(1)
    assert per_token.min() < 2 < per_token.max()


def test_expert_choice_on_a_hand_built_case():
    """4 tokens, 2 experts of width 1 on hidden 2, k = 1: capacity 4 * 1 // 2 = 2 per expert. Router logits
    (a, b) = (x_0, x_1): expert 0 takes the two tokens of largest x_0, expert 1 those of largest x_1; a token
    chosen by both experts gets softmax((a, b)) weights, a token chosen by one gets weight 1 there."""
    config = tiny_config(hidden_size=2, num_attention_heads=1, num_key_value_heads=1, num_experts=2,
                         num_experts_per_tok=1, moe_intermediate_size=1, moe_router="expert_choice",
                         expert_choice_level="batch")
    block = DLMSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(2))
        block.experts.gate_up_proj.copy_(torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]))
        block.experts.down_proj.copy_(torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]]))
    x = torch.tensor([[[3.0, 2.0], [2.0, -1.0], [-1.0, 1.0], [0.0, -2.0]]])
    # expert 0 (x_0 ranking): tokens 0, 1; expert 1 (x_1 ranking): tokens 0, 2; token 3: none
    e = lambda v: v * F.silu(torch.tensor(v))  # noqa: E731  expert output on its own coordinate
    both = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    expected = torch.tensor([[[both[0] * e(3.0), both[1] * e(2.0)], [e(2.0), 0.0], [0.0, e(1.0)], [0.0, 0.0]]])
    torch.testing.assert_close(block(x), expected, atol=1e-6, rtol=0)
    assert expert_capacity(4, 2, 1, 1.0) == 2 and expert_capacity(4, 2, 1, 1.5) == 3
    assert expert_capacity(3, 8, 2, 1.0) == 1 and expert_capacity(4, 2, 2, 4.0) == 4  # at least 1, at most all


def test_expert_choice_capacity_factor_and_pre_softmax_weights():
    """Capacity factor 2 doubles every expert's picks; pre-softmax weights are the token's softmax probabilities."""
    block = _randomized_block(moe_router="expert_choice", expert_capacity_factor=2.0, expert_choice_pre_softmax=True)
    x = torch.randn(2, 8, H)
    block(x)
    logits = x.reshape(-1, H) @ block.gate.weight.T
    probabilities = logits.softmax(-1).view(2, 8, 4)
    capacity = 8  # floor(2.0 * 8 * 2 / 4), clipped to the row's 8 tokens: every expert takes every token
    assert expert_capacity(8, 4, 2, 2.0) == capacity
    expected = _mixture(block, x.reshape(-1, H), probabilities.reshape(-1, 4)).view(2, 8, H)
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("level,capacity_factor", [("sequence", 1.0), ("batch", 1.0), ("sequence", 2.0)])
def test_expert_choice_padding_is_never_chosen_before_real_tokens(level, capacity_factor):
    """Padded positions rank below every real token and get no routed output, so the real tokens' outputs do
    not depend on what the padding holds (capacity factor 2: the experts' capacity exceeds the real tokens of
    the padded row, so padding is picked, with zero weight)."""
    block = _randomized_block(moe_router="expert_choice", expert_choice_level=level,
                              expert_capacity_factor=capacity_factor)
    x = torch.randn(2, 6, H)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    block.token_mask = mask
    first = block(x)
    first_losses = block.router_losses
    other = x.clone()
    other[0, :2] = 10 * torch.randn(2, H)  # large router logits: chosen first, were padding not excluded
    second = block(other)
    torch.testing.assert_close(second[mask.bool()], first[mask.bool()], atol=1e-6, rtol=0)
    assert second[0, :2].abs().max() == 0  # no routed output, no shared expert here
    for a, b in zip(first_losses, block.router_losses):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    block.token_mask = None
    if capacity_factor == 1.0:  # without the mask the large padding would take the real tokens' places
        assert not torch.allclose(block(other)[mask.bool()], first[mask.bool()], atol=1e-3)


def test_sequence_level_keeps_rows_independent_and_batch_level_does_not():
    x = torch.randn(2, 8, H)
    other = x.clone()
    other[1] = torch.randn(8, H)
    sequence = _randomized_block(moe_router="expert_choice", expert_choice_level="sequence")
    torch.testing.assert_close(sequence(other)[0], sequence(x)[0], atol=1e-6, rtol=0)
    batch = _randomized_block(moe_router="expert_choice", expert_choice_level="batch")
    assert not torch.allclose(batch(other)[0], batch(x)[0], atol=1e-4)


def test_expert_choice_model_trains_and_round_trips(tmp_path):
    """A tiny expert-choice DLM: the loss includes the weighted expert-choice balance loss, a few SGD steps lower
    it, and save / load keeps the router settings and the logits."""
    from hf_dlm import DLMConfig, DLMForDiffusionLM

    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_router="expert_choice",
                       expert_choice_level="batch", expert_capacity_factor=1.5, router_aux_loss_coef=0.1).train()
    ids = torch.randint(0, 98, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(12) % 2 == 0, ids, -100)
    inputs = torch.where(labels != -100, 98, ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        out = model(input_ids=inputs, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    assert out.aux_loss is not None and model.model.layers[0].mlp.gate.weight.grad is None
    model.save_pretrained(tmp_path)
    config = DLMConfig.from_pretrained(tmp_path)
    assert (config.moe_router, config.expert_choice_level, config.expert_capacity_factor) == ("expert_choice", "batch", 1.5)
    loaded = DLMForDiffusionLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=inputs).logits, model.eval()(input_ids=inputs).logits,
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("field,value", [("moe_router", "topk"), ("expert_choice_level", "token"),
                                         ("expert_capacity_factor", 0.0)])
def test_bad_router_settings_name_their_field(field, value):
    from hf_dlm.utils.errors import FieldError

    with pytest.raises(Exception, match=f"DLMConfig.{field}") as error:  # strict wraps the FieldError
        tiny_config(num_experts=4, **{field: value})
    cause = error.value if isinstance(error.value, FieldError) else error.value.__cause__
    assert isinstance(cause, FieldError) and cause.field == field and cause.value == value


# ---- sigmoid router (DeepSeek-V3 / LLaDA2), LLaDA-MoE's biased softmax, the aux-loss-free bias update ----

SIGMOID = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, moe_router="sigmoid", n_group=4,
               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, moe_router_enable_expert_bias=True)


def _sorted_by_expert(weights, experts):
    """(weights, experts) of each token in expert order, to compare routers whose top-k order differs."""
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order), experts


def test_sigmoid_router_equals_transformers_deepseek_v3_router():
    """LLaDA2's gate has DeepSeek-V3's math (sigmoid, expert bias for the choice, group-limited top-k by the sum
    of each group's two best scores, renormalised weights times the scaling factor): transformers' own router
    on the same weights and inputs gives the same choice and weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    block = _randomized_block(**SIGMOID)
    with torch.no_grad():
        block.expert_bias.copy_(torch.randn(8) * 0.3)
    reference = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True))
    with torch.no_grad():
        reference.weight.copy_(block.gate.weight)
        reference.e_score_correction_bias.copy_(block.expert_bias)
    x = torch.randn(64, H)
    logits, weights, experts = block.route(x)
    ref_logits, ref_weights, ref_experts = reference(x)
    torch.testing.assert_close(logits, ref_logits)
    weights, experts = _sorted_by_expert(weights, experts)
    ref_weights, ref_experts = _sorted_by_expert(ref_weights, ref_experts)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    # teeth: the bias and the group limit both change some tokens' experts
    with torch.no_grad():
        block.expert_bias.zero_()
    assert not torch.equal(_sorted_by_expert(*block.route(x)[1:])[1], experts)
    block.n_group = 1
    assert not torch.equal(_sorted_by_expert(*block.route(x)[1:])[1], ref_experts)


def test_group_limited_sigmoid_routing_on_a_hand_built_case():
    """4 experts in 2 groups, top-1 group, k = 1. Scores (0.6, 0.55 | 0.9, 0.1): group scores 1.15 and 1.0, so
    expert 0 wins although expert 2 scores best; its weight is its own score (k = 1, no renormalisation) times
    the scaling factor 2. With an expert bias of +0.5 on expert 3 group 2 wins (1.0 + 0.5) and expert 2 is
    chosen, weighted by its unbiased score 0.9."""
    config = tiny_config(hidden_size=4, num_attention_heads=1, num_key_value_heads=1, num_experts=4,
                         num_experts_per_tok=1, moe_intermediate_size=4, moe_router="sigmoid", n_group=2,
                         topk_group=1, routed_scaling_factor=2.0, moe_router_enable_expert_bias=True)
    block = DLMSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(4))
    scores = torch.tensor([[0.6, 0.55, 0.9, 0.1]])
    x = torch.log(scores / (1 - scores))  # logits whose sigmoid are the scores
    _, weights, experts = block.route(x)
    assert experts.tolist() == [[0]]
    torch.testing.assert_close(weights, torch.tensor([[1.2]]))
    with torch.no_grad():
        block.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.5]))
    _, weights, experts = block.route(x)
    assert experts.tolist() == [[2]]
    torch.testing.assert_close(weights, torch.tensor([[1.8]]))


def _llada_moe_reference(block, x):
    """LLaDA-MoE's published block, transcribed: softmax in fp32 whatever its score-function field says, the
    expert bias added to the probabilities, top-k of those, used unnormalised as weights."""
    probabilities = torch.softmax(x @ block.gate.weight.T, dim=-1, dtype=torch.float32) + block.expert_bias
    weights, experts = probabilities.topk(block.top_k, dim=-1)
    gates = torch.zeros_like(probabilities).scatter(1, experts, weights)
    return _mixture(block, x, gates), experts


def test_softmax_router_with_expert_bias_equals_llada_moe():
    block = _randomized_block(num_experts=8, num_experts_per_tok=2, moe_router_enable_expert_bias=True)
    with torch.no_grad():
        block.expert_bias.copy_(torch.linspace(-0.2, 0.3, 8))
    x = torch.randn(2, 16, H)
    expected, experts = _llada_moe_reference(block, x.reshape(-1, H))
    torch.testing.assert_close(block(x), expected.view(2, 16, H), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        block.expert_bias.zero_()
    assert not torch.equal(_llada_moe_reference(block, x.reshape(-1, H))[1], experts)  # the bias mattered


def test_expert_bias_update_on_a_hand_computed_case():
    """Loads (5, 1, 3, 3): mean 3, so the bias moves by rate * sign(3 - load) = (-r, +r, 0, 0); the counts clear."""
    from hf_dlm.modeling.moe import update_expert_bias

    block = _randomized_block(num_experts=4, moe_router="sigmoid", moe_router_enable_expert_bias=True,
                              moe_router_bias_update_rate=0.1)
    with torch.no_grad():
        block.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.25, 1.0]))
    block.tokens_per_expert.copy_(torch.tensor([5, 1, 3, 3]))
    update_expert_bias(block)
    torch.testing.assert_close(block.expert_bias, torch.tensor([0.4, 0.1, -0.25, 1.0]))
    assert block.tokens_per_expert.tolist() == [0, 0, 0, 0]


def test_training_forward_counts_real_tokens_per_expert():
    block = _randomized_block(num_experts=4, moe_router="sigmoid", moe_router_enable_expert_bias=True,
                              moe_router_bias_update_rate=0.1)
    x = torch.randn(2, 6, H)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    block.token_mask = mask
    block.eval()(x)
    assert block.tokens_per_expert.sum() == 0  # evaluation does not count
    block.train()(x)
    block(x)
    experts = block.route(x.reshape(-1, H))[2][mask.reshape(-1).bool()]
    expected = torch.stack([(experts == e).sum() for e in range(4)])
    assert block.tokens_per_expert.tolist() == (2 * expected).tolist()  # two forwards, real tokens only


def test_expert_bias_stays_fp32_through_dtype_casts_and_loading(tmp_path):
    """bf16 holds 0.75 + 1e-3 as 0.75: the bias must survive `.to(torch.bfloat16)` and a bf16 load."""
    from hf_dlm import DLMForDiffusionLM

    model = tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_router="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3)
    bias = torch.tensor([0.75, -0.5, 0.25, 1.0]) + 1e-3
    with torch.no_grad():
        model.model.layers[0].mlp.expert_bias.copy_(bias)
    model.save_pretrained(tmp_path)
    model.to(torch.bfloat16)
    assert model.model.layers[0].mlp.expert_bias.dtype == torch.float32
    assert torch.equal(model.model.layers[0].mlp.expert_bias, bias)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    loaded = DLMForDiffusionLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.layers[0].mlp.expert_bias, bias)
    assert loaded.model.layers[1].mlp.tokens_per_expert.tolist() == [0, 0, 0, 0]
    # a checkpoint without the bias (a router that had none) loads with a zero bias
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith("expert_bias")}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = DLMForDiffusionLM.from_pretrained(tmp_path)
    assert loaded.model.layers[0].mlp.expert_bias.tolist() == [0.0] * 4


def test_dlm_trainer_updates_the_expert_bias_once_per_optimizer_step(tmp_path):
    """DLMTrainer, 2 optimizer steps of 2 accumulated micro-batches (learning rate 0, so the routing of a replay
    is the trainer's): the bias equals a replay that counts each step's micro-batches and then updates once."""
    import copy

    from hf_dlm.modeling.moe import update_expert_bias
    from tests.utils import RecordingTrainer, make_args, random_dataset

    rate = 0.01
    model = tiny_model(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, moe_router="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate).train()
    replay = copy.deepcopy(model)
    trainer = RecordingTrainer(model=model, train_dataset=random_dataset(),
                               args=make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                              max_steps=2, learning_rate=0.0, warmup_steps=0))
    trainer.train()
    with torch.no_grad():
        for micro_batches in trainer.batches:
            for batch in micro_batches:
                replay(**{k: v for k, v in batch.items() if k != "_dlm_stats"})
            update_expert_bias(replay)
    for layer, expected in zip(model.model.layers, replay.model.layers):
        torch.testing.assert_close(layer.mlp.expert_bias, expected.mlp.expert_bias, atol=0, rtol=0)
        assert layer.mlp.tokens_per_expert.sum() == 0
    assert abs(model.model.layers[0].mlp.expert_bias.abs().max().item() - 2 * rate) < 1e-6  # both steps moved it


# ---- shared experts, dense first layers ----

def test_llada2_style_block_equals_transformers_deepseek_v3_moe():
    """Sigmoid router with expert bias and group limit, routed experts, and `n_shared_experts` ungated shared
    experts of width n * moe_intermediate_size: transformers' DeepseekV3MoE on the same weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from hf_dlm.modeling.modeling_dlm import DLMDecoderLayer

    config = tiny_config(**SIGMOID, n_shared_experts=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    block = DLMDecoderLayer(config, 0).mlp
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.3)
        block.expert_bias.normal_(0, 0.3)
    assert block.shared_experts.down_proj.in_features == 2 * 16 and block.shared_expert is None
    reference_config = DeepseekV3Config(hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                        moe_intermediate_size=16, n_shared_experts=2, hidden_act="silu")
    reference = DeepseekV3MoE(reference_config)
    with torch.no_grad():
        reference.gate.weight.copy_(block.gate.weight)
        reference.gate.e_score_correction_bias.copy_(block.expert_bias)
        reference.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        reference.experts.down_proj.copy_(block.experts.down_proj)
        reference.shared_experts.load_state_dict(block.shared_experts.state_dict())
    x = torch.randn(2, 12, H)
    torch.testing.assert_close(block(x), reference(x), atol=1e-5, rtol=1e-5)


def test_dense_first_layers_and_shared_experts_in_a_model():
    """LLaDA2's layout (first_k_dense_replace=1 -> mlp_only_layers=[0], ungated shared experts, sigmoid router):
    layer 0 is a dense MLP of intermediate_size, layer 1 MoE; a few SGD steps lower the loss; the active
    parameters count the shared experts whole."""
    from hf_dlm.modeling.modeling_dlm import DLMMLP
    from hf_dlm.modeling.moe import active_parameter_count

    model = tiny_model(**SIGMOID, n_shared_experts=1, mlp_only_layers=[0], moe_router_bias_update_rate=0.01).train()
    dense, moe = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert isinstance(dense, DLMMLP) and dense.up_proj.out_features == 64
    assert isinstance(moe, DLMSparseMoeBlock) and moe.shared_experts.up_proj.out_features == 16
    experts = moe.experts.gate_up_proj.numel() + moe.experts.down_proj.numel()
    assert active_parameter_count(model) == sum(p.numel() for p in model.parameters()) - experts * 5 // 8
    ids = torch.randint(0, 98, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(12) % 2 == 0, ids, -100)
    inputs = torch.where(labels != -100, 98, ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert moe.tokens_per_expert.sum() == 4 * 24 * 3  # 4 forwards x 24 tokens x k


def test_two_kinds_of_shared_expert_are_refused():
    with pytest.raises(Exception, match="n_shared_experts"):
        tiny_config(num_experts=4, n_shared_experts=1, shared_expert_intermediate_size=8)
