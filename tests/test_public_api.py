"""The public API: lazy top-level names (transformers' way), a cheap `import hf_dlm`, cheap `--help`,
and every README snippet's imports."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_dlm

ROOT = Path(__file__).resolve().parents[1]
NEVER_ON_IMPORT = ("trl", "peft", "datasets", "flash_attn", "lm_eval", "fastapi")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print('\\nMODULES', *sys.modules)"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.rsplit("MODULES", 1)[1].split())  # after any --help text


def test_import_hf_dlm_imports_no_optional_or_heavy_module():
    loaded = _modules_after("import hf_dlm")
    assert not loaded & set(NEVER_ON_IMPORT), loaded & set(NEVER_ON_IMPORT)
    # only the model classes (for the Auto registration) and the lazy-export helper load eagerly
    ours = {m for m in loaded if m.startswith("hf_dlm.")}
    assert not {m for m in ours if m.split(".")[1] in ("training", "data", "parallel", "conversion", "commands")}, ours


def test_every_public_name_resolves_lazily_and_is_listed():
    assert "DLMTrainer" in hf_dlm.__all__ and set(hf_dlm.__all__) <= set(dir(hf_dlm))
    for name in hf_dlm.__all__:
        assert getattr(hf_dlm, name) is not None, name
    from hf_dlm import DLMTrainer, DLMTrainingArguments, parallelize_dlm
    from hf_dlm.parallel.parallelize import parallelize_dlm as defined
    from hf_dlm.training.trainer import DLMTrainer as trainer_class
    from hf_dlm.training.training_args import DLMTrainingArguments as args_class

    assert (DLMTrainer, DLMTrainingArguments, parallelize_dlm) == (trainer_class, args_class, defined)
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        hf_dlm.NotAName  # noqa: B018
    for package in ("data", "training", "parallel", "conversion", "serving", "evaluation"):
        module = __import__(f"hf_dlm.{package}", fromlist=["_"])
        for name in module.__all__:
            assert getattr(module, name) is not None, f"hf_dlm.{package}.{name}"


def test_first_access_imports_only_its_module():
    loaded = _modules_after("from hf_dlm import elbo_nll")
    assert "hf_dlm.diffusion.elbo" in loaded and "hf_dlm.training.trainer" not in loaded


@pytest.mark.parametrize("command", ["quickstart", "preprocess", "train", "sft", "grpo", "generate", "convert", "verify",
                                     "serve", "eval"])
def test_subcommand_help_imports_no_heavy_module(command, modules_of_import_hf_dlm):
    loaded = _modules_after(
        "from hf_dlm.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass")
    heavy = loaded & {*NEVER_ON_IMPORT, "hf_dlm.training.trainer", "hf_dlm.training.runner"}
    # pyarrow: only what `import hf_dlm` itself loads (transformers 5.17 pulls it in through scipy / pandas)
    heavy |= (loaded - modules_of_import_hf_dlm) & {"pyarrow"}
    assert not heavy, heavy


@pytest.fixture(scope="module")
def modules_of_import_hf_dlm():
    return _modules_after("import hf_dlm")


def test_version_flag():
    out = subprocess.run([sys.executable, "-m", "hf_dlm.cli", "--version"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"hf-dlm {hf_dlm.__version__}"
