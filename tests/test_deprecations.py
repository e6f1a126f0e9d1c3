"""hf-dlm's own calls raise no transformers deprecation warning (5.24+ renamed gradient_checkpointing to
activation_checkpointing and warns on the old names), and activation checkpointing is still applied once."""

import warnings

import pytest
import torch

from hf_dlm.utils.transformers_compat import (
    activation_checkpointing_requested,
    default_activation_checkpointing,
    hand_activation_checkpointing_over,
)
from tests.utils import make_args, make_trainer, tiny_model


@pytest.fixture
def strict():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


def test_every_arguments_class_builds_without_a_future_warning(tmp_path, strict):
    from hf_dlm.training.grpo_config import DiffuGRPOConfig
    from hf_dlm.training.sft_config import DLMSFTConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for args in (make_args(tmp_path), DLMSFTConfig(**common), DiffuGRPOConfig(**common, num_generations=2,
                                                                               per_device_train_batch_size=2)):
        assert activation_checkpointing_requested(args) is False  # the DLM default (trl's parents say True)


def test_defaults_resolve_under_the_name_this_transformers_reads():
    class Args:  # a dataclass after its own fields, before the parent's __post_init__
        gradient_checkpointing = None
        activation_checkpointing = None

    args = Args()
    default_activation_checkpointing(args, False)
    assert args.activation_checkpointing is False and args.gradient_checkpointing is None

    class OldArgs:  # transformers < 5.24: only the old name
        gradient_checkpointing = None

    old = OldArgs()
    default_activation_checkpointing(old, True)
    assert old.gradient_checkpointing is True and activation_checkpointing_requested(old)

    hand_activation_checkpointing_over(args)  # the Trainer must not re-apply what hf-dlm applied
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False


def test_a_checkpointed_training_step_and_the_models_flag_warn_nothing(tmp_path):
    name = "activation_checkpointing" if hasattr(make_args(tmp_path), "activation_checkpointing") else \
        "gradient_checkpointing"
    trainer = make_trainer(tmp_path, max_steps=1, **{name: True})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer.train()
        model = trainer.model
        assert model.is_gradient_checkpointing is True  # trl and peft read this name
    assert tiny_model().is_gradient_checkpointing is False
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
