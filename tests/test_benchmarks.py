"""Every script in benchmarks/ runs its `--tiny` CPU mode (seconds), so none rots unseen.

Each runs as a user runs it (`python benchmarks/<name>.py --tiny`, a fresh interpreter whose path holds
the repository only through PYTHONPATH), on one thread: the CI machine has 2 shared cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_has_a_tiny_mode():
    missing = [name for name in SCRIPTS if "--tiny" not in (ROOT / "benchmarks" / name).read_text()]
    assert not missing, f"benchmarks without --tiny: {missing}"


# options whose code path the plain --tiny run does not take
# (the compiled blocks in training; its eager generate and dense runs are the plain run's: 55 s -> 19 s)
EXTRA_RUNS = [("llada2_mini.py", ("--compile", "--skip", "generate", "dense"))]


# options every --tiny run of a script takes, and what its stderr must then hold
ALWAYS = {"serving_throughput.py": (("--stacks-every", "2"), "thread MainThread:")}


def _serving_parts(out: Path, stdout: str):
    # the HTTP clients run in a process of their own (a load generator must not share the server's GIL) and,
    # for comparison, in the server's process; the batch-1 part decodes with fused projections too (the same
    # tokens in fp32), profiled
    report = json.loads((out / "serving_throughput.json").read_text())
    batch1 = report["float8"]
    assert batch1["bf16_fused_tokens_equal_to_bf16"] == 1.0 and batch1["bf16_fused_tok_s"] > 0, batch1
    assert (out / batch1["bf16_fused_profile"]["table"]).exists() and len(report["profile"]) == 2, report["profile"]
    # each all-at-once setting with the compiled commit and the eager one (a same-machine comparison), equal tokens
    together = [r for r in report["core"] if r["arrival"] == "all at once"]
    assert sorted({(r["commit"], r["batch"]) for r in together}) == [(c, b) for c in ("compiled", "eager")
                                                                      for b in (2, 4)], together
    assert all(r["tokens_equal_to_generate"] == 1.0 for r in together), together
    # each step of the timed run timed (block starts apart), the slowest five named by their index
    assert all(r["timed_steps"] == r["engine_steps"] and r["block_start_step_ms"] > 0 and r["other_step_ms"] > 0
               and len(r["slowest_steps"]) == 5 and all(0 <= i < r["engine_steps"] for i, _ in r["slowest_steps"])
               for r in together), together
    assert batch1["bf16_eager_commit_tokens_equal_to_bf16"] == 1.0, batch1
    # each model again under another Inductor setting (--float8-inductor), compared with the default's tokens
    assert batch1["bf16_fused_pdl_tokens_equal_to_bf16"] == 1.0, batch1
    assert batch1["bf16_fused_layers_4_tokens_equal_to_bf16"] == 1.0, batch1
    assert batch1["bf16_fused_layers_4_eager_commit_tokens_equal_to_default"] == 1.0, batch1
    # the arrivals with the engine's two-call attention and with one padded call (a same-machine comparison)
    arrivals = [r for r in report["core"] if r["arrival"] != "all at once"]
    assert sorted((r["setting"], r["split_attention"], r["graph_pool"]) for r in arrivals) == [
        (setting, split, pool) for setting in ("one token per step", "threshold 0.9") for split in ("no", "yes")
        for pool in ("own", "shared")], arrivals
    assert all(r["tokens_equal_to_first_variant"] == 1.0 for r in arrivals), arrivals
    assert all(r["engine_tok_s"] > 0 and r["forwards"] == r["engine_steps"] for r in arrivals), arrivals
    # the repeated runs decode the same tokens (graphs replayed from one shared memory pool on the GPU)
    assert all(run["tokens_equal_to_previous_run"] == 1.0 for r in arrivals for run in r["runs"]), arrivals
    rows = report["serve"]
    assert {(r["clients_in"], r["stream"]) for r in rows} == {(w, s) for w in ("process", "thread") for s in (True, False)}
    assert all(r["output_tokens_per_s"] > 0 and r["engine_steps"] > 0 for r in rows), rows
    # each request's time split into its phases: the clients' clock against the engine's request times
    assert all(r["decoding_s"] > 0 and r["queued_s"] >= 0 and r["to_engine_s"] > 0 and r["to_client_s"] > 0
               and r["to_engine_s"] + r["queued_s"] + r["decoding_s"] + r["to_client_s"] <= r["latency_mean_s"] + 1e-3
               for r in rows), rows
    # the server's CPU: its event loop per request and the engine thread per step (each thread's own clock)
    assert all(r["loop_cpu_ms_per_request"] > 0 and r["engine_cpu_ms_per_step"] > 0 for r in rows), rows
    assert {r["http_parser"] for r in rows} <= {"h11", "httptools"} and all(r["event_loop"] for r in rows), rows


def _compile_time_split(out: Path, stdout: str):
    # the compile's fake-tensor propagation timed per operator (real operators, seconds inside the warm-up's),
    # and the warm-up's cProfile table
    rows = json.loads((out / "engine_compile_time.json").read_text())
    assert [row["graph"] for row in rows] == ["regional", "whole"], rows
    for row in rows:
        ops = row["fake_ops"]
        assert len(ops) == 5 and all(op["op"].startswith("aten.") and op["calls"] > 0 for op in ops), ops
        assert 0 < sum(op["seconds"] for op in ops) <= row["fake_propagation_s"] <= row["warmup_s"], row
    assert "function calls" in stdout and "Ordered by: internal time" in stdout, stdout[-2000:]


def _step_shapes(out: Path, stdout: str):
    # the engine's steps go through the captured path (`CountedGraph` standing in for the CUDA graphs): the arrivals'
    # shapes are captured in the first runs and replayed in the last
    runs = json.loads((out / "step_shapes.json").read_text())["runs"]
    arrivals = [run for run in runs if run["schedule"] != "all at once"]
    assert arrivals[0]["shapes_seen"] > 1 and arrivals[0]["captures"] > 0, runs
    assert arrivals[-1]["captures"] < arrivals[1]["captures"], runs
    assert all(run["attention_padding"] >= 1.0 and run["token_padding"] >= 1.0 for run in runs), runs


def _commit_kernels(out: Path, stdout: str):
    # every form of a step's vocabulary-sized work decides the eager form's tokens (log and exp Gumbel forms too)
    rows = json.loads((out / "commit_kernels.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["tokens_equal_to_eager"] == 1.0 and r["ms"] > 0 for r in rows), rows


# what a script's --tiny output must hold beyond its exit status
CHECKS = {"serving_throughput.py": _serving_parts, "engine_compile_time.py": _compile_time_split,
          "step_shapes.py": _step_shapes, "commit_kernels.py": _commit_kernels}


@pytest.mark.parametrize("name,options", [(name, ()) for name in SCRIPTS] + EXTRA_RUNS)
def test_tiny_run(name, options, tmp_path):
    always, expected = ALWAYS.get(name, ((), ""))
    check = CHECKS.get(name) if not options else None  # the plain --tiny run
    options = (*options, *always)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), "--tiny", *options], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{name} --tiny exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert expected in out.stderr, f"{name} --tiny {' '.join(options)}: {expected!r} not in stderr"
    if check is not None:
        check(tmp_path, out.stdout)


def test_the_serving_benchmarks_exp_form_draws_what_the_core_draws(monkeypatch):
    """`--commit compiled-exp` times the sampled draw in LLaDA's exp / pow form against the core's log form: it
    must draw the same tokens and confidences (else the comparison times two different samplers)."""
    import importlib.util

    import torch

    from hf_dlm.generation.commit_rules import sampled_scores

    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location("serving_throughput", ROOT / "benchmarks" / "serving_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8, 300, generator=generator) * 3
    noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
    temperature = torch.tensor(0.9, dtype=torch.float64)
    exp_x0, exp_confidence = module.exp_form_sampled_scores(logits, noise, 5, temperature, "margin")
    x0, confidence = sampled_scores(logits, noise, 5, temperature, "margin")
    assert torch.equal(exp_x0, x0) and not x0.eq(5).any()
    torch.testing.assert_close(exp_confidence, confidence, rtol=0, atol=0)
