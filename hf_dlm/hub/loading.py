"""Loading a saved model for use: the one loader of `hf-dlm serve`, `hf-dlm eval` and the lm-eval model."""

from __future__ import annotations


def load_model(path: str, device: str | None = None, dtype: str = "auto", peft: str | None = None,
               fuse_projections: bool = False):
    """(model, tokenizer) from a checkpoint folder or Hub id, in eval mode on `device` (default: cuda if
    available, else cpu). dtype: "auto" (bfloat16 on cuda, float32 on cpu), "float32", "bfloat16" or
    "float16". peft: a LoRA adapter folder, merged into the weights. fuse_projections: q / k / v and gate / up
    as one layer each (`model.fuse_projections()`, faster small-batch decoding; a model without the method is
    left as it is)."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from ..utils.errors import FieldError

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto" and dtype not in dtypes:
        raise FieldError("dtype", f"dtype {dtype!r}: expected 'auto' or one of {sorted(dtypes)}", dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = dtypes.get(dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = AutoModelForMaskedLM.from_pretrained(path, dtype=torch_dtype)
    if peft:
        from ..utils.import_utils import require

        require("peft", "loading a LoRA adapter")
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft).merge_and_unload()
    if fuse_projections and hasattr(model, "fuse_projections"):
        model.fuse_projections()
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


__all__ = ["load_model"]
