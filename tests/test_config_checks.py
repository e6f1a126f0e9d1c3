"""Bad YAML config values (issue 29's classes, each a copy of a working config with one change): one line on
stderr naming section.field, the value and the expected type, exit status 2, before any data is built;
`--set` reaches keys at any depth."""

import pytest

from hf_dlm.cli import main as cli_main
from hf_dlm.data import builders
from hf_dlm.training.runner import ConfigError, build_trainer, load_config

MODEL = {"attn_implementation": "sdpa",
         "config": {"vocab_size": 99, "mask_token_id": 98, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "qk_norm": True, "max_position_embeddings": 64}}


def write_config(tmp_path, model=None, data=None, **training):
    import yaml

    options = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 2, "learning_rate": 1e-3,
               "per_device_train_batch_size": 4, "report_to": "none", "disable_tqdm": True, "save_strategy": "no",
               "eval_strategy": "no"}
    options.update(training)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": model or MODEL, "data": data or {"kind": "random", "seq_len": 16,
                                                                            "num_samples": 16},
                                    "training": options}))
    return str(path)


@pytest.fixture
def data_never_built(monkeypatch):
    def refuse(options, model_options):
        raise AssertionError("the data was built before the config was checked")

    monkeypatch.setitem(builders.DATA_BUILDERS, "random", refuse)


def one_line(capsys, argv):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("section,field,value,expected", [
    ("training", "max_steps", "twenty", "training.max_steps = 'twenty': expected an integer"),
    ("training", "learning_rate", [1, 2], "training.learning_rate = [1, 2]: expected a number"),
    ("training", "use_cpu", "perhaps", "training.use_cpu = 'perhaps': expected true or false"),
    ("model", "hidden_size", "big", "model.config.hidden_size = 'big': expected an integer"),
    ("model", "qk_norm", "maybe", "model.config.qk_norm = 'maybe': expected true or false"),
    ("model", "rms_norm_eps", None, "model.config.rms_norm_eps = None: expected a number"),
])
def test_a_value_of_the_wrong_type_is_named_before_any_data_is_built(tmp_path, capsys, data_never_built, section,
                                                                     field, value, expected):
    if section == "training":
        path = write_config(tmp_path, **{field: value})
    else:
        path = write_config(tmp_path, model={**MODEL, "config": {**MODEL["config"], field: value}})
    err = one_line(capsys, ["train", path])
    assert err == f"hf-dlm train: {path}: {expected}"
    with pytest.raises(ConfigError) as error:  # the field travels with the error, not only in its text
        build_trainer(load_config(path), path)
    assert error.value.field == ("training." if section == "training" else "model.config.") + field
    assert error.value.value == value


@pytest.mark.parametrize("field,value,expected", [
    ("attention_mode", "sideways", "DLMConfig.attention_mode must be one of"),
    ("hidden_size", 30, "DLMConfig.hidden_size (30) must be divisible by num_attention_heads (4)"),
    ("moe_router", "random", "model.config.moe_router: DLMConfig.moe_router must be one of"),
])
def test_model_config_checks_run_before_the_data(tmp_path, capsys, data_never_built, field, value, expected):
    path = write_config(tmp_path, model={**MODEL, "config": {**MODEL["config"], field: value}})
    err = one_line(capsys, ["train", path])
    assert err.startswith(f"hf-dlm train: {path}: model.config") and expected in err, err


def test_numbers_yaml_reads_as_strings_still_pass(tmp_path, data_never_built):
    """YAML 1.1 reads 3e-4 (no dot) as a string; the check converts it for number fields before judging."""
    path = write_config(tmp_path, learning_rate="3e-4", lr_scheduler_type="cosine", resume_from_checkpoint=False)
    with pytest.raises(AssertionError, match="the data was built"):  # got past every check to the data
        build_trainer(load_config(path), path)


def test_set_reaches_keys_at_any_depth(tmp_path):
    path = write_config(tmp_path)
    config = load_config(path, ["model.config.hidden_size=48", "model.config.rope_parameters.rope_theta=5000",
                                "training.max_steps=1"])
    assert config["model"]["config"]["hidden_size"] == 48
    assert config["model"]["config"]["rope_parameters"] == {"rope_theta": 5000}
    with pytest.raises(ConfigError, match=r"--set 'training.max_steps.x=1': training.max_steps is 2, not a mapping"):
        load_config(path, ["training.max_steps.x=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["training..x=1"])


def test_set_model_config_hidden_size_trains_a_model_of_that_size(tmp_path, capsys):
    from transformers import AutoConfig

    import hf_dlm  # noqa: F401

    path = write_config(tmp_path)
    assert cli_main(["train", path, "--set", "model.config.hidden_size=48", "--set", "training.max_steps=1"]) == 0
    saved = AutoConfig.from_pretrained(tmp_path / "out" / "final")
    assert saved.hidden_size == 48 and saved.qk_norm is True


def test_an_explicit_mask_token_id_is_never_replaced_by_the_corpus_tokenizers(tmp_path, capsys):
    """The corpus tokenizer trained for the run has its own ids: a config that says otherwise is refused by
    name, and `--set model.config.mask_token_id=<the tokenizer's>` is accepted."""
    model = {"config": {k: v for k, v in MODEL["config"].items() if k not in ("vocab_size", "mask_token_id")}}
    model["config"]["mask_token_id"] = 151669
    path = write_config(tmp_path, model=model, data={"kind": "corpus", "max_files": 3, "vocab_size": 300,
                                                     "seq_len": 32, "eval_windows": 0})
    err = one_line(capsys, ["train", path])
    assert "model.config.mask_token_id = 151669, but the corpus tokenizer's mask_token_id is" in err
    mask_id = int(err.rsplit("set it to ", 1)[1].rstrip(")"))
    trainer, tokenizer = build_trainer(load_config(path, [f"model.config.mask_token_id={mask_id}"]), path)
    assert trainer.model.config.mask_token_id == tokenizer.mask_token_id == mask_id
