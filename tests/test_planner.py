"""The memory planner: parameter counts against real models, the activation count against the tensors
autograd really saves, the H200 peaks it was checked against, layouts and `hf-dlm plan`."""

import json
import math

import pytest
import torch

from hf_dlm import DLMConfig, DLMForDiffusionLM
from hf_dlm.cli import main
from hf_dlm.parallel.planner import Layout, ModelShape, candidate_layouts, plan_layout, plan_layouts
from tests.utils import tiny_model

QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  mask_token_id=151935, qk_norm=True)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_the_model(tied):
    model = tiny_model(tie_word_embeddings=tied)
    assert ModelShape.from_config(model.config).total_params() == sum(p.numel() for p in model.parameters())
    # hand count, untied tiny model: layer = q,o 2*32*32 + k,v 2*32*16 + q/k norms 2*8 + MLP 3*32*64 + norms 2*32
    assert ModelShape.from_config(tiny_model().config).total_params() == 2 * 9296 + 2 * 99 * 32 + 32


def test_qwen3_shape_parameter_count():
    with torch.device("meta"):
        model = DLMForDiffusionLM(DLMConfig(**QWEN3_1_7B))
    assert ModelShape.from_config(model.config).total_params() == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(model.config).total_params() == 1_720_574_976


def test_activation_bytes_match_the_tensors_autograd_saves():
    """One eager decoder layer under bf16 autocast with fp32 weights (the trainer's default): the bytes of every
    distinct tensor saved for backward, per token, against the planner's count (RoPE's cos / sin are shared
    by all layers and computed outside)."""
    model = tiny_model("sdpa", hidden_size=64, intermediate_size=192).train()
    batch, length = 2, 256
    hidden_states = torch.randn(batch, length, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        position_embeddings = model.model.rotary_emb(hidden_states, torch.arange(length).expand(batch, -1))
    saved = {}

    def pack(tensor):
        if tensor.numel() > length:  # per-token tensors (not weights' scalars, not RMSNorm's (B, L, 1) rsqrt)
            if not any(tensor.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                       for p in (*model.parameters(), *position_embeddings)):
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.model.layers[0](hidden_states, attention_mask=None, position_embeddings=position_embeddings)
    measured = sum(saved.values()) / (batch * length)
    predicted = ModelShape.from_config(model.config).layer_activation_bytes()
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


@pytest.mark.parametrize("checkpointing, measured_gib", [(False, 90.39), (True, 36.95)])
def test_prediction_within_ten_percent_of_the_h200_peak(checkpointing, measured_gib):
    """benchmarks/parallel_memory_cp.py on one H200 (benchmarks/RESULTS.md): Qwen3-1.7B shape, seq 4096,
    micro-batch 4, bf16 autocast, fused AdamW, eager; torch.cuda.max_memory_allocated of the second step."""
    shape = ModelShape.from_config(DLMConfig(**QWEN3_1_7B))
    predicted = plan_layout(shape, Layout(1, 1, 1, 1), 4096, 4, activation_checkpointing=checkpointing).peak_gib
    assert abs(predicted - measured_gib) / measured_gib < 0.10


def test_sharding_divides_static_memory():
    shape = ModelShape.from_config(tiny_model().config)
    single = plan_layout(shape, Layout(1, 1, 1, 1), 64, 2)
    assert single.params_gib * 1024**3 == pytest.approx(4 * shape.total_params())
    assert single.optimizer_gib == pytest.approx(2 * single.params_gib)
    sharded = plan_layout(shape, Layout(1, 2, 1, 2), 64, 2)  # FSDP2 x TP
    # by hand: a layer's linears (3088 + 6144) / tp + its two norms (64, FSDP-sharded only); embeddings and
    # head (2 * 99 * 32) / tp and the final norm (32); all of it over FSDP's 2 ranks
    layer = (3088 + 6144) / 2 + 64
    assert sharded.params_gib * 1024**3 == pytest.approx(4 * (2 * layer + 2 * 99 * 32 / 2 + 32) / 2)
    cp = plan_layout(shape, Layout(1, 1, 2, 1), 64, 2)
    assert cp.activations_gib < single.activations_gib and cp.communication_gib > 0


def test_moe_fields_are_counted():
    config = tiny_model().config
    config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 8, 2, 16
    shape = ModelShape.from_config(config)
    dense = ModelShape.from_config(tiny_model().config)
    per_layer_mlp = 8 * 3 * 32 * 16 + 32 * 8  # experts + router
    assert shape.total_params() == dense.total_params() + 2 * (per_layer_mlp - 3 * 32 * 64)
    assert shape.active_params() == dense.total_params() + 2 * (2 * 3 * 32 * 16 + 32 * 8 - 3 * 32 * 64)
    layouts = candidate_layouts(shape, 4, 64)
    assert any(layout.ep == 4 for layout in layouts) and all(layout.ep > 1 for layout in layouts if layout.dp_shard == 4)
    assert {(l.pp, l.dp_shard, l.ep) for l in layouts if l.pp > 1} == {(2, 2, 1)}  # 2 layers: pp 4 has no layout
    ep = plan_layout(shape, Layout(1, 4, 1, 1, ep=4), 64, 2)
    no_ep = plan_layout(shape, Layout(1, 4, 1, 1, ep=1), 64, 2)
    assert ep.params_gib == pytest.approx(no_ep.params_gib)  # experts sharded over ep x efsdp = dp_shard
    assert ep.transient_gib < no_ep.transient_gib  # a layer gathers a quarter of the experts


def test_layouts_cover_the_factorisations_and_rank_fitting_first():
    shape = ModelShape.from_config(DLMConfig(**QWEN3_1_7B))
    layouts = candidate_layouts(shape, 8, 4096)
    assert {layout.tp for layout in layouts} == {1, 2, 4, 8}
    assert all(l.dp_replicate * l.dp_shard * l.cp * l.tp * l.pp == 8 for l in layouts)
    assert {l.pp for l in layouts} == {1, 2, 4, 8}
    plans = plan_layouts(DLMConfig(**QWEN3_1_7B), 8, 4096, 16, gpu_memory_gib=80)
    fits = [plan.fits for plan in plans]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    ranked = [(plan.bubble_fraction, plan.communication_ms_per_mtoken) for plan in plans if plan.fits]
    assert ranked == sorted(ranked)


def test_plan_command(capsys):
    assert main(["plan", "examples/configs/qwen3_1.7b_shape.yaml", "--gpus", "8", "--json", "--top", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(math.prod(r["layout"].values()) / r["layout"]["ep"] == 8 for r in rows)
    assert main(["plan", "examples/configs/qwen3_1.7b_shape.yaml", "--gpus", "2", "--micro-batch", "64"]) == 0
    assert "no layout fits" in capsys.readouterr().out


@pytest.mark.parametrize("schedule, in_flight_microbatches", [("1f1b", 2), ("gpipe", 8)])
def test_pipeline_layout_by_hand(schedule, in_flight_microbatches):
    """pp=2 of a 28-layer model, 8 micro-batches: the busiest rank holds 14 layers' state (plus embeddings
    and head), the activations of min(p, m) = 2 (1F1B) or all m = 8 (GPipe) micro-batches of its 14 layers,
    and the bubble is (p - 1) / (m + p - 1) = 1/9."""
    shape = ModelShape.from_config(DLMConfig(**QWEN3_1_7B))
    plan = plan_layout(shape, Layout(1, 1, 1, 1, pp=2), 4096, 1, pp_microbatches=8, pp_schedule=schedule)
    layer = shape.attention_params() + shape.dense_mlp_params() + 2 * shape.hidden
    assert plan.params_gib * 1024**3 == pytest.approx(4 * (14 * layer + shape.embedding_params() + shape.hidden))
    per_layer = shape.layer_activation_bytes(1, 1) * 4096
    assert plan.activations_gib * 1024**3 == pytest.approx(in_flight_microbatches * 14 * per_layer)
    assert plan.bubble_fraction == pytest.approx(1 / 9)
    # ranked after every layout that fits without a pipeline
    plans = plan_layouts(DLMConfig(**QWEN3_1_7B), 4, 4096, 1)
    pipelines = [i for i, p in enumerate(plans) if p.layout.pp > 1]
    assert pipelines and min(pipelines) > max(i for i, p in enumerate(plans) if p.layout.pp == 1 and p.fits)
