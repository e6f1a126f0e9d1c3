"""The diffusion samplers' arithmetic, pinned with hand-built models whose logits are scripted."""

import pytest
import torch

from hf_dlm.generation.commit_rules import threshold_commits
from hf_dlm.generation.sampling import finished_rows, num_transfer_tokens
from tests.utils import SCRIPTED_EOS as EOS
from tests.utils import SCRIPTED_MASK as MASK
from tests.utils import SCRIPTED_VOCAB as VOCAB
from tests.utils import ScriptedModel, peaked


def by_position(tokens, scores):
    """A script predicting tokens[j] with score scores[j] at canvas position j, whatever the input."""
    table = peaked(torch.tensor(tokens), torch.tensor(scores, dtype=torch.float))
    return lambda ids: table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


def commit_trace(model, prompt, **kwargs):
    """Canvas snapshots after every forward -> list of the sets of positions committed at each step."""
    snapshots = []
    out = model.generate(prompt, callback=lambda canvas, step, block: snapshots.append(canvas.clone()),
                         temperature=0.0, **kwargs)
    previous = torch.cat([prompt, torch.full((1, out.shape[1] - prompt.shape[1]), MASK)], 1)
    trace = []
    for canvas in snapshots:
        trace.append(set(((canvas[0] != MASK) & (previous[0] == MASK)).nonzero().flatten().tolist()))
        previous = canvas
    return out, trace


def test_num_transfer_tokens_spreads_the_remainder_over_the_first_steps():
    assert num_transfer_tokens(torch.tensor([10, 3, 8]), 4).tolist() == [[3, 3, 2, 2], [1, 1, 1, 0], [2, 2, 2, 2]]


def test_commit_order_follows_confidence_and_stays_in_the_block():
    # prompt of 2 tokens, then 8 masks in 2 blocks; position 6 is the most confident of all but in block 2
    scores = [0, 0, 1, 5, 3, 2, 9, 0.5, 4, 7]
    model = ScriptedModel(by_position(list(range(10)), scores))
    out, trace = commit_trace(model, torch.tensor([[1, 1]]), max_new_tokens=8, block_length=4, steps=8)
    assert trace == [{3}, {4}, {5}, {2}, {6}, {9}, {8}, {7}]
    assert out[0, 2:].tolist() == list(range(2, 10))


def test_tokens_per_step_is_the_llada_budget():
    model = ScriptedModel(by_position(list(range(12)), list(range(12))))
    _, trace = commit_trace(model, torch.tensor([[1, 1]]), max_new_tokens=10, steps=4)
    assert [len(t) for t in trace] == [3, 3, 2, 2]
    _, trace = commit_trace(model, torch.tensor([[1, 1]]), max_new_tokens=10, block_length=5, steps=4)
    assert [len(t) for t in trace] == [3, 2, 3, 2]
    assert set().union(*trace[:2]) == set(range(2, 7))  # block 1 finishes before block 2 starts


def test_threshold_commits_everything_above_tau_and_at_least_the_best():
    assert threshold_commits(torch.tensor([[0.5, 0.3, 0.7, -torch.inf]]), 0.5).tolist() == [[True, False, True, False]]
    assert threshold_commits(torch.tensor([[0.2, 0.3, 0.1]]), 0.9).tolist() == [[False, True, False]]
    # p(token 3) = 0.9, 0.6, 0.8, 0.55 at the four masks, tau 0.7: step 1 takes 0.9 and 0.8, then the best
    probs = torch.tensor([0.9, 0.6, 0.8, 0.55])
    def script(ids):
        logits = torch.full((ids.shape[1], VOCAB), -1e4)
        logits[:, 0] = 0.0
        logits[1:, 3] = (probs / (1 - probs)).log()  # softmax over {0, 3}: p(3) = probs
        return logits.expand(ids.shape[0], -1, -1)
    model = ScriptedModel(script)
    out, trace = commit_trace(model, torch.tensor([[1]]), max_new_tokens=4, threshold=0.7, steps=4)
    assert trace == [{1, 3}, {2}, {4}] and out[0, 1:].tolist() == [3, 3, 3, 3]
    assert len(model.inputs) == 3


def test_cfg_combines_cond_and_uncond_with_the_prompt_masked():
    def script(ids):
        uncond = (ids[:, 1:2] == MASK).view(-1, 1, 1)  # a real prompt token masked = the unconditional copy
        logits = torch.full((*ids.shape, VOCAB), -1e4)
        logits[..., 0] = 2.0
        logits[..., 1] = torch.where(uncond, torch.tensor(0.0), torch.tensor(1.5)).squeeze(-1)
        return logits
    model = ScriptedModel(script)
    prompt = torch.tensor([[0, 7, 8], [5, 6, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    # un + (s + 1)(cond - un) = [2, 0] + 2 * [0, 1.5] = [2, 3]: token 1; cond alone would give token 0
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=2, steps=2, cfg_scale=1.0, temperature=0.0)
    assert out[:, 3:].tolist() == [[1, 1], [1, 1]]
    first = model.inputs[0]
    assert first.shape[0] == 4 and torch.equal(first[:2], torch.cat([prompt, torch.full((2, 2), MASK)], 1))
    assert first[2:, :3].tolist() == [[0, MASK, MASK], [MASK, MASK, MASK]]  # real prompt tokens masked, pad kept
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=2, steps=2, cfg_scale=0.0, temperature=0.0)
    assert out[:, 3:].tolist() == [[0, 0], [0, 0]]


def test_finished_rows_needs_eos_to_the_end_of_the_block():
    eos = torch.tensor([EOS])
    blocks = torch.tensor([[1, 2, EOS, EOS], [1, EOS, 2, EOS], [EOS] * 4, [1, 2, 3, 4], [1, 2, 3, EOS]])
    assert finished_rows(blocks, eos).tolist() == [True, False, True, False, True]


def test_eos_finishes_a_row_fills_its_tail_and_drops_it_from_the_forward_batch():
    # the first prompt token selects the row's script: row 1 ends in block 1, row 2 never does
    completions = {1: [7, 8, EOS, EOS, 9, 9, 9, 9], 2: [7, EOS, 8, 9, 9, 9, 9, 9]}
    tables = {k: peaked(torch.tensor([0] + v), torch.linspace(5, 1, 9)) for k, v in completions.items()}
    def script(ids):
        return torch.stack([tables[int(row[0])][: ids.shape[1]] for row in ids])
    model = ScriptedModel(script, eos_token_id=EOS)
    kwargs = dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.0, return_dict_in_generate=True,
                  stop_on_eos=True)
    out = model.generate(torch.tensor([[1], [2]]), **kwargs)
    assert out.sequences[0, 1:].tolist() == [7, 8, EOS, EOS] + [EOS] * 4
    assert out.sequences[1, 1:].tolist() == completions[2]
    assert out.forward_batch_sizes == [2, 2, 2, 2, 1, 1, 1, 1]
    for row in (0, 1):  # unchanged: equal to generating the row alone
        alone = model.generate(torch.tensor([[row + 1]]), **kwargs).sequences
        assert torch.equal(alone[0], out.sequences[row])
    kwargs.pop("stop_on_eos")  # the default (LLaDA's reference sampler) keeps decoding after an EOS block
    kept = model.generate(torch.tensor([[1], [2]]), **kwargs)
    assert kept.forward_batch_sizes == [2] * 8 and kept.sequences[0, 5:].tolist() == [9, 9, 9, 9]


def test_infilling_masks_in_the_prompt_compete_with_the_block():
    model = ScriptedModel(by_position([0, 4, 0, 5, 6], [0, 9, 0, 1, 2]))
    out, trace = commit_trace(model, torch.tensor([[1, MASK, 2]]), max_new_tokens=2, steps=2)
    # 3 eligible masks (1 in the prompt) over 2 steps: budget [2, 1]; the prompt mask is the most confident
    assert trace == [{1, 4}, {3}]
    assert out[0].tolist() == [1, 4, 2, 5, 6]
    with pytest.raises(ValueError, match="infilling"):
        model.generate(torch.tensor([[1, MASK, 2]]), max_new_tokens=2, cache="prefix")


def test_streamer_receives_the_prompt_then_the_committed_prefix():
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    # commit order 4, 3, 2, 1 from the right: nothing is streamable until the first position commits
    model = ScriptedModel(by_position([0, 5, 6, 7, 8], [0, 1, 2, 3, 4]))
    streamer = Collect()
    out = model.generate(torch.tensor([[1]]), streamer=streamer, max_new_tokens=4, steps=4, temperature=0.0)
    assert streamer.puts == [[1], [5, 6, 7, 8]] and streamer.ended
    streamer = Collect()
    model = ScriptedModel(by_position([0, 5, 6, 7, 8], [0, 4, 3, 2, 1]))
    model.generate(torch.tensor([[1]]), streamer=streamer, max_new_tokens=4, steps=4, temperature=0.0)
    assert streamer.puts == [[1], [5], [6], [7], [8]]
    with pytest.raises(ValueError, match="batch of 1"):
        model.generate(torch.tensor([[1], [2]]), streamer=streamer, max_new_tokens=4)
    assert out.shape == (1, 5)
    # token editing may still change the current block: only settled blocks are streamed
    model = ScriptedModel(by_position([0, 5, 6, 7, 8], [0, 4, 1, 4, 1]))  # each block: left first, then right
    for editing, expected in ((None, [[1], [5], [6], [7], [8]]), (0.5, [[1], [5, 6], [7, 8]])):
        streamer = Collect()
        model.generate(torch.tensor([[1]]), streamer=streamer, max_new_tokens=4, block_length=2, temperature=0.0,
                       threshold=0.5, editing_threshold=editing)
        assert streamer.puts == expected


def test_sampling_helpers_filter_draw_in_float64_and_score():
    from hf_dlm.generation.sampling import add_gumbel_noise, confidence_scores, filter_logits

    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]]).log_softmax(-1)  # p = 0.644, 0.237, 0.087, 0.032
    assert torch.isinf(filter_logits(logits, 2, None)[0, 0, 2:]).all()
    kept = torch.isfinite(filter_logits(logits, None, 0.8))[0, 0].tolist()
    assert kept == [True, True, False, False]  # 0.64 < 0.8 <= 0.88: the two most likely
    assert add_gumbel_noise(logits, 0.0) is logits
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([add_gumbel_noise(logits, 1.0, generator).argmax(-1) for _ in range(2000)]).flatten()
    assert add_gumbel_noise(logits, 1.0).dtype == torch.float64
    assert abs(draws.eq(0).float().mean().item() - 0.644) < 0.04  # Gumbel-max draws from softmax(logits / T)
    x0 = torch.tensor([[1]])
    assert confidence_scores(logits, x0, "low_confidence").item() == pytest.approx(0.2369, abs=1e-4)
    assert confidence_scores(logits, x0, "margin").item() == pytest.approx(0.6439 - 0.2369, abs=1e-3)
    p = logits.exp().double()
    assert confidence_scores(logits, x0, "entropy").item() == pytest.approx((p * p.log()).sum().item())
