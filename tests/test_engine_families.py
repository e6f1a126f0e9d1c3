"""The serving engine serves every model family hf-dlm loads natively, and the native DLM's attention modes and
MoE routers: 6 requests arriving two per step go through the engine with the family's published generation
defaults (LLaDA's blocks of 32 at one token per step, Dream's logit shift and entropy order with top-p sampling,
block diffusion with threshold commits for LLaDA2 / SDAR, Fast-dLLM v2's shifted blocks with the prefix cache),
exactly one model forward per engine step, and every request's tokens equal `model.generate` on it alone (fp32).

Expert-choice MoE mixes tokens outside attention (each expert takes the top tokens of a sequence): the packed
engine forward routes each row within itself (`RaggedKV.token_groups`), as generate does for a row alone."""

import pytest
import torch

from hf_dlm.modeling.families import FAMILIES
from hf_dlm.modeling.moe import expert_choice_routing
from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

from tests.utils import FAMILY_NAMES, counting, tiny_family, tiny_model


def serve_and_compare(model, options: dict, rows: int = 6, max_batch_size: int = 4, idle_steps: bool = False,
                      compile=None):
    """Requests arriving two per step (4 run at once, the rest wait) -> (forwards per busy step, engine stats);
    asserts each request's tokens equal generate alone (seeded). `idle_steps`: a step where every row's budget
    is 0 (Dream's schedule floors early steps' counts to 0) passes without a forward, as in generate."""
    engine = ContinuousBatchingEngine(model, max_batch_size=max_batch_size, compile=compile)
    generator = torch.Generator().manual_seed(0)
    cases = []
    for seed in range(rows):
        ids = torch.randint(0, 90, (3 + seed,), generator=generator).tolist()
        cases.append((ids, seed, GenerationRequest(ids, engine.sampling_params(seed=seed, **options))))
    calls, pending, forwards = counting(model), [case[-1] for case in cases], []
    while pending or engine.has_work():
        engine.submit(pending[:2])
        pending = pending[2:]
        before, busy = len(calls), bool(engine.running or engine.waiting)
        engine.step()
        if busy:
            forwards.append(len(calls) - before)
    for ids, seed, request in cases:
        assert request.error is None, request.error
        alone = model.generate(torch.tensor([ids]), generator=torch.Generator().manual_seed(seed), **options)
        assert request.generated == alone[0, len(ids):].tolist(), (seed, options)
    allowed = {0, 1} if idle_steps else {1}
    assert set(forwards) <= allowed and 1 in forwards, forwards  # exactly ONE forward per engine step
    return engine


def test_every_family_is_covered():
    assert set(FAMILY_NAMES) == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_engine_serves_the_family_with_its_published_defaults_as_generate_alone(name):
    model = tiny_family(name)
    defaults = model.generation_config
    block = defaults.block_length or 16  # Dream: one block over the answer
    new_tokens = 2 * block if defaults.block_length else block
    # the published ratio of steps to tokens (LLaDA, Dream: one token per step); threshold rules decide their own;
    # aligned blocks (the prompt's partial block first) take the default, block_length steps per block
    options = dict(max_new_tokens=new_tokens, stop_on_eos=False)
    if not defaults.align_blocks:
        options["steps"] = new_tokens
    engine = serve_and_compare(model, options, idle_steps=defaults.schedule == "dream")
    params = engine.sampling_params(**options)
    assert (params.block_length, params.threshold, params.remasking) == (
        block if defaults.block_length else new_tokens, defaults.threshold, defaults.remasking)
    assert engine.stats["max_forward_rows"] == 4  # rows in different phases shared forwards
    if defaults.threshold is not None:  # block diffusion commits several tokens per forward on some steps
        assert engine.stats["forward_passes"] < 6 * new_tokens


NATIVE = {
    "causal": dict(attention_mode="causal"),
    "block": dict(attention_mode="block", block_size=4, label_alignment="shift"),
    "expert_choice_sequence": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   moe_router="expert_choice"),
    "expert_choice_batch": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                moe_router="expert_choice", expert_choice_level="batch", expert_capacity_factor=1.5),
    "sigmoid_grouped": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_router="sigmoid",
                            n_group=2, topk_group=1, n_shared_experts=1),
}


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("variant", list(NATIVE))
def test_engine_serves_the_native_dlm_attention_modes_and_routers_as_generate_alone(variant, cache):
    model = tiny_model("eager", **NATIVE[variant])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.3)
    serve_and_compare(model, dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.5, cache=cache,
                                  stop_on_eos=False))


def test_the_compiled_engine_routes_expert_choice_within_each_row():
    # the compiled layer step takes the rows' token groups from outside (computed once a step), so expert choice
    # still picks within each row, as generate alone does; the tokens say so
    model = tiny_model("eager", **NATIVE["expert_choice_sequence"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.3)
    serve_and_compare(model, dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.5, cache="dual",
                                  stop_on_eos=False), compile="eager")


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_ragged_expert_choice_routes_each_group_as_if_alone(pre_softmax):
    """Groups of 5, 2 and 7 packed tokens (+ 2 padding tokens, a padded column layout) give each group the
    tokens, weights and choices of `expert_choice_routing` on that group alone."""
    torch.manual_seed(0)
    lengths, experts, k, factor = [5, 2, 7], 4, 2, 1.5
    logits = torch.randn(sum(lengths) + 2, experts)
    width, offsets = max(lengths), [0, 5, 7]
    index = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for g, (offset, length) in enumerate(zip(offsets, lengths)):
        index[g, :length], valid[g, :length] = torch.arange(offset, offset + length), True
    tokens, weights, chosen = expert_choice_routing(logits, 1, k, factor, pre_softmax, groups=(index, valid))
    combined = torch.zeros(logits.shape[0], experts).index_put_((tokens, torch.arange(experts).view(-1, 1).expand_as(tokens)),
                                                                 weights, accumulate=True)
    for offset, length in zip(offsets, lengths):
        alone_tokens, alone_weights, alone_chosen = expert_choice_routing(logits[offset : offset + length], 1, k,
                                                                          factor, pre_softmax)
        expected = torch.zeros(length, experts).index_put_(
            (alone_tokens, torch.arange(experts).view(-1, 1).expand_as(alone_tokens)), alone_weights, accumulate=True)
        torch.testing.assert_close(combined[offset : offset + length], expected, rtol=0, atol=0)
        assert torch.equal(chosen[offset : offset + length], alone_chosen)
    assert not chosen[-2:].any() and not combined[-2:].any()  # padding tokens belong to no group
