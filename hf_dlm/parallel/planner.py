"""Memory and communication planner: per-GPU memory and per-step communication of every layout
(dp_replicate x dp_shard x cp x tp, and ep for MoE models) for a model config, sequence length and
micro-batch, ranked. This is how to plan runs larger than the machines at hand (`hf-dlm plan`).

The memory model counts what hf-dlm's training step keeps, for the eager (uncompiled) step under bf16
autocast with fp32 master weights (the trainer's default) or FSDP2 bf16 parameters:
- static: fp32 parameters (4 B), fp32 gradients (4 B), AdamW moments (8 B) per parameter, sharded by
  tensor parallel (layer and vocabulary weights) and FSDP2 over dp_shard x cp; experts by dp_shard x cp;
  FSDP2 keeps two layers gathered (the current one and the prefetched one);
- autocast's bf16 weight copies (2 B per TP-local parameter): saved for backward by every linear;
- activations, per token and decoder layer, from the tensors the eager layer saves for backward
  (`layer_activation_bytes`): fp32 residual stream and norms, bf16 casts of each linear's input,
  the q/k norms in fp32, SDPA's q/k/v/output, the SwiGLU intermediates; divided by tp where
  sequence parallel or head sharding splits them, and by cp (the all-gathered K/V excepted);
  with activation checkpointing only each layer's input is kept, plus one layer recomputed in backward;
- the masked-only head's transient: one chunk of masked rows times the (TP-local) vocabulary, about 19
  bytes per logit in eager fp32 softmax work. By default the worst case (a full chunk: t near 1 masks
  every token); `masked_rows` gives the count of a known batch.
Pipeline layouts (pp x dp_shard, what DLMTrainer runs) take their stage terms from
`hf_dlm.parallel.pipeline.pipeline_schedule_terms`: the busiest rank holds `layers_per_rank` layers and
the activations of `in_flight_layers` layer-micro-batches (GPipe all m, 1F1B min(p, m)), plus the
embeddings and the head (an untied model's first and last stages; counted together as the bound); the
schedule's bubble is reported and ranks a pipeline after every layout that fits without one.
The peak is the larger of the end of the forward pass (activations complete, no gradients yet) and the
backward pass (gradients allocated, one layer's activations live).

Communication per optimizer step and GPU (ring algorithms, bytes sent): FSDP2 all-gathers (forward, and
backward again when resharded) and gradient reduce-scatter; HSDP's all-reduce; sequence-parallel
all-gathers and reduce-scatters (4 per layer, forward and backward); context parallel's K/V all-gather
(and its backward reduce); expert all-to-alls; pipeline sends (activations forward, their gradients
backward, at each stage boundary a rank owns). Times use `intra_node_gbps` for dimensions that fit in a
node (tp innermost, then cp, dp_shard, dp_replicate) and `inter_node_gbps` beyond.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

GIB = 1024**3


def _moe_fields(config) -> tuple[int, int, int, int]:
    """(experts, top_k, expert ffn, shared-expert ffn) from a config's MoE fields (0 experts: dense)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_top_k", None) or (2 if experts else 0)
    expert_ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    shared_experts = getattr(config, "num_shared_experts", 0) or getattr(config, "n_shared_experts", 0)
    if not shared and shared_experts:
        shared = shared_experts * expert_ffn
    return experts, top_k, expert_ffn, shared


@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        experts, top_k, expert_ffn, shared = _moe_fields(config)
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)), experts=experts, top_k=top_k,
                   expert_ffn=expert_ffn, shared_ffn=shared)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + 2 * self.head_dim

    def dense_mlp_params(self) -> int:
        if self.experts:
            return 3 * self.hidden * self.shared_ffn + self.hidden * self.experts  # shared expert + router
        return 3 * self.hidden * self.ffn

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ffn * self.experts if self.experts else 0

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def total_params(self) -> int:
        per_layer = self.attention_params() + self.dense_mlp_params() + self.expert_params() + 2 * self.hidden
        return self.layers * per_layer + self.embedding_params() + self.hidden

    def active_params(self) -> int:
        active_experts = 3 * self.hidden * self.expert_ffn * self.top_k if self.experts else 0
        per_layer = self.attention_params() + self.dense_mlp_params() + active_experts + 2 * self.hidden
        return self.layers * per_layer + self.embedding_params() + self.hidden

    def layer_activation_bytes(self, tp: int = 1, cp: int = 1) -> float:
        """Bytes saved for backward per token (of this rank's sequence) and layer, eager bf16 autocast."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        mlp_width = self.top_k * self.expert_ffn + self.shared_ffn if self.experts else self.ffn
        sequence_sharded = 16 * h / tp  # two RMSNorms in fp32: input and normalised copy (sequence parallel)
        replicated_inputs = 10 * h  # bf16 casts of the all-gathered inputs of q/k/v (3) and gate/up (2)
        # (RoPE keeps nothing per head: it multiplies by cos / sin, which need no gradient)
        heads = (6 * q + 6 * kv  # q/k norms: fp32 input, bf16 normalised copy
                 + 2 * q + 2 * kv + 2 * q  # SDPA's bf16 q and v (own chunk), output
                 + 2 * q) / tp  # o_proj's input
        kv_full = 2 * kv * cp / tp  # SDPA's bf16 keys: all-gathered over the CP ranks
        mlp = 8 * mlp_width / tp  # gate out, SiLU out, up out, product (bf16)
        if self.experts:
            mlp += 2 * h * self.top_k  # dispatched token copies (bf16)
        return sequence_sharded + replicated_inputs + heads + kv_full + mlp


@dataclass
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    pp: int = 1

    def name(self) -> str:
        parts = [f"{k}={v}" for k, v in asdict(self).items() if v > 1]
        return " ".join(parts) or "single GPU"


@dataclass
class MemoryPlan:
    layout: Layout
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    weight_copies_gib: float
    activations_gib: float
    transient_gib: float
    peak_gib: float
    communication_gib: float
    communication_ms: float
    tokens_per_step: int
    fits: bool
    bubble_fraction: float = 0.0

    @property
    def communication_ms_per_mtoken(self) -> float:
        """Communication time per million tokens of the whole job: comparable across layouts, which
        process different numbers of micro-batches per step (one per data-parallel rank)."""
        return self.communication_ms / (self.tokens_per_step / 1e6)


def plan_layout(shape: ModelShape, layout: Layout, seq_len: int, micro_batch: int, *,
                activation_checkpointing: bool = False, mixed_precision: str = "autocast",
                loss_chunk_size: int = 4096, masked_rows: int | None = None, gpu_memory_gib: float = 139.0, gpus_per_node: int = 8,
                intra_node_gbps: float = 400.0, inter_node_gbps: float = 50.0, pp_microbatches: int = 8,
                pp_schedule: str = "1f1b") -> MemoryPlan:
    """One layout's per-GPU memory (GiB) and per-step communication. mixed_precision: "autocast" (fp32
    weights, bf16 autocast) or "bf16_params" (FSDP2 all-gathers bf16 parameters: no autocast copies).
    With layout.pp > 1: `pp_microbatches` micro-batches of `micro_batch` rows per step, `pp_schedule`."""
    tp, cp, fsdp, rep, ep = layout.tp, layout.cp, layout.dp_shard * layout.cp, layout.dp_replicate, layout.ep
    h, L = shape.hidden, shape.layers
    stage = None
    if layout.pp > 1:
        from .pipeline import pipeline_schedule_terms

        stage = pipeline_schedule_terms(L, layout.pp, pp_microbatches, pp_schedule)
        L = stage["layers_per_rank"]  # the busiest rank's layers; activations below scale by in_flight_layers
    tp_local_layer = (shape.attention_params() + shape.dense_mlp_params()) / tp + 2 * h
    expert_local = shape.expert_params() / ep
    embed_local = shape.embedding_params() / tp
    local_params = L * (tp_local_layer + expert_local) + embed_local + h  # per rank before FSDP
    # experts: split over ep, FSDP-sharded over the rest of dp_shard x cp (efsdp): 1 / (dp_shard x cp) in all
    sharded = L * (tp_local_layer + shape.expert_params()) / fsdp + (embed_local + h) / fsdp
    params = 4 * sharded
    grads = 4 * sharded
    optimizer = 8 * sharded
    gathered_bytes = 2 if mixed_precision == "bf16_params" else 4
    gathered = 2 * (tp_local_layer + expert_local) * gathered_bytes if fsdp > 1 else 0
    if fsdp > 1:  # the root unit (embeddings, final norm, head) stays gathered after forward
        gathered += (embed_local + h) * gathered_bytes
    copies = 2 * local_params if mixed_precision == "autocast" else 0

    tokens = micro_batch * seq_len / cp  # this rank's tokens
    per_layer = shape.layer_activation_bytes(tp, cp) * tokens
    stored_inputs = 4 * h * tokens / tp  # each layer's fp32 input (sequence-sharded)
    head_rows = min(loss_chunk_size, tokens if masked_rows is None else masked_rows)
    head = head_rows * (shape.vocab / tp) * 19 + 2 * shape.vocab * h / tp + 8 * h * tokens * 2
    embed_and_final = 12 * h * tokens
    # with checkpointing only each layer's input stays, and backward recomputes one layer at a time
    in_flight = stage["in_flight_layers"] if stage else L
    activations = in_flight * (stored_inputs if activation_checkpointing else per_layer)
    static = params + optimizer + gathered
    forward_end = static + copies + activations + head + embed_and_final
    backward = static + grads + per_layer + copies / L + 2 * shape.vocab * h / tp
    if activation_checkpointing:
        backward += activations
    peak = max(forward_end, backward)

    # communication (bytes sent per GPU per optimizer step, one micro-batch)
    def ring(size: int) -> float:
        return (size - 1) / size if size > 1 else 0.0

    dense_weights, expert_weights = L * tp_local_layer + embed_local, L * expert_local
    volumes = {"tp": 0.0, "cp": 0.0, "fsdp": 0.0, "replicate": 0.0, "ep": 0.0, "pp": 0.0}
    per_weight = gathered_bytes * 2 + 4  # all-gather in forward and backward, fp32 reduce-scatter
    volumes["fsdp"] = per_weight * (dense_weights * ring(fsdp) + expert_weights * ring(fsdp // ep))
    volumes["replicate"] = 2 * 4 * (dense_weights + expert_weights * ep) / fsdp * ring(rep)
    recompute = 1.5 if activation_checkpointing else 1.0
    volumes["tp"] = L * 8 * tokens * h * 2 * ring(tp) * recompute + 2 * tokens * h * 4 * ring(tp)
    volumes["cp"] = L * 2 * (2 * tokens * cp * shape.kv_dim / tp * 2) * ring(cp) * recompute
    if shape.experts:
        volumes["ep"] = L * 4 * tokens * shape.top_k * h * 2 * ring(ep) * recompute
    if stage:  # bf16 activations out and their gradients back, at each of this rank's stage boundaries
        stages_per_rank = stage["num_stages"] // layout.pp
        volumes["pp"] = 2 * 2 * tokens * h * stages_per_rank
    inner = 1
    seconds = 0.0
    for name, size in (("tp", tp), ("cp", cp), ("ep", 1), ("fsdp", layout.dp_shard), ("replicate", rep),
                       ("pp", layout.pp)):
        inner *= size
        bandwidth = intra_node_gbps if inner <= gpus_per_node else inter_node_gbps
        seconds += volumes[name] / (bandwidth * 1e9)
    total = sum(volumes.values())
    return MemoryPlan(layout=layout, params_gib=params / GIB, grads_gib=grads / GIB, optimizer_gib=optimizer / GIB,
                      weight_copies_gib=copies / GIB, activations_gib=activations / GIB,
                      transient_gib=(head + gathered) / GIB, peak_gib=peak / GIB, communication_gib=total / GIB,
                      communication_ms=seconds * 1e3,
                      tokens_per_step=layout.dp_replicate * layout.dp_shard * micro_batch * seq_len,
                      fits=peak / GIB <= gpu_memory_gib, bubble_fraction=stage["bubble_fraction"] if stage else 0.0)


def candidate_layouts(shape: ModelShape, gpus: int, seq_len: int, max_tp: int = 8) -> list[Layout]:
    """Every dp_replicate x dp_shard x cp x tp factorisation of `gpus` the model admits (tp divides the
    heads and KV heads; cp divides the sequence), with ep (for MoE models) over dp_shard x cp."""
    layouts = []
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, cp, rep in itertools.product(divisors, divisors, divisors):
        if gpus % (tp * cp * rep) or tp > max_tp or shape.heads % tp or shape.kv_heads % tp or seq_len % cp:
            continue
        dp_shard = gpus // (tp * cp * rep)
        if rep > 1 and dp_shard == 1:
            continue  # pure replication: use dp_shard (FSDP2 ZeRO-3 costs the same traffic, less memory)
        eps = [1]
        if shape.experts:
            eps = [e for e in divisors if e > 1 and e % cp == 0 and dp_shard % (e // cp) == 0
                   and shape.experts % e == 0] or [1]
        layouts.extend(Layout(rep, dp_shard, cp, tp, ep) for ep in eps)
    # pipelines as DLMTrainer runs them: pp x dp_shard (FSDP2 inside each stage; MoE without expert parallelism)
    layouts.extend(Layout(1, gpus // pp, 1, 1, pp=pp) for pp in divisors if 1 < pp <= shape.layers)
    return layouts


def plan_layouts(config, gpus: int, seq_len: int, micro_batch: int, **options) -> list[MemoryPlan]:
    """All layouts for `gpus` GPUs, ranked: layouts that fit first, then by pipeline bubble (none outside
    pipelines), then by communication time per token (compute per token is the same in every layout), then
    peak memory."""
    shape = ModelShape.from_config(config)
    plans = [plan_layout(shape, layout, seq_len, micro_batch, **options)
             for layout in candidate_layouts(shape, gpus, seq_len)]
    return sorted(plans, key=lambda p: (not p.fits, p.bubble_fraction, p.communication_ms_per_mtoken, p.peak_gib))


def format_plans(plans: list[MemoryPlan], shape: ModelShape | None = None) -> str:
    header = (f"{'layout':<32} {'params':>7} {'grads':>7} {'optim':>7} {'copies':>7} {'activ':>7} {'transnt':>7} "
              f"{'peak':>7} {'comm':>8} {'comm ms':>8} {'ms/Mtok':>8} {'bubble':>6}  fits")
    lines = [header, "-" * len(header)]
    for p in plans:
        lines.append(f"{p.layout.name():<32} {p.params_gib:7.2f} {p.grads_gib:7.2f} {p.optimizer_gib:7.2f} "
                     f"{p.weight_copies_gib:7.2f} {p.activations_gib:7.2f} {p.transient_gib:7.2f} {p.peak_gib:7.2f} "
                     f"{p.communication_gib:8.2f} {p.communication_ms:8.1f} {p.communication_ms_per_mtoken:8.1f} "
                     f"{p.bubble_fraction:6.3f}  "
                     f"{'yes' if p.fits else 'no'}")
    return "\n".join(lines)
