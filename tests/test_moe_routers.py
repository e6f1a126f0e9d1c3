"""MoE routers against transcriptions of their published algorithms: expert choice (MegaDLMs'
`expert_choice_softmax_with_capacity` and `ec_load_balancing_loss_func`, written here in MegaDLMs' own
sequence-major token order), on hand-built cases, with padding, and the row independence of sequence level."""

import pytest
import torch
import torch.nn.functional as F

from hf_dlm.modeling.moe import DLMSparseMoeBlock, expert_capacity
from .conftest import tiny_config, tiny_model

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
