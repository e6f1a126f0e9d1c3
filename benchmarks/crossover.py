"""The data-constrained crossover of "Diffusion Language Models are Super Data Learners" (arXiv 2511.03276),
and diffusion + MoE (OpenMoE 2), at small scale on hf-dlm's own pieces.

The same model shape (DLMConfig) is trained as an AR model (attention_mode="causal", next-token objective
"ar") and as a DLM (bidirectional, the paper's masked-diffusion loss: objective preset "megadlms") by
DLMTrainer, with the same initial weights, optimizer, LR schedule, batch, tokens per step and data order
(one seed; the order is fingerprinted in the results), on a fixed budget of unique tokens repeated for many
epochs. Every run of a study sees the same number of tokens, so a smaller budget gets more epochs. Data:
the embedded corpus (Python's documentation and docstrings, hf_dlm.data.corpus), split by document into
training and held-out documents; the budgets are nested prefixes of one shuffled training stream.

Measured at evenly spaced steps on the same held-out documents:
- AR: the exact NLL per token of held-out windows (each token given all before it in its window);
- DLM: the ELBO per token of the same tokens (given the window's first token too): an UPPER BOUND on the
  DLM's NLL, so "DLM below AR" on this metric is a conservative crossover;
- both: held-out multiple-choice accuracy, the true continuation of a held-out passage against 3 taken
  from other held-out documents (same length), scored by the AR log-likelihood and by the DLM's ELBO
  through `hf_dlm.evaluation.score_continuations`, the lm-eval model's loglikelihood path.
The MoE study trains the DLM of one size on the smallest budget with MoE layers at equal active parameters
(num_experts_per_tok experts of width intermediate_size / num_experts_per_tok), token choice (softmax) and
expert choice (sequence or batch level), against the dense run.

    python benchmarks/crossover.py --tiny                # CPU, seconds: writes $OUT/crossover_tiny.json (+ .png)
    python benchmarks/crossover.py --preset h200-short   # one H200, about 8 minutes: $OUT/crossover_h200-short.json
    python benchmarks/crossover.py --config my.yaml --set training.steps=600 --only crossover
    python benchmarks/crossover.py --plot results.json out.png   # matplotlib, CPU

Presets are the YAML files in examples/crossover/. The results JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
PRESET_DIR = os.path.join(ROOT, "examples", "crossover")

import torch  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

from hf_dlm.data.corpus import split_documents, stdlib_documents, train_bpe_tokenizer  # noqa: E402
from hf_dlm.data.memory_dataset import TokenWindowDataset, pack_documents  # noqa: E402
from hf_dlm.evaluation.scoring import score_continuations  # noqa: E402
from hf_dlm.modeling import DLMConfig, DLMForDiffusionLM  # noqa: E402
from hf_dlm.modeling.moe import active_parameter_count  # noqa: E402
from hf_dlm.training import DLMTrainer, DLMTrainingArguments  # noqa: E402

OVERFIT_TOLERANCE = 0.01  # a held-out loss that ends > 1% above its minimum has over-fitted


# ---- configuration -------------------------------------------------------------------------------------
def load_study(path: str, overrides: list[str]) -> dict:
    import yaml

    with open(path) as f:
        study = yaml.safe_load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected key=value or section.key=value")
        *sections, name = key.split(".")
        target = study
        for section in sections:
            target = target.setdefault(section, {})
        if name not in target:
            raise SystemExit(f"--set {item!r}: {path} has no entry {key!r}")
        target[name] = yaml.safe_load(value)
    return study


# ---- data ----------------------------------------------------------------------------------------------
class RecordedWindows(TokenWindowDataset):
    """Training windows that fingerprint the order they are read in (the data loader's one-batch look-ahead
    included): AR and DLM runs must read the same."""

    def __init__(self, input_ids):
        super().__init__(input_ids)
        self.order = hashlib.sha1()
        self.reads = 0

    def __getitem__(self, index: int) -> dict:
        self.order.update(int(index).to_bytes(8, "little"))
        self.reads += 1
        return super().__getitem__(index)


def build_data(corpus: dict, seed: int, log) -> dict:
    """Documents -> split by document -> tokenizer on the training documents -> training windows (one shuffled
    stream: budgets are its prefixes), held-out windows and multiple-choice passages."""
    docs = stdlib_documents(max_files=corpus.get("max_files"))
    train_docs, heldout_docs = split_documents(docs, corpus["heldout_fraction"])
    tokenizer = train_bpe_tokenizer(train_docs, corpus["vocab_size"])
    random.Random(seed).shuffle(train_docs)
    seq_len = corpus["seq_len"]
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    train = pack_documents(encode(train_docs), seq_len, tokenizer.eos_token_id)[0]
    heldout_ids = encode(heldout_docs)
    windows = pack_documents(heldout_ids, seq_len, tokenizer.eos_token_id)[0][: corpus["eval_windows"]]
    context, length = corpus["mc_context"], corpus["mc_continuation"]
    long_docs = [ids for ids in heldout_ids if len(ids) >= context + length]
    rng = random.Random(seed + 1)
    passages = []
    for i in rng.sample(range(len(long_docs)), min(corpus["mc_passages"], len(long_docs))):
        others = rng.sample([j for j in range(len(long_docs)) if j != i], 3)
        candidates = [long_docs[j][context: context + length] for j in [i, *others]]
        answer = rng.randrange(4)  # the true continuation's slot
        candidates.insert(answer, candidates.pop(0))
        passages.append({"context": long_docs[i][:context], "candidates": candidates, "answer": answer})
    if len(passages) < 2 or windows.shape[0] < 1:
        raise SystemExit(f"crossover: the held-out split gave {windows.shape[0]} windows and {len(passages)} "
                         "multiple-choice passages; raise corpus.heldout_fraction or lower mc_context / seq_len")
    stats = {"documents": len(docs), "train_documents": len(train_docs), "heldout_documents": len(heldout_docs),
             "train_tokens": int(train.numel()), "heldout_tokens": sum(map(len, heldout_ids)),
             "eval_windows": int(windows.shape[0]), "mc_passages": len(passages), "vocab_size": len(tokenizer),
             "python": sys.version.split()[0]}
    log(f"corpus: {stats}")
    return {"tokenizer": tokenizer, "train": train, "windows": windows, "passages": passages, "stats": stats}


# ---- evaluation ------------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_metrics(model, data: dict, training: dict) -> dict:
    """AR: exact NLL per token; DLM: ELBO per token (an upper bound on its NLL), both over the tokens after
    the first of every held-out window; and the multiple-choice accuracy, through `score_continuations`."""
    causal = model.config.attention_mode == "causal"
    common = dict(pad_token_id=data["tokenizer"].pad_token_id, batch_size=training["eval_batch_size"],
                  seed=training["seed"])
    windows = data["windows"].tolist()
    scores = score_continuations(model, [(w[:1], w[1:]) for w in windows], mc_num=training["elbo_mc_num"], **common)
    nll = -sum(s for s, _ in scores) / sum(len(w) - 1 for w in windows)
    pairs = [(p["context"], c) for p in data["passages"] for c in p["candidates"]]
    choice = score_continuations(model, pairs, mc_num=training["mc_mc_num"], **common)
    correct = 0
    for n, passage in enumerate(data["passages"]):
        values = [s for s, _ in choice[4 * n: 4 * n + 4]]
        correct += int(max(range(4), key=values.__getitem__) == passage["answer"])
    return {"heldout_nll" if causal else "heldout_elbo": nll, "mc_accuracy": correct / len(data["passages"])}


class PeriodicEvaluation(TrainerCallback):
    """Held-out metrics every `every` optimizer steps (and at the last), timed apart from training; the
    training tokens/s of each interval between evaluations."""

    def __init__(self, data, training, every: int, tokens_per_step: int, steps_per_epoch: float, autocast):
        self.data, self.training, self.every = data, training, every
        self.tokens_per_step, self.steps_per_epoch, self.autocast = tokens_per_step, steps_per_epoch, autocast
        self.curve, self.intervals = [], []
        self._mark, self._mark_step = None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.every and step != state.max_steps:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.intervals.append({"steps": step - self._mark_step, "seconds": now - self._mark})
        was_training = model.training
        model.eval()
        # compiled blocks run eagerly here: evaluation shapes and no_grad would otherwise compile more graphs
        # than the few evaluations repay
        with self.autocast(), torch.compiler.set_stance("force_eager"):
            metrics = heldout_metrics(model, self.data, self.training)
        model.train(was_training)
        self.curve.append({"step": step, "epoch": round(step / self.steps_per_epoch, 3),
                           "tokens_seen": step * self.tokens_per_step, **metrics,
                           "eval_seconds": round(time.perf_counter() - now, 3)})
        self._mark, self._mark_step = time.perf_counter(), step


def tokens_per_second(intervals: list, tokens_per_step: int) -> float | None:
    """Training throughput after the first interval (which holds compilation and warm-up)."""
    steady = intervals[1:] or intervals
    seconds = sum(i["seconds"] for i in steady)
    return round(sum(i["steps"] for i in steady) * tokens_per_step / seconds, 1) if seconds > 0 else None


# ---- one run ---------------------------------------------------------------------------------------------
def model_config(study: dict, data: dict, size: str, objective: str, router: str | None) -> DLMConfig:
    tokenizer, size_fields = data["tokenizer"], dict(study["sizes"][size])
    options = dict(vocab_size=len(tokenizer), qk_norm=True, tie_word_embeddings=True,
                   max_position_embeddings=study["corpus"]["seq_len"], mask_token_id=tokenizer.mask_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   attention_mode="causal" if objective == "ar" else "bidirectional", **size_fields)
    if router is not None:  # equal active parameters: k experts of width intermediate_size / k
        moe = study["moe"]
        kind, _, level = router.partition("/")
        options.update(num_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                       moe_intermediate_size=size_fields["intermediate_size"] // moe["num_experts_per_tok"],
                       moe_router=kind, **({"expert_choice_level": level} if level else {}))
    config = DLMConfig(**options)
    config._attn_implementation = "sdpa"
    return config


def train_run(study: dict, data: dict, spec: dict, device: str) -> dict:
    training, corpus = study["training"], study["corpus"]
    batch, seq_len = training["batch_size"], corpus["seq_len"]
    windows = (min(spec["budget"], data["train"].numel()) // seq_len) // batch * batch
    if windows < batch:
        raise SystemExit(f"crossover: budget {spec['budget']} holds fewer than one batch of {batch} x {seq_len} tokens")
    dataset = RecordedWindows(data["train"][:windows])
    config = model_config(study, data, spec["size"], spec["objective"], spec.get("router"))
    torch.manual_seed(training["seed"])  # AR and DLM start from the same weights
    model = DLMForDiffusionLM(config)
    with torch.no_grad():  # a fingerprint of the initial weights, compared between runs of one shape
        init = sum(float(p.double().abs().sum()) * (i + 1) for i, p in enumerate(model.parameters()))
    # compiled blocks keep their graphs from run to run (no dynamo reset): runs of one shape and causality at
    # other budgets reuse them, guarded by shape and attention mode
    steps, cuda = training["steps"], device == "cuda"
    with tempfile.TemporaryDirectory() as output_dir:
        args = DLMTrainingArguments(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch,
            learning_rate=training["learning_rate"], warmup_steps=round(training["warmup_ratio"] * steps),
            lr_scheduler_type=training["lr_scheduler_type"], weight_decay=training["weight_decay"],
            adam_beta2=training["adam_beta2"], max_grad_norm=training["max_grad_norm"],
            optim="adamw_torch_fused" if cuda else "adamw_torch", seed=training["seed"], data_seed=training["seed"],
            objective_preset="ar" if spec["objective"] == "ar" else training["dlm_objective"],
            bf16=bool(training["bf16"]), compile_blocks=bool(training["compile"]), use_cpu=not cuda,
            save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, logging_steps=steps,
            t_buckets=0, dataloader_drop_last=True,
            logging_nan_inf_filter=False)  # the filter reads the loss on the host: a GPU sync every step
        autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if training["bf16"] and cuda
                    else (lambda: torch.autocast(device, enabled=False)))
        evaluation = PeriodicEvaluation(data, training, max(1, steps // training["evaluations"]), batch * seq_len,
                                        windows / batch, autocast)
        trainer = DLMTrainer(model=model, args=args, train_dataset=dataset, callbacks=[evaluation])
        trainer.remove_callback(PrinterCallback)  # one line per run is printed here instead
        dataset.order, dataset.reads = hashlib.sha1(), 0  # the trainer's own look at sample 0 is not training
        start = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - start
    unique = windows * seq_len
    return {**spec, "unique_tokens": unique, "epochs": round(steps * batch * seq_len / unique, 3), "steps": steps,
            "tokens_per_step": batch * seq_len, "parameters": sum(p.numel() for p in model.parameters()),
            "active_parameters": active_parameter_count(model), "objective_preset": args.objective_preset,
            "train_loss": round(float(output.training_loss), 4), "seconds": round(seconds, 1),
            "tokens_per_second": tokens_per_second(evaluation.intervals, batch * seq_len),
            "first_interval_seconds": round(evaluation.intervals[0]["seconds"], 1),  # compilation and warm-up in it
            "initial_weights_fingerprint": init, "data_order_sha1": dataset.order.hexdigest(), "samples_read": dataset.reads, "curve": evaluation.curve}


def plan(study: dict, only: str) -> list[dict]:
    """Crossover: every size x budget x (AR, DLM). MoE: the routers on the smallest budget (the dense DLM
    of that size and budget is the crossover run, trained here too when only the MoE study runs)."""
    specs, smallest = [], min(study["budgets"])
    for size in study["sizes"]:
        for budget in study["budgets"]:
            for objective in ("ar", "dlm"):
                if only != "moe" or (size == study["moe"]["size"] and budget == smallest and objective == "dlm"):
                    specs.append({"study": "crossover", "size": size, "budget": budget, "objective": objective})
    if only != "crossover":
        for router in study["moe"]["routers"]:
            specs.append({"study": "moe", "size": study["moe"]["size"], "budget": smallest, "objective": "dlm",
                          "router": router})
    return specs


# ---- analysis --------------------------------------------------------------------------------------------
def crossover_epoch(epochs, ar, dlm, higher_is_better: bool):
    """First evaluation from which the DLM is at least as good as AR at every later one, when it ends strictly
    better; None when AR is ahead or level at the end."""
    better = [(d >= a) if higher_is_better else (d <= a) for a, d in zip(ar, dlm)]
    final_strict = dlm[-1] > ar[-1] if higher_is_better else dlm[-1] < ar[-1]
    if not better or not final_strict:
        return None
    i = len(better) - 1
    while i > 0 and better[i - 1]:
        i -= 1
    return epochs[i]


def overfit_epoch(epochs, losses):
    """Epoch of the held-out loss's minimum when it ends more than OVERFIT_TOLERANCE above it, else None."""
    best = min(range(len(losses)), key=losses.__getitem__)
    return epochs[best] if losses[-1] > losses[best] * (1 + OVERFIT_TOLERANCE) else None


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    done = {(r["size"], r["budget"], r["objective"]): r for r in runs if r["study"] == "crossover" and "curve" in r}
    for (size, budget, objective), ar in done.items():
        dlm = done.get((size, budget, "dlm"))
        if objective != "ar" or dlm is None:
            continue
        n = min(len(ar["curve"]), len(dlm["curve"]))
        epochs = [p["epoch"] for p in ar["curve"][:n]]
        ar_nll, dlm_elbo = [p["heldout_nll"] for p in ar["curve"][:n]], [p["heldout_elbo"] for p in dlm["curve"][:n]]
        ar_mc, dlm_mc = [p["mc_accuracy"] for p in ar["curve"][:n]], [p["mc_accuracy"] for p in dlm["curve"][:n]]
        rows.append({"size": size, "budget": budget, "unique_tokens": ar["unique_tokens"], "epochs": ar["epochs"],
                     "crossover_epoch_mc": crossover_epoch(epochs, ar_mc, dlm_mc, True),
                     "crossover_epoch_loss": crossover_epoch(epochs, ar_nll, dlm_elbo, False),
                     "ar_overfit_epoch": overfit_epoch(epochs, ar_nll), "dlm_overfit_epoch": overfit_epoch(epochs, dlm_elbo),
                     "ar_final_nll": ar_nll[-1], "dlm_final_elbo": dlm_elbo[-1], "ar_best_nll": min(ar_nll),
                     "dlm_best_elbo": min(dlm_elbo), "ar_final_mc": ar_mc[-1], "dlm_final_mc": dlm_mc[-1],
                     "ar_tokens_per_second": ar["tokens_per_second"], "dlm_tokens_per_second": dlm["tokens_per_second"]})
    return rows


def print_tables(results: dict, out=print) -> None:
    out("\n| size | unique tokens | epochs | crossover epoch (MC acc) | crossover epoch (ELBO <= NLL) | AR over-fits at "
        "| DLM over-fits at | AR NLL end / best | DLM ELBO end / best | MC acc AR / DLM | tokens/s AR / DLM |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["summary"]:
        out(f"| {r['size']} | {r['unique_tokens']:,} | {r['epochs']:g} | {r['crossover_epoch_mc']} | "
            f"{r['crossover_epoch_loss']} | {r['ar_overfit_epoch']} | {r['dlm_overfit_epoch']} | "
            f"{r['ar_final_nll']:.3f} / {r['ar_best_nll']:.3f} | {r['dlm_final_elbo']:.3f} / {r['dlm_best_elbo']:.3f} | "
            f"{r['ar_final_mc']:.3f} / {r['dlm_final_mc']:.3f} | {r['ar_tokens_per_second']} / {r['dlm_tokens_per_second']} |")
    moe = [r for r in results["runs"] if "curve" in r and r["objective"] == "dlm"
           and r["size"] == results["study"]["moe"]["size"] and r["budget"] == min(results["study"]["budgets"])]
    if any(r["study"] == "moe" for r in moe):
        out("\n| DLM (smallest budget) | parameters | active | ELBO end / best | MC acc end | tokens/s |")
        out("|---|---|---|---|---|---|")
        for r in moe:
            elbo = [p["heldout_elbo"] for p in r["curve"]]
            out(f"| {r.get('router') or 'dense'} | {r['parameters']:,} | {r['active_parameters']:,} | "
                f"{elbo[-1]:.3f} / {min(elbo):.3f} | {r['curve'][-1]['mc_accuracy']:.3f} | {r['tokens_per_second']} |")
    for r in results["runs"]:
        if "error" in r:
            out(f"FAILED: {r['study']} {r['size']} {r['budget']} {r['objective']} {r.get('router') or ''}: {r['error']}")


# ---- plot ------------------------------------------------------------------------------------------------
def plot(results_path: str, png_path: str) -> None:
    """One column per budget (and one for the MoE study): held-out NLL / ELBO and multiple-choice accuracy
    against epochs, AR solid, DLM dashed, one colour per size, crossover epochs as dotted verticals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results_path) as f:
        results = json.load(f)
    runs = [r for r in results["runs"] if "curve" in r]
    budgets = sorted({r["budget"] for r in runs if r["study"] == "crossover"})
    moe_runs = [r for r in runs if r["study"] == "moe"]
    columns = len(budgets) + (1 if moe_runs else 0)
    fig, axes = plt.subplots(2, columns, figsize=(4.2 * columns, 6.4), squeeze=False)
    colours = {size: f"C{i}" for i, size in enumerate(results["study"]["sizes"])}
    for col, budget in enumerate(budgets):
        top, bottom = axes[0][col], axes[1][col]
        for r in (r for r in runs if r["study"] == "crossover" and r["budget"] == budget):
            epochs = [p["epoch"] for p in r["curve"]]
            style = dict(color=colours[r["size"]], linestyle="-" if r["objective"] == "ar" else "--", marker=".")
            label = f"{r['size']} {'AR (NLL)' if r['objective'] == 'ar' else 'DLM (ELBO)'}"
            top.plot(epochs, [p["heldout_nll" if r["objective"] == "ar" else "heldout_elbo"] for p in r["curve"]],
                     label=label, **style)
            bottom.plot(epochs, [p["mc_accuracy"] for p in r["curve"]], label=label, **style)
        for row in results["summary"]:
            if row["budget"] == budget:
                for ax, key in ((top, "crossover_epoch_loss"), (bottom, "crossover_epoch_mc")):
                    if row[key] is not None:
                        ax.axvline(row[key], color=colours[row["size"]], linestyle=":", linewidth=1)
        unique = next(r["unique_tokens"] for r in runs if r["budget"] == budget)
        top.set_title(f"{unique:,} unique tokens")
        top.set_ylabel("held-out nats/token (ELBO: upper bound)")
        bottom.set_ylabel("held-out MC accuracy (4 choices)")
        bottom.set_xlabel("epochs")
    if moe_runs:
        top, bottom = axes[0][-1], axes[1][-1]
        moe = results["study"]["moe"]
        dense = [r for r in runs if r["study"] == "crossover" and r["objective"] == "dlm" and r["size"] == moe["size"]
                 and r["budget"] == min(budgets or [0])]
        for i, r in enumerate(dense + moe_runs):
            epochs = [p["epoch"] for p in r["curve"]]
            label = r.get("router") or "dense"
            top.plot(epochs, [p["heldout_elbo"] for p in r["curve"]], color=f"C{i + 3}", marker=".", label=label)
            bottom.plot(epochs, [p["mc_accuracy"] for p in r["curve"]], color=f"C{i + 3}", marker=".", label=label)
        top.set_title(f"DLM {moe['size']}: dense vs MoE (equal active)")
        bottom.set_xlabel("epochs")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("AR vs DLM on repeated data (dotted: crossover epochs)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------------
def run_study(study: dict, out_path: str, only: str = "all", log=print) -> dict:
    cuda = torch.cuda.is_available() and not study.get("cpu", False)
    device = "cuda" if cuda else "cpu"
    if study["training"].get("bf16") and not cuda:
        raise SystemExit("crossover: this study asks for bf16 on a GPU and none is visible; use --tiny (or a "
                         "config with bf16: false) on CPU")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        for name in ("recompile_limit", "cache_size_limit"):  # eval shapes add graphs per block
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
    start = time.perf_counter()
    data = build_data(study["corpus"], study["training"]["seed"], log)
    results = {"study": study, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "corpus": data["stats"], "runs": [], "summary": []}
    for spec in plan(study, only):
        name = " ".join(str(spec[k]) for k in ("study", "size", "budget", "objective")) + f" {spec.get('router') or ''}"
        log(f"run: {name}")
        try:
            run = train_run(study, data, spec, device)
        except Exception as error:  # noqa: BLE001  recorded in the JSON and the table, and the exit status
            log(f"run failed: {name}: {type(error).__name__}: {error}")
            run = {**spec, "error": f"{type(error).__name__}: {error}"}
        else:
            last = run["curve"][-1]
            log(f"  {run['epochs']:g} epochs, {run['seconds']}s, {run['tokens_per_second']} tokens/s, last: "
                + ", ".join(f"{k}={v:.4f}" for k, v in last.items() if k.startswith(("heldout", "mc"))))
        results["runs"].append(run)
        results["summary"] = summarize(results["runs"])
        results["seconds"] = round(time.perf_counter() - start, 1)
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    print_tables(results, log)
    log(f"\n{results['seconds']}s in all; results: {out_path}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU test preset (examples/crossover/tiny.yaml)")
    parser.add_argument("--preset", help=f"a preset of {PRESET_DIR}: tiny, h200-short")
    parser.add_argument("--config", help="a study YAML file (the presets' format)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one entry of the study (YAML value), e.g. training.steps=600 or budgets=[81920]")
    parser.add_argument("--only", choices=("all", "crossover", "moe"), default="all")
    parser.add_argument("--out", help="results JSON (default: $OUT/crossover_<preset>.json, or in the current "
                                      "folder without $OUT); the plot goes beside it when matplotlib is installed")
    parser.add_argument("--plot", nargs=2, metavar=("RESULTS_JSON", "OUT_PNG"), help="render a results file")
    args = parser.parse_args(argv)
    if args.plot:
        plot(*args.plot)
        print(f"wrote {args.plot[1]}")
        return 0
    name = "tiny" if args.tiny else args.preset
    if bool(name) == bool(args.config):
        parser.error("give one of --tiny, --preset NAME or --config FILE (or --plot)")
    path = args.config or os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        parser.error(f"no study file {path}")
    study = load_study(path, args.set)
    if args.tiny:
        study["cpu"] = True
    out = args.out or os.path.join(os.environ.get("OUT", "."),
                                   f"crossover_{name or os.path.splitext(os.path.basename(path))[0]}.json")
    results = run_study(study, out, args.only)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: render the plot elsewhere with --plot {out} OUT.png")
    else:
        plot(out, os.path.splitext(out)[0] + ".png")
        print(f"plot: {os.path.splitext(out)[0]}.png")
    return 1 if any("error" in r for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
