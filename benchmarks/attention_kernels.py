"""Attention kernels on one GPU: packed-document attention (forward + backward) through each kernel
hf-dlm can use, checked against a float32 reference and timed; and FlashAttention-4 beside cuDNN SDPA.

Packed documents (B rows of L tokens, documents of ~650 tokens, bidirectional inside each document):
- `dense mask`: SDPA with a (B, 1, L, L) boolean mask (what hf-dlm ran before on CUDA);
- `flex`: FlexAttention (compiled) with hf-dlm's `BlockMask` (`masks.block_mask_from_mod`), the default now;
- `varlen`: `torch.nn.attention.varlen.varlen_attn` over the documents as one flattened batch;
- `fa4 varlen`: FlashAttention-4's `flash_attn_varlen_func`, if `flash_attn.cute` imports.
Each output and gradient (dq, dk, dv) is compared with SDPA's math kernel on float32 copies of the inputs:
||out - ref|| / ||ref||. TFLOP/s count only the pairs inside documents (4 * pairs * heads * head_dim for the
forward, 2.5x that for the backward), so kernels that visit cross-document pairs are charged for them.

Dense bidirectional attention (FA4 beside cuDNN), head dim 128: (4, 16 heads, 4096) and (1, 16 heads, 32768).

Decoding (`--parts decode`, forward only): the serving engine's packed-step attention at LLaDA-8B's heads (32 x 128),
rows x queries against 320 keys: 16 rows of a 32-token block, and a mixed step (one row refreshing its 320-token
canvas pads 31 block rows to 320 queries). The step's mask as a boolean mask (converted inside each call), as an
additive bias in the model's dtype (built once per step), and no mask (the floor), eager and Inductor-compiled.

    python benchmarks/attention_kernels.py --out results/
    python benchmarks/attention_kernels.py --tiny    # CPU smoke run: the model check and the dense-mask kernel
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEVICE, DTYPE = "cuda", torch.bfloat16  # --tiny: CPU, float32


def bench(fn, iters=10):
    """Median ms of fn() over iters, after 3 warm-ups (CUDA events)."""
    for _ in range(3):
        fn()
    if DEVICE != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def doc_lengths(batch, seq, mean, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row, filled = [], 0
        while filled < seq:
            n = min(int(torch.randint(max(1, mean // 6), mean * 11 // 6 + 1, (1,), generator=g)), seq - filled)
            row.append(n)
            filled += n
        rows.append(row)
    return rows


def fwd_bwd(attn, q, k, v, grad):
    """attn(q, k, v) with q (B, H, L, D) -> (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def packed_suite(a, results):
    from hf_dlm.modeling.masks import block_mask_from_mod, document_ids_from_position_ids, make_mask_mod

    B, H, KV, L, D = a.batch, a.heads, a.kv_heads, a.seq, 128
    lengths = doc_lengths(B, L, a.doc_mean)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(DEVICE)
    doc = document_ids_from_position_ids(positions)
    pairs = sum(n * n for row in lengths for n in row)
    flops = 4 * pairs * H * D * 3.5  # forward + backward (2.5x)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, H, L, D, device=DEVICE, dtype=DTYPE, generator=g)
    k = torch.randn(B, KV, L, D, device=DEVICE, dtype=DTYPE, generator=g)
    v = torch.randn(B, KV, L, D, device=DEVICE, dtype=DTYPE, generator=g)
    grad = torch.randn(B, H, L, D, device=DEVICE, dtype=DTYPE, generator=g)
    dense = (doc[:, None, :, None] == doc[:, None, None, :])  # (B, 1, L, L)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ref_attn(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)

    reference = fwd_bwd(ref_attn, *(t.float() for t in (q, k, v)), grad.float())

    variants = {}
    # as transformers' sdpa wrapper runs a masked call: K/V repeated to every head, no enable_gqa
    variants["dense mask (SDPA)"] = lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), attn_mask=dense)

    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    t0 = time.perf_counter()
    block_mask = block_mask_from_mod(make_mask_mod("bidirectional", document_ids=doc), B, L, L, DEVICE)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    results["block_mask_build_ms"] = (time.perf_counter() - t0) * 1e3
    variants["flex (hf-dlm BlockMask)"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    cu = torch.tensor([0] + [n for row in lengths for n in row], device=DEVICE).cumsum(0).to(torch.int32)
    longest = max(n for row in lengths for n in row)

    def flat(t):  # (B, h, L, D) -> (B * L, h, D)
        return t.transpose(1, 2).reshape(-1, t.shape[1], D)

    def unflat(t):
        return t.reshape(B, L, H, D).transpose(1, 2)

    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect

        gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

        def varlen(q, k, v):
            if not gqa:
                k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
            extra = {"enable_gqa": True} if gqa else {}
            return unflat(varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, **extra))

        variants["varlen (torch.nn.attention.varlen)"] = varlen
    except ImportError as error:
        results["varlen_error"] = repr(error)
    fa4 = fa4_module(results) if DEVICE == "cuda" else None
    if fa4 is not None:
        def fa4_varlen(q, k, v):
            out = fa4.flash_attn_varlen_func(flat(q), flat(k), flat(v), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                             max_seqlen_q=longest, max_seqlen_k=longest)
            return unflat(out[0] if isinstance(out, tuple) else out)

        variants["fa4 varlen"] = fa4_varlen

    rows = []
    for name, attn in variants.items():
        if a.kernels and not any(k_ in name for k_ in a.kernels.split(",")):
            continue
        try:
            got = fwd_bwd(attn, q, k, v, grad)
            errors = {n: rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), got, reference)}
            ms = bench(lambda: fwd_bwd(attn, q, k, v, grad))
            rows.append(dict(kernel=name, ms=ms, tflops=flops / ms / 1e9, **{f"rel_err_{n}": e for n, e in errors.items()},
                             ok=all(e < 2e-2 for e in errors.values())))
        except Exception as error:
            rows.append(dict(kernel=name, error=repr(error)[:400]))
        print(json.dumps(rows[-1]), flush=True)
    results["packed"] = dict(shape=dict(batch=B, heads=H, kv_heads=KV, seq=L, head_dim=D, doc_mean=a.doc_mean,
                                        documents=sum(len(r) for r in lengths)), rows=rows)


_FA4 = []


def fa4_module(results):
    if _FA4:
        return _FA4[0]
    try:
        import flash_attn.cute.interface as fa4

        _FA4.append(fa4)
    except Exception as error:
        results["fa4_import_error"] = repr(error)[:600]
        _FA4.append(None)
    return _FA4[0]


def dense_suite(a, results):
    """Bidirectional attention fwd+bwd: cuDNN SDPA vs FlashAttention-4, head dim 128."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fa4 = fa4_module(results)
    rows = []
    for B, L in ((4, 4096), (1, 32768)):
        H, D = 16, 128
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, grad = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        flops = 4 * B * H * L * L * D * 3.5

        def cudnn(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v)

        variants = {"cudnn sdpa": cudnn}
        if fa4 is not None:
            def fa4_dense(q, k, v):
                out = fa4.flash_attn_func(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), causal=False)
                return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

            variants["fa4"] = fa4_dense
        base = fwd_bwd(cudnn, q, k, v, grad)
        if L <= 4096:  # float32 reference on a slice of heads (memory)
            with sdpa_kernel([SDPBackend.MATH]):
                ref = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                              *(t[:1, :4].float() for t in (q, k, v)), grad[:1, :4].float())
        for name, attn in variants.items():
            try:
                got = fwd_bwd(attn, q, k, v, grad)
                row = dict(kernel=name, batch=B, seq=L, heads=H, head_dim=D)
                row.update({f"rel_vs_cudnn_{n}": rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), got, base)})
                if L <= 4096:
                    row.update({f"rel_vs_fp32_{n}": rel(x[:1, :4], y) for n, x, y in zip(("out", "dq", "dk", "dv"), got, ref)})
                row["ms"] = bench(lambda: fwd_bwd(attn, q, k, v, grad), iters=5 if L > 4096 else 10)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as error:
                row = dict(kernel=name, batch=B, seq=L, error=repr(error)[:400])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()
    results["dense"] = rows


def decode_suite(a, results):
    """The engine's attention per layer call (`RaggedKV.attention`'s SDPA): mask kinds, eager and compiled."""
    heads, dim = (32, 128) if DEVICE == "cuda" else (2, 16)
    cases = [("16 rows x 32 queries", 16, 32, [32] * 16), ("mixed: 32 rows x 320 queries", 32, 320, [320] + [32] * 31)]
    if DEVICE != "cuda":
        cases = [("4 rows x 8 queries", 4, 8, [8] * 4), ("mixed: 4 rows x 40 queries", 4, 40, [40, 8, 8, 8])]
    keys = cases[1][2]
    rows = []
    for name, b, width, lengths in cases:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q = torch.randn(b, heads, width, dim, device=DEVICE, dtype=DTYPE, generator=g)
        k, v = (torch.randn(b, heads, keys, dim, device=DEVICE, dtype=DTYPE, generator=g) for _ in range(2))
        # each row sees its canvas' keys (all of them here); query columns past a row's length are padding
        allowed = torch.ones(b, 1, width, keys, dtype=torch.bool, device=DEVICE)
        allowed[1::2, :, :, keys - 7:] = False  # half the rows see fewer keys
        bias = torch.zeros(allowed.shape, dtype=DTYPE, device=DEVICE).masked_fill(~allowed, torch.finfo(DTYPE).min)
        masks = {"bool mask": allowed, "additive bias": bias, "no mask": None}

        def attend(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        compiled = torch.compile(attend, dynamic=False) if DEVICE == "cuda" else attend
        reference = attend(q.float(), k.float(), v.float(), allowed)
        for mask_name, mask in masks.items():
            for mode, fn in (("eager", attend), ("compiled", compiled)):
                out = fn(q, k, v, mask)
                row = dict(case=name, mask=mask_name, mode=mode,
                           rel_err=None if mask is None else rel(out.float(), reference),
                           ms=bench(lambda: fn(q, k, v, mask), iters=50 if DEVICE == "cuda" else 5))
                rows.append(row)
                print(json.dumps(row), flush=True)
    results["decode"] = rows


def model_check(results):
    """A small DLM on the GPU in float32: SDPA with packed documents (-> FlexAttention) and the two-stream
    block-diffusion input against the eager reference, logits and gradients."""
    from hf_dlm import DLMConfig, DLMForDiffusionLM

    out = {}
    for case in ("packed", "two_stream"):
        mode = "block" if case == "two_stream" else "bidirectional"
        config = DLMConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, mask_token_id=319, qk_norm=True,
                           max_position_embeddings=1024, attention_mode=mode, block_size=16 if mode == "block" else None)
        torch.manual_seed(0)
        model = DLMForDiffusionLM(config).to(DEVICE)
        ids = torch.randint(0, 319, (2, 512), device=DEVICE)
        kwargs = ({"position_ids": torch.cat([torch.arange(n) for n in (100, 300, 112)]).expand(2, -1).to(DEVICE)}
                  if case == "packed" else {"clean_input_ids": torch.randint(0, 319, (2, 512), device=DEVICE)})
        grads = {}
        for implementation in ("eager", "sdpa"):
            model.config._attn_implementation = implementation
            model.zero_grad()
            logits = model(ids, **kwargs).logits
            logits.square().mean().backward()
            grads[implementation] = (logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone())
        from hf_dlm.modeling.masks import document_attention_implementation

        out[case] = dict(rel_logits=rel(grads["sdpa"][0], grads["eager"][0]), rel_grad=rel(grads["sdpa"][1], grads["eager"][1]),
                         sdpa_runs=document_attention_implementation("sdpa", torch.device(DEVICE)))
        print(json.dumps({case: out[case]}), flush=True)
    results["model_check"] = out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--doc-mean", type=int, default=650)
    p.add_argument("--parts", default="model,packed,dense", help="comma-separated: model, packed, dense, decode")
    p.add_argument("--kernels", default="", help="packed part: only variants whose name holds one of these")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, float32, model check + dense mask")
    a = p.parse_args()
    global DEVICE, DTYPE
    if a.tiny:
        DEVICE, DTYPE = "cpu", torch.float32
        a.batch, a.heads, a.kv_heads, a.seq, a.doc_mean, a.parts, a.kernels = 1, 2, 1, 64, 20, "model,packed,decode", "dense"
    results = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu")
    for part, fn in (("model", model_check), ("packed", packed_suite), ("dense", dense_suite), ("decode", decode_suite)):
        if part in a.parts.split(","):
            try:
                fn(a, results) if part != "model" else fn(results)
            except Exception as error:
                results[f"{part}_error"] = repr(error)[:600]
                print(f"{part} failed: {error!r}", flush=True)
    print("\n| kernel | shape | ms fwd+bwd | TFLOP/s | max rel. error |\n|---|---|---|---|---|")
    for row in results.get("packed", {}).get("rows", []):
        errs = [v for k, v in row.items() if k.startswith("rel_err")]
        print(f"| {row['kernel']} | packed {a.batch}x{a.seq} | {row.get('ms', float('nan')):.2f} | "
              f"{row.get('tflops', float('nan')):.0f} | {max(errs) if errs else row.get('error')} |")
    for row in results.get("dense", []):
        errs = [v for k, v in row.items() if k.startswith("rel_vs")]
        print(f"| {row['kernel']} | dense {row['batch']}x{row['seq']} | {row.get('ms', math.nan):.2f} | "
              f"{row.get('tflops', math.nan):.0f} | {max(errs) if errs else row.get('error')} |")
    if results.get("decode"):
        print("\n| decoding step | mask | mode | ms per call | rel. error vs fp32 |\n|---|---|---|---|---|")
        for row in results["decode"]:
            print(f"| {row['case']} | {row['mask']} | {row['mode']} | {row['ms']:.4f} | {row['rel_err']} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "attention_kernels.json"), "w") as f:
            json.dump(results, f, indent=1)
    if a.tiny:  # the smoke run fails loudly: every part ran and every kernel matched its reference
        assert not [k for k in results if k.endswith("_error")], results
        assert results["packed"]["rows"] and all(row.get("ok") for row in results["packed"]["rows"]), results
        assert all(c["rel_logits"] < 1e-4 for c in results["model_check"].values()), results["model_check"]
        assert all(row["rel_err"] is None or row["rel_err"] < 1e-5 for row in results["decode"]), results["decode"]


if __name__ == "__main__":
    main()
