"""`SamplingRows`: the sampling parameters of a decode batch are built once while its sequences stay the same."""

from __future__ import annotations

import torch

from drafter_trainer.batch import sampling_batch
from service.engine.batch_tensors import SamplingBatch, SamplingRows
from service.engine.types import Sequence
from service.params import SamplingParams


def seq(params: SamplingParams, seed: int) -> Sequence:
    return Sequence("r", 0, [1, 2, 3], params, seed)


def fields(sb: SamplingBatch) -> list:
    return [getattr(sb, f).tolist() if isinstance(getattr(sb, f), torch.Tensor) else getattr(sb, f)
            for f in SamplingBatch.__slots__]


def test_only_the_output_positions_are_rebuilt_while_the_sequences_stay():
    rows = SamplingRows(vocab_size=100, device=torch.device("cpu"))
    a = seq(SamplingParams(temperature=0.7, top_p=0.9, seed=1), 11)
    b = seq(SamplingParams(temperature=0), 12)
    first = rows.build([a, b])
    a.output_token_ids += [5, 6]
    b.output_token_ids += [7]
    again = rows.build([a, b])
    assert again.counters.tolist() == [2, 1] and again.temperature is first.temperature
    assert fields(again) == fields(SamplingBatch.build([a, b], 100, torch.device("cpu")))


def test_a_batch_of_other_sequences_gets_their_parameters():
    rows = SamplingRows(vocab_size=100, device=torch.device("cpu"))
    a = seq(SamplingParams(temperature=0.7, seed=1), 11)
    b = seq(SamplingParams(temperature=0), 12)
    c = seq(SamplingParams(temperature=1.3, top_k=5, min_p=0.1, seed=2), 13)  # same batch size, other rows
    rows.build([a, b])
    for batch in ([a, c], [c, a], [a, b]):
        assert fields(rows.build(batch)) == fields(SamplingBatch.build(batch, 100, torch.device("cpu")))


def test_the_batch_says_which_passes_it_can_skip():
    """`any_greedy` and `unit_temperature` let sampling skip the argmax and the division by the temperature;
    set only where no row needs them."""
    cpu = torch.device("cpu")
    t1 = seq(SamplingParams(temperature=1.0, seed=1), 11)
    t07 = seq(SamplingParams(temperature=0.7, seed=2), 12)
    greedy = seq(SamplingParams(temperature=0), 13)

    def flags(*seqs: Sequence) -> tuple[bool, bool]:
        sb = SamplingBatch.build(list(seqs), 100, cpu)
        return sb.any_greedy, sb.unit_temperature

    assert flags(t1) == (False, True)
    assert flags(t1, greedy) == (True, True)  # a greedy row's logits are not divided either
    assert flags(t1, t07) == (False, False)
    assert flags(greedy, t07) == (True, False)


def test_the_drafter_trainers_batches_skip_what_their_rollouts_do_not_need():
    def flags(temps: list[float]) -> tuple[bool, bool]:
        n = len(temps)
        sb = sampling_batch(temps, [1.0] * n, [0] * n, [0.0] * n, 100, torch.device("cpu"))
        return sb.any_greedy, sb.unit_temperature

    assert flags([1.0, 1.0]) == (False, True)
    assert flags([1.0, 0.0]) == (True, True)
    assert flags([0.7, 1.0]) == (False, False)
