"""Model card (README.md) of an exported hf-dlm model: Hub metadata plus what the model is and how it
was made (base model, conversion, training details), rendered with `huggingface_hub.ModelCard`."""

from __future__ import annotations

import json
import os
from pathlib import Path

INFO_FILE = "hf_dlm_info.json"  # provenance written by `hf-dlm convert` (and any trainer that wants to)


def read_info(folder: str | os.PathLike) -> dict:
    path = Path(folder) / INFO_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error


def write_info(folder: str | os.PathLike, **fields) -> None:
    """Merge `fields` into the folder's provenance file."""
    info = read_info(folder)
    info.update({key: value for key, value in fields.items() if value is not None})
    (Path(folder) / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _table(rows: dict) -> str:
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {key} | `{json.dumps(value) if not isinstance(value, str) else value}` |" for key, value in rows.items()]
    return "\n".join(lines)


def build_model_card(
    config,
    base_model: str | None = None,
    training_details: dict | None = None,
    info: dict | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    pipeline_tag: str = "fill-mask",
    title: str | None = None,
    tags: list[str] | None = None,
):
    """A `huggingface_hub.ModelCard` for a DLM. `info` is the provenance file's content (conversion and
    training records); explicit `base_model` / `training_details` take precedence over it. The default
    `pipeline_tag` is "fill-mask": its pipeline loads through AutoModelForMaskedLM, which a DLM registers
    ("text-generation" loads AutoModelForCausalLM and fails)."""
    from huggingface_hub import ModelCard, ModelCardData

    info = dict(info or {})
    base_model = base_model or info.get("base_model")
    training = {**info.get("training", {}), **(training_details or {})}
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        base_model=base_model,
        license=license,
        tags=["hf-dlm", "diffusion-language-model", "masked-diffusion", "custom_code", *(tags or [])],
    )
    name = repo_id or title or "hf-dlm model"
    architecture = {
        "attention_mode": config.attention_mode,
        "label_alignment": config.label_alignment,
        "mask_token_id": config.mask_token_id,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "qk_norm": config.qk_norm,
        "qkv_bias": config.qkv_bias,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": config.rope_parameters,
    }
    sections = [
        f"# {name}",
        "A masked-diffusion language model in the hf-dlm format (`model_type = \"dlm\"`). "
        "The repository carries its own modeling code, generated from hf-dlm's source, so it loads without "
        "hf-dlm installed:",
        "```python\nfrom transformers import AutoModelForMaskedLM, AutoTokenizer\n\n"
        f"model = AutoModelForMaskedLM.from_pretrained({json.dumps(repo_id or 'PATH')}, trust_remote_code=True)\n"
        # without hf-dlm, AutoTokenizer reads config.json's unknown model_type "dlm" through its auto_map too
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(repo_id or 'PATH')}, trust_remote_code=True)\n"
        "prompt = tokenizer(\"Hello\", return_tensors=\"pt\")\n"
        "out = model.generate(**prompt, max_new_tokens=32, steps=32)\n"
        "print(tokenizer.decode(out[0, prompt[\"input_ids\"].shape[1]:], skip_special_tokens=True))\n```",
        "## Architecture\n\n" + _table(architecture),
    ]
    if base_model:
        sections.append(f"## Base model\n\nConverted from [`{base_model}`](https://huggingface.co/{base_model}).")
    if info.get("conversion"):
        sections.append("## Conversion\n\n" + _table(info["conversion"]))
    if training:
        sections.append("## Training details\n\n" + _table(training))
    else:
        sections.append("## Training details\n\nNo training after conversion is recorded for this checkpoint.")
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)


def write_model_card(folder: str | os.PathLike, config, **options) -> Path:
    options.setdefault("title", Path(folder).resolve().name)
    card = build_model_card(config, info=read_info(folder), **options)
    path = Path(folder) / "README.md"
    card.save(path)
    return path


__all__ = ["INFO_FILE", "read_info", "write_info", "build_model_card", "write_model_card"]
