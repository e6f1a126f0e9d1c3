"""`model.generate` with transformers' semantics: its options, their validation, the saved config, and
the default sampler against LLaDA's reference loop (ML-GSAI/LLaDA generate.py), re-stated here."""

import json

import pytest
import torch

from hf_dlm import DLMForDiffusionLM, DLMGenerationConfig
from hf_dlm.generation.sampling import add_gumbel_noise

from tests.utils import MASK_ID, VOCAB, tiny_model
from tests.utils import SCRIPTED_EOS as EOS
from tests.utils import ScriptedModel, peaked

PROMPT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2)


def llada_reference(model, prompt, steps, gen_length, block_length, mask_id):
    """LLaDA's sampler at temperature 0 with low-confidence remasking, one row at a time; the mask token
    is no candidate (hf-dlm's one documented difference: an untrained model may rank it first)."""
    rows = []
    for row in prompt:
        x = torch.cat([row, torch.full((gen_length,), mask_id)]).unsqueeze(0)
        start = row.shape[0]
        steps_per_block = steps // (gen_length // block_length)
        for block in range(gen_length // block_length):
            lo, hi = start + block * block_length, start + (block + 1) * block_length
            masked_count = int((x[0, lo:hi] == mask_id).sum())
            counts = [masked_count // steps_per_block + (i < masked_count % steps_per_block)
                      for i in range(steps_per_block)]
            for i in range(steps_per_block):
                mask_index = x == mask_id
                with torch.no_grad():
                    logits = model(input_ids=x).logits.double()
                logits[..., mask_id] = -torch.inf
                x0 = logits.argmax(-1)
                p = torch.softmax(logits, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
                p[:, hi:] = -torch.inf
                confidence = torch.where(mask_index, p, torch.tensor(-torch.inf, dtype=p.dtype))
                if counts[i]:
                    chosen = confidence[0].topk(counts[i]).indices
                    x[0, chosen] = x0[0, chosen]
        rows.append(x[0])
    return torch.stack(rows)


@pytest.mark.parametrize("steps,block_length", [(16, 16), (8, 4), (16, 8)])
def test_default_sampler_is_llada_reference_token_for_token(model, steps, block_length):
    eos = int(tiny_model(seed=2).generate(PROMPT[:1], max_new_tokens=16, steps=16)[0, 6])  # a token it emits
    model.config.eos_token_id = eos  # stop_on_eos is opt-in: the default never stops early
    try:
        out = model.generate(PROMPT, max_new_tokens=16, steps=steps, block_length=block_length)
    finally:
        model.config.eos_token_id = None
    expected = llada_reference(model, PROMPT, steps, 16, block_length, MASK_ID)
    assert torch.equal(out, expected)


def test_stop_on_eos_is_opt_in_and_means_a_block_ending_in_an_eos_run():
    completions = {1: [7, EOS, EOS, EOS, 9, 9, 9, 9], 2: [EOS, 7, EOS, EOS, 9, 9, 9, 9]}
    tables = {k: peaked(torch.tensor([0] + v), torch.linspace(5, 1, 9)) for k, v in completions.items()}
    scripted = ScriptedModel(lambda ids: torch.stack([tables[int(r[0])][: ids.shape[1]] for r in ids]),
                             eos_token_id=[EOS, 3])  # a list of EOS ids: the first fills a finished tail
    options = dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.0)
    default = scripted.generate(torch.tensor([[1], [2]]), **options)
    assert default[:, 1:].tolist() == [completions[1], completions[2]]  # LLaDA: decoding goes on
    stopped = scripted.generate(torch.tensor([[1], [2]]), stop_on_eos=True, **options)
    # row 1's first block ends in an EOS run: done, tail filled with EOS; row 2's has a token after its first EOS
    assert stopped[:, 1:].tolist() == [[7, EOS, EOS, EOS] + [EOS] * 4, completions[2]]


def test_num_return_sequences_returns_adjacent_sampled_copies(model):
    generator = torch.Generator().manual_seed(0)
    out = model.generate(PROMPT, max_new_tokens=8, steps=8, temperature=1.0, num_return_sequences=3,
                         generator=generator)
    assert out.shape == (6, 12)
    assert torch.equal(out[:, :4], PROMPT.repeat_interleave(3, 0))
    again = model.generate(PROMPT.repeat_interleave(3, 0), max_new_tokens=8, steps=8, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert len({tuple(r) for r in out[:3, 4:].tolist()}) > 1  # the copies are distinct samples
    with pytest.raises(ValueError, match="num_return_sequences"):  # greedy copies would be identical
        model.generate(PROMPT, max_new_tokens=8, num_return_sequences=2)


def test_do_sample_false_is_greedy_whatever_the_temperature(model):
    greedy = model.generate(PROMPT, max_new_tokens=8, steps=8, temperature=0.0)
    for seed in (0, 1):
        out = model.generate(PROMPT, max_new_tokens=8, steps=8, temperature=1.5, do_sample=False,
                             generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out, greedy)
    sampled = model.generate(PROMPT, max_new_tokens=8, steps=8, temperature=1.5,
                             generator=torch.Generator().manual_seed(0))
    assert not torch.equal(sampled, greedy)  # a temperature alone turns sampling on


def test_max_length_generation_config_and_kwargs(model):
    assert model.generate(PROMPT, max_length=10, steps=6).shape == (2, 10)  # prompt 4 + 6 new
    assert model.generate(PROMPT, max_length=10, max_new_tokens=4).shape == (2, 8)  # max_new_tokens wins
    assert model.generate(PROMPT).shape == (2, 4 + 64)  # neither: 64 new tokens
    with pytest.raises(ValueError, match="max_length=3 leaves no room"):
        model.generate(PROMPT, max_length=3)
    config = DLMGenerationConfig(max_new_tokens=4, steps=2, block_length=2)
    assert model.generate(PROMPT, generation_config=config).shape == (2, 8)
    assert model.generate(PROMPT, generation_config=config, max_new_tokens=6, steps=3).shape == (2, 10)


@pytest.mark.parametrize("options,named", [
    (dict(num_beams=2), "num_beams=2"), (dict(repetition_penalty=1.3), "repetition_penalty=1.3"),
    (dict(no_repeat_ngram_size=2, min_new_tokens=3), "no_repeat_ngram_size=2, min_new_tokens=3"),
    (dict(output_scores=True), "output_scores=True"),
])
def test_options_a_diffusion_sampler_cannot_honour_are_rejected_by_name(model, options, named):
    with pytest.raises(ValueError, match=f"not supported by the diffusion sampler: {named}"):
        model.generate(PROMPT, max_new_tokens=4, **options)


def test_unknown_keywords_are_named(model):
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['gen_lenght'\]"):
        model.generate(PROMPT, gen_lenght=4)


@pytest.mark.parametrize("options,field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(steps=0), "steps"), (dict(block_length=0), "block_length"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(top_k=-1), "top_k"), (dict(threshold=1.5), "threshold"), (dict(cfg_scale=-1.0), "cfg_scale"),
    (dict(num_return_sequences=0), "num_return_sequences"),
])
def test_ranges_are_validated(model, options, field):
    with pytest.raises(ValueError, match=field):  # transformers' own check or DLMGenerationConfig's
        model.generate(PROMPT, **options)


def test_prompt_plus_new_tokens_must_fit_the_positions(model):
    limit = model.config.max_position_embeddings
    assert model.generate(PROMPT, max_new_tokens=limit - 4, steps=1, block_length=limit - 4).shape[1] == limit
    with pytest.raises(ValueError, match=f"= {limit + 1} exceeds the model's max_position_embeddings"):
        model.generate(PROMPT, max_new_tokens=limit - 3)


def test_checkpoints_save_a_dlm_generation_config(tmp_path):
    built = tiny_model()
    assert isinstance(built.generation_config, DLMGenerationConfig)
    built.generation_config.steps = 12
    built.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["steps"] == 12 and saved["remasking"] == "low_confidence" and saved["stop_on_eos"] is False
    loaded = DLMForDiffusionLM.from_pretrained(tmp_path)  # before: generation_config.json was never read
    assert isinstance(loaded.generation_config, DLMGenerationConfig) and loaded.generation_config.steps == 12
    assert loaded.generate(torch.tensor([[1, 2]]), max_new_tokens=12, block_length=12).shape == (1, 14)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_frequencies_follow_softmax_over_temperature(temperature):
    logits = torch.tensor([[1.0, 0.2, -0.5, -2.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([add_gumbel_noise(logits, temperature, generator).argmax(-1) for _ in range(20000)])
    frequencies = torch.bincount(draws.flatten(), minlength=4).double() / draws.numel()
    expected = torch.softmax(logits[0].double() / temperature, -1)
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.012)
    assert VOCAB > 4  # (the model fixtures above use the shared tiny vocabulary)
