"""DLMTrainer with training.pp_size=2 from a YAML config, through torchrun on 2 gloo processes (and on 4, with
FSDP2=2): the same losses, gradient norms, per-t statistics and weights as one process; the per-stage checkpoint
loads with `from_pretrained`; a run resumed from it, in the same layout or with pp_size=1, equals the
uninterrupted run."""

import json
import os
import shutil

import pytest
import torch
import yaml

from hf_dlm import DLMForDiffusionLM
from hf_dlm.training.runner import build_trainer, load_config
from hf_dlm.training.training_args import DLMTrainingArguments
from tests.utils import MASK_ID, VOCAB, torchrun

CONFIG = {
    "model": {"attn_implementation": "sdpa",
              "config": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, mask_token_id=MASK_ID, qk_norm=True,
                             max_position_embeddings=64)},
    "data": {"kind": "random", "num_samples": 64, "seq_len": 16, "seed": 0},
    # 2 pp ranks x 2 rows pool into micro-batches of 4; 2 micro-batches per step; global norm clipping on
    "training": dict(use_cpu=True, report_to="none", disable_tqdm=True, seed=0, learning_rate=1e-2, max_grad_norm=0.5,
                     per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, logging_steps=1,
                     save_strategy="steps", save_steps=2, dataloader_num_workers=0, pp_size=2, pp_schedule="1f1b"),
}


def _write_config(path, **training) -> str:
    config = json.loads(json.dumps(CONFIG))
    config["training"].update(training)
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _train(config_path, resume=None):
    trainer, _ = build_trainer(load_config(config_path), config_path)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [log for log in trainer.state.log_history if "loss" in log]


# layout -> (processes, training options): PP=2 alone (2 ranks x 2 rows pool a micro-batch), and PP=2 x FSDP2=2
# with the interleaved schedule (4 ranks x 1 row; each data-parallel pair pools 2 rows): both 4 rows a micro-batch
LAYOUTS = {"pp2": (2, dict(pp_schedule="1f1b")),
           "pp2xfsdp2": (4, dict(pp_schedule="interleaved_1f1b", per_device_train_batch_size=1))}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pipeline_run(request, tmp_path_factory):
    processes, options = LAYOUTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    config = _write_config(folder / "pp.yaml", output_dir=str(folder / "run"), **options)
    torchrun(os.path.join("tests", "pipeline_trainer_worker.py"), config, str(folder / "out.json"), nproc=processes,
             timeout=300)
    return folder, json.loads((folder / "out.json").read_text())


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp1")
    config = _write_config(folder / "pp1.yaml", output_dir=str(folder / "run"), pp_size=1,
                           per_device_train_batch_size=4, save_strategy="no")
    trainer, logs = _train(config)
    return trainer, logs, folder


def test_pp2_trains_like_one_process(pipeline_run, single_run):
    folder, record = pipeline_run
    trainer, logs, _ = single_run
    # rank 0 holds the first two of 4 layers, or (interleaved) stages 0 and 2 of one layer each
    assert (record["world_size"], record["stages"]) in ((2, [[0, 1]]), (4, [[0], [2]]))
    pp_logs = record["logs"]
    assert [log["step"] for log in pp_logs] == [log["step"] for log in logs] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([log[key] for log in pp_logs]), torch.tensor([log[key] for log in logs]),
                                   rtol=1e-5, atol=1e-6, msg=key)
    assert logs[0]["grad_norm"] > 0.5  # clipping acted, so the global norm over both stages mattered
    ce_keys = sorted(k for k in logs[0] if k.startswith("ce_t/"))
    assert ce_keys and ce_keys == sorted(k for k in pp_logs[0] if k.startswith("ce_t/"))
    for key in ce_keys + ["masked_fraction"]:
        torch.testing.assert_close(pp_logs[0][key], logs[0][key], rtol=1e-5, atol=1e-6, msg=key)
    # the final weights, written stage by stage, load as one model and equal the single process's
    loaded = DLMForDiffusionLM.from_pretrained(folder / "run" / "final")
    index = json.loads((folder / "run" / "final" / "model.safetensors.index.json").read_text())
    stages = 2 * len(record["stages"])
    assert sorted(set(index["weight_map"].values())) == [f"model-{i:05d}-of-{stages:05d}.safetensors"
                                                         for i in range(1, stages + 1)]
    expected = trainer.model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():  # Adam's 1/sqrt(v) amplifies reduction-order rounding in
        # rows with tiny gradients (measured 1.1e-5 on one lm_head row with the mdlm preset's SUBS head)
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=3e-5, msg=name)


def test_moe_pp2_trains_like_one_process(tmp_path):
    """A mixture-of-experts model (layer 0 dense, 1-3 sparse) on PP=2: the logged loss (router losses included),
    gradient norm and the routers' load-balancing and z losses equal a one-process run's."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.5,
               router_z_loss_coef=0.1, mlp_only_layers=[0])
    configs = {}
    for name, training in (("pp2", dict(save_strategy="no")),
                           ("pp1", dict(pp_size=1, per_device_train_batch_size=4, save_strategy="no"))):
        config = json.loads(json.dumps(CONFIG))
        config["model"]["config"].update(moe)
        config["training"].update(training, output_dir=str(tmp_path / name))
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        configs[name] = str(tmp_path / f"{name}.yaml")
    torchrun(os.path.join("tests", "pipeline_trainer_worker.py"), configs["pp2"], str(tmp_path / "out.json"),
             "--no-resume", nproc=2, timeout=300)
    pp_logs = json.loads((tmp_path / "out.json").read_text())["logs"]
    _, logs = _train(configs["pp1"])
    assert [log["step"] for log in pp_logs] == [log["step"] for log in logs] == [1, 2, 3, 4]
    assert logs[0]["aux_loss"] > 0 and logs[0]["router_z_loss"] > 0
    for key in ("loss", "grad_norm", "aux_loss", "router_z_loss"):
        torch.testing.assert_close(torch.tensor([log[key] for log in pp_logs]), torch.tensor([log[key] for log in logs]),
                                   rtol=1e-5, atol=1e-6, msg=key)


def test_resume_in_the_same_layout_equals_the_uninterrupted_run(pipeline_run):
    _, record = pipeline_run
    assert [log["step"] for log in record["resumed_logs"]] == [3, 4]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([log[key] for log in record["resumed_logs"]]),
                                   torch.tensor([log[key] for log in record["logs"][2:]]), rtol=1e-6, atol=1e-6)
    assert record["resume_gap"] < 1e-6  # every stage's weights, on every rank


def test_resume_pp2_checkpoint_with_pp1_equals_the_uninterrupted_run(pipeline_run, single_run, tmp_path):
    folder, _ = pipeline_run
    trainer, logs, _ = single_run
    checkpoint = folder / "run" / "checkpoint-2"
    assert (checkpoint / "optim_dcp").is_dir() and not (checkpoint / "optimizer.pt").exists()
    config = _write_config(tmp_path / "resume.yaml", output_dir=str(tmp_path / "run"), pp_size=1,
                           per_device_train_batch_size=4, save_strategy="no")
    resumed, resumed_logs = _train(config, resume=str(checkpoint))
    resumed_logs = [log for log in resumed_logs if log["step"] > 2]  # the history before comes from the checkpoint
    assert [log["step"] for log in resumed_logs] == [3, 4]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([log[key] for log in resumed_logs]),
                                   torch.tensor([log[key] for log in logs[2:]]), rtol=1e-5, atol=1e-6, msg=key)
    expected = trainer.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():  # tolerance: see test_pp2_trains_like_one_process
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=3e-5, msg=name)


@pytest.mark.parametrize("options, field", [
    (dict(pp_schedule="zero_bubble"), "pp_schedule"),
    (dict(pp_size=0), "pp_size"),
    (dict(pp_size=2, eval_strategy="steps", eval_steps=1), "eval_strategy"),
    (dict(pp_size=2, gradient_accumulation_steps=1), "gradient_accumulation_steps"),
    (dict(pp_size=2, gradient_accumulation_steps=2, fp16=True), "fp16"),
])
def test_unsupported_pipeline_options_are_refused_with_the_reason(tmp_path, options, field):
    with pytest.raises(ValueError, match=f"DLMTrainingArguments.{field} must be"):
        DLMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **options)


def test_pp_size_without_processes_is_refused(tmp_path):
    config = _write_config(tmp_path / "one.yaml", output_dir=str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match="pp_size=2 needs"):
        build_trainer(load_config(config), config)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_an_eval_dataset_is_refused_before_training(tmp_path):
    from hf_dlm import DLMTrainer
    from tests.utils import random_dataset
    from tests.utils import tiny_model

    args = DLMTrainingArguments(output_dir=str(tmp_path), use_cpu=True, pp_size=2, gradient_accumulation_steps=2,
                                report_to="none")
    with pytest.raises(ValueError, match="eval_dataset with pp_size > 1"):
        DLMTrainer(model=tiny_model(), args=args, train_dataset=random_dataset(4), eval_dataset=random_dataset(4))
