"""Hub export: remote code generated from hf-dlm's source, loading where hf_dlm cannot be imported,
model card, and the upload call (Hub API mocked: no network)."""

import ast
import json
import os
import subprocess
import sys
import textwrap

import huggingface_hub
import torch
from transformers import AutoModelForMaskedLM

from hf_dlm import DLMForDiffusionLM
from hf_dlm.cli import main as cli_main
from hf_dlm.hub.publish import prepare_hub_folder, push_to_hub
from hf_dlm.hub.remote_code import AUTO_MAP, generate_remote_code
from tests.utils import tiny_model

# Run in a fresh interpreter where `import hf_dlm` raises, so only the repository's own files can serve.
LOAD_WITHOUT_HF_DLM = textwrap.dedent("""
    import sys
    sys.modules["hf_dlm"] = None  # any import of hf_dlm now raises ImportError
    import torch
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True, attn_implementation="eager").eval()
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    generated = model.generate(input_ids=ids[:1, :4], max_new_tokens=4, steps=4, block_length=4, temperature=0.0)
    model.save_pretrained(sys.argv[3] + ".resaved")  # transformers copies the flat files on: still self-contained
    again = AutoModelForMaskedLM.from_pretrained(sys.argv[3] + ".resaved", trust_remote_code=True,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        # a few fp32 ulps allowed: reloaded weights sit at other alignments (other CPU SIMD paths)
        torch.testing.assert_close(again(input_ids=ids).logits, logits, rtol=0, atol=1e-6)
    torch.save({"logits": logits, "module": type(model).__module__, "generated": generated}, sys.argv[3])
    try:
        import hf_dlm  # noqa: F401
        raise SystemExit("hf_dlm was importable")
    except ImportError:
        pass
""")


def test_generated_code_is_flat_and_comes_from_the_source():
    files = generate_remote_code()
    assert set(files) == {"configuration_dlm.py", "modeling_dlm.py"}
    for name, source in files.items():
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 or node.module == "configuration_dlm", (name, ast.unparse(node))
                assert not (node.module or "").startswith("hf_dlm"), (name, ast.unparse(node))
    modeling = files["modeling_dlm.py"]
    # every module the model imports is pasted in, read from hf-dlm's files at export time
    for module in ("modeling/masks.py", "modeling/loss.py", "generation/sampler.py", "modeling/modeling_dlm.py"):
        assert f"# ---- from hf_dlm/{module} ----" in modeling
    import hf_dlm.modeling.masks as masks

    assert __import__("inspect").getsource(masks.make_mask_mod) in modeling
    assert "save_with_remote_code" not in modeling and "hub.publish" not in modeling  # hf-dlm-only hooks stay out


def test_saved_model_loads_without_hf_dlm(tmp_path):
    model = tiny_model(attn_implementation="eager", qkv_bias=True)
    model.save_pretrained(tmp_path / "repo")
    config = json.loads((tmp_path / "repo" / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    ids = torch.randint(0, 98, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the checkout is not on the path either
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HF_DLM, str(tmp_path / "repo"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["module"].startswith("transformers_modules.")
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(input_ids=ids).logits, atol=1e-6, rtol=0)
        expected = model.generate(input_ids=ids[:1, :4], max_new_tokens=4, steps=4, block_length=4, temperature=0.0)
    assert torch.equal(out["generated"], expected)


def test_hf_dlm_installed_uses_its_own_classes(tmp_path):
    tiny_model().save_pretrained(tmp_path / "repo")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "repo")
    assert type(loaded) is DLMForDiffusionLM


def test_prepare_folder_and_push_with_mocked_hub(tmp_path, monkeypatch):
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = sorted(os.listdir(folder_path))
        card = huggingface_hub.ModelCard.load(os.path.join(folder_path, "README.md"))
        calls.append(("upload_folder", repo_id, files, card.data.to_dict(), card.text, kwargs))
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    model = tiny_model()
    training = {"steps": 1000, "objective": "masked diffusion (llada preset)", "learning_rate": 3e-4}
    assert push_to_hub(model, "user/tiny-dlm", base_model="Qwen/Qwen3-0.6B", training_details=training, private=True) == "commit-info"
    (_, repo, create_kwargs), (_, repo2, files, meta, text, upload_kwargs) = calls
    assert repo == repo2 == "user/tiny-dlm" and create_kwargs["private"] is True
    assert {"config.json", "model.safetensors", "configuration_dlm.py", "modeling_dlm.py", "README.md"} <= set(files)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "fill-mask"
    assert meta["base_model"] == "Qwen/Qwen3-0.6B" and "custom_code" in meta["tags"]
    assert "## Training details" in text and "3e-4" in text.replace("0.0003", "3e-4")
    assert "trust_remote_code=True" in text and '"user/tiny-dlm"' in text

    # model.push_to_hub goes the same way, with transformers' argument names
    calls.clear()
    model.push_to_hub("user/direct", commit_message="first", private=False, tags=["my-tag"], base_model="org/b")
    (_, _, create_kwargs), (_, _, files, meta, _, upload_kwargs) = calls
    assert upload_kwargs["commit_message"] == "first" and create_kwargs["private"] is False
    assert "my-tag" in meta["tags"] and meta["base_model"] == "org/b" and "modeling_dlm.py" in files

    # save_pretrained(push_to_hub=True) uploads only once the remote code is written
    calls.clear()
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="user/other")
    assert calls[-1][0] == "upload_folder" and "modeling_dlm.py" in calls[-1][2]

    folder = prepare_hub_folder(model, tmp_path / "prepared", base_model="org/base")
    assert huggingface_hub.ModelCard.load(folder / "README.md").data.base_model == "org/base"

    # the CLI: convert, then upload the converted folder
    calls.clear()
    assert cli_main(["convert", "--from", "dlm", str(folder), str(tmp_path / "cli"), "--base-model", "org/base",
                     "--push-to-hub", "user/cli", "--private"]) == 0
    (_, repo, create_kwargs), (_, _, files, meta, _, upload_kwargs) = calls
    assert repo == "user/cli" and create_kwargs["private"] is True and meta["base_model"] == "org/base"
    assert "modeling_dlm.py" in files and "--from dlm" in upload_kwargs["commit_message"]
    # a Megatron target cannot be pushed: refused before any conversion work or output folder
    import pytest

    with pytest.raises(SystemExit, match="push-to-hub"):
        cli_main(["convert", "--to", "megatron", str(folder), str(tmp_path / "mega"), "--push-to-hub", "user/m",
                  "--debug"])
    assert cli_main(["convert", "--to", "megatron", str(folder), str(tmp_path / "mega"), "--push-to-hub", "user/m"]) == 2
    assert not (tmp_path / "mega").exists()


def test_failed_export_keeps_the_checkpoint_and_warns(tmp_path, monkeypatch):
    import pytest

    import hf_dlm.hub.remote_code as remote_code

    def broken():
        raise ImportError("a bundled module needs liger_kernel")

    monkeypatch.setattr(remote_code, "generate_remote_code", broken)
    model = tiny_model()
    with pytest.warns(UserWarning, match="saved without remote code"):
        model.save_pretrained(tmp_path / "repo")
    assert not (tmp_path / "repo" / "modeling_dlm.py").exists()
    assert "auto_map" not in json.loads((tmp_path / "repo" / "config.json").read_text())
    reloaded = DLMForDiffusionLM.from_pretrained(tmp_path / "repo")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ImportError, match="liger_kernel"):  # a Hub folder without its code is an error
        prepare_hub_folder(model, tmp_path / "hub")


def _write_package(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_flattening_rules_on_a_synthetic_package(tmp_path, monkeypatch):
    """What teammates may add to the modeling code: imports from other sub-packages, aliases, imports
    inside functions, a sibling-config import; all must flatten into two loadable files."""
    import pytest

    _write_package(tmp_path, {
        "fakedlm/__init__.py": "",
        "fakedlm/utils/__init__.py": "",
        "fakedlm/utils/helpers.py": "SCALE = 3\n\n\ndef scaled(x):\n    return x * SCALE\n",
        "fakedlm/modeling/__init__.py": "",
        "fakedlm/modeling/config_x.py": "from ..utils.helpers import SCALE\n\n\nclass Cfg:\n    size = SCALE\n",
        "fakedlm/modeling/kernels.py": "def fast(x):\n    return x + 1\n",
        "fakedlm/modeling/model_x.py": '''
            from __future__ import annotations

            from ..utils.helpers import scaled as times_scale  # an alias across sub-packages
            from .config_x import Cfg


            class Model:
                def run(self, x):
                    from .kernels import fast  # lazy import inside a function
                    from .kernels import fast as quick
                    return quick(fast(times_scale(x))) + Cfg.size

            __all__ = ["Model"]
        ''',
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    files = generate_remote_code("fakedlm.modeling.config_x", "fakedlm.modeling.model_x")
    for text in files.values():
        imported = [n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)]
        assert not any("fakedlm" in (m or "") or m in ("kernels", "config_x") for m in imported), imported
    (tmp_path / "flat").mkdir()
    for name, text in files.items():
        (tmp_path / "flat" / name).write_text(text)
    (tmp_path / "flat" / "__init__.py").write_text("")
    import importlib

    flat = importlib.import_module("flat.modeling_dlm")
    assert flat.Model().run(2) == (2 * 3 + 1 + 1) + 3

    # two different top-level definitions of one name cannot share a flat file
    (tmp_path / "fakedlm/modeling/kernels.py").write_text("SCALE = 4\n\n\ndef fast(x):\n    return x + SCALE\n")
    (tmp_path / "fakedlm/modeling/other.py").write_text("SCALE = 5\n")
    (tmp_path / "fakedlm/modeling/model_x.py").write_text(
        "from .other import SCALE\nfrom .kernels import fast\n\n\ndef run(x):\n    return fast(x) * SCALE\n")
    with pytest.raises(NameError, match="SCALE"):
        generate_remote_code("fakedlm.modeling.config_x", "fakedlm.modeling.model_x")
