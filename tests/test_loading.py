"""`hf_dlm.load_model`: the one loader of `hf-dlm serve`, `hf-dlm eval` and the lm-eval model (a library
function, not a command's)."""

import pytest
import torch

from hf_dlm.utils.errors import FieldError
from tests.utils import save_tiny_checkpoint


def test_load_model_returns_the_saved_weights_in_eval_mode_and_names_a_bad_dtype(tmp_path):
    from hf_dlm import load_model

    saved, tokenizer = save_tiny_checkpoint(tmp_path)
    model, loaded_tokenizer = load_model(str(tmp_path), device="cpu")
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert len(loaded_tokenizer) == len(tokenizer)
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)  # a copy of the stored values
    half, _ = load_model(str(tmp_path), device="cpu", dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16
    with pytest.raises(FieldError, match="dtype 'float64'") as error:
        load_model(str(tmp_path), dtype="float64")
    assert error.value.field == "dtype"
