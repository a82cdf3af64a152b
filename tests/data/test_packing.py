"""Packing examples into rows (disttrain.data.packing), in one process: which examples
share a row, what a row holds, the refusals, and the built-in GPT and a tiny
transformers Llama on packed rows against the same examples unpacked (plain PyTorch,
each example padded alone): the summed loss and the trained-token count identical, every
gradient within 1e-5.

Tolerance: the packed forward masks attention (block-diagonal) where the unpacked one
runs causal attention on a shorter effective sequence: the same terms summed in
another order (~1e-7 relative here); a token that reads another example moves
gradients by 1e-3 or more (tests/parallel/test_packing_layouts.py says the same).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from packing_support import BUILD, LENGTHS, MODEL, SEQ, examples, gpt, unpacked_loss

from disttrain import Trainer
from disttrain.data.packing import (
    PackedCollate,
    PackedExamples,
    pack_lengths,
    packed_row,
)
from disttrain.data.packing_check import packing_mismatch, packing_refusal
from disttrain.errors import ConfigError, DataError, UserError
from disttrain.models import token_loss
from disttrain.parallel.pipeline.chunks import _piece_inputs
from disttrain.spec import generic_spec, spec_for
from disttrain.train.batch import Batch, causal_lm_loss

# ---- which examples share a row ----------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_example_lands_in_one_row_within_its_capacity(seed):
    rng = random.Random(seed)
    lengths = [min(64, int(rng.paretovariate(1.2) * 3)) for _ in range(500)] + [0, 0]
    rows = pack_lengths(lengths, 64, seed)
    placed = sorted(i for row in rows for i in row)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]  # empty ones left out
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    # best fit of a skewed mix wastes little: rows within 2% of the bound
    assert len(rows) <= 1.02 * -(-sum(lengths) // 64) + 1


def test_best_fit_puts_each_example_in_the_fullest_row_that_holds_it():
    # 9 -> row 0 (room 1); 6 -> row 1 (4); 5 -> row 2 (5); 4 -> row 1, the one with
    # least room that holds it (4 < 5); 1 -> row 0 (room 1, the least)
    lengths = [4, 9, 1, 6, 5]
    rows = pack_lengths(lengths, 10, seed=3)
    assert [[lengths[i] for i in row] for row in rows] == [[9, 1], [6, 4], [5]]


def test_the_rows_follow_the_seed_only():
    lengths = [3] * 10 + [5] * 10 + [8] * 4  # many ties: their order is the seed's
    assert pack_lengths(lengths, 16, 7) == pack_lengths(list(lengths), 16, 7)
    assert pack_lengths(lengths, 16, 7) != pack_lengths(lengths, 16, 8)


# ---- what a row holds --------------------------------------------------------------------


def test_a_row_restarts_positions_and_drops_each_first_label():
    a = (torch.tensor([11, 12, 13]), torch.tensor([-100, 12, 13]))
    b = (torch.tensor([21, 22]), torch.tensor([21, 22]))
    row = packed_row([a, b], 8)
    assert row["input_ids"].tolist() == [11, 12, 13, 21, 22, 0, 0, 0]
    assert row["labels"].tolist() == [-100, 12, 13, -100, 22, -100, -100, -100]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert a[1].tolist() == [-100, 12, 13] and b[1].tolist() == [21, 22]  # not changed


def test_packed_examples_hold_every_example_once():
    data = examples()
    rows = PackedExamples(data, SEQ, seed=1234)
    assert len(rows) == 8 and rows.tokens == sum(LENGTHS)
    members = sorted(i for r in range(len(rows)) for i in rows.row_examples(r))
    assert members == list(range(len(data)))
    row = rows[2]
    start = 0
    for i in rows.row_examples(2):
        n = len(data[i]["input_ids"])
        assert torch.equal(row["input_ids"][start:start + n], data[i]["input_ids"])
        assert torch.equal(row["labels"][start + 1:start + n], data[i]["labels"][1:])
        start += n


def test_examples_without_labels_train_every_token_and_lists_are_taken():
    rows = PackedExamples([{"input_ids": [5, 6, 7], "text": "ignored"}, {"input_ids": []}],
                          6, seed=0)
    assert len(rows) == 1
    assert rows[0]["labels"].tolist() == [-100, 6, 7, -100, -100, -100]


@pytest.mark.parametrize("sample, named", [
    (torch.tensor([1, 2]), "sample 1 is a Tensor"),
    ({"labels": [1]}, "sample 1 is a mapping of labels"),
    ({"input_ids": [[1, 2]], "labels": [[1, 2]]}, "1-D integer"),
    ({"input_ids": [1, 2], "labels": [1]}, "one length"),
    ({"input_ids": [0.5, 1.0]}, "1-D integer"),
    ({"input_ids": ["a"]}, "not sequences of integers"),
    ({"input_ids": list(range(SEQ + 1))}, "example 1 has 17 tokens"),
])
def test_what_is_not_an_example_is_refused_naming_it(sample, named):
    with pytest.raises(DataError, match=named) as info:
        PackedExamples([{"input_ids": [1]}, sample], SEQ, seed=0)
    assert "\n" not in str(info.value)


def test_nothing_to_pack_and_an_example_that_changed_are_refused():
    with pytest.raises(DataError, match="hold no token"):
        PackedExamples([{"input_ids": []}], SEQ, seed=0)
    data = [{"input_ids": [1, 2, 3]}]
    rows = PackedExamples(data, SEQ, seed=0)
    data[0]["input_ids"] = [1, 2]
    with pytest.raises(DataError, match="changed length"):
        rows[0]


# ---- the models on packed rows -----------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_rows_give_the_unpacked_loss_count_and_gradients(family):
    if family == "llama":
        pytest.importorskip("transformers")
    data = examples()
    packed, plain = BUILD[family](), BUILD[family]()
    spec = spec_for(packed)
    rows = PackedExamples(data, SEQ, seed=5)
    batch = PackedCollate(spec.packed_inputs)([rows[r] for r in range(len(rows))])
    assert set(batch) == {"input_ids", "labels", *spec.packed_inputs}
    labels = batch.pop("labels")
    loss, count = causal_lm_loss(packed(**batch, **(spec.call_kwargs or {})), labels)
    loss.backward()
    want_loss, want_count = unpacked_loss(plain, data)
    want_loss.backward()
    assert int(count) == want_count
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(packed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_gpt_pipeline_stage_hands_positions_and_documents_on_by_name():
    spec = spec_for(gpt())
    ids, pos, docs = (torch.zeros(1, 4, dtype=torch.long) for _ in range(3))
    got = _piece_inputs(Batch((), {"input_ids": ids, "position_ids": pos,
                                   "document_ids": docs}), spec)
    assert got[0] is ids and got[1] == {"position_ids": pos} and got[2] == {
        "document_ids": docs}
    with pytest.raises(ValueError, match="attention_mask"):
        _piece_inputs(Batch((), {"input_ids": ids, "attention_mask": ids}), spec)


# ---- which models can pack ---------------------------------------------------------------


def test_the_gpt_and_transformers_families_take_packed_rows():
    assert packing_refusal(spec_for(gpt())) is None
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4))
    for model in (BUILD["llama"](), gpt2):
        assert packing_refusal(spec_for(model)) is None, type(model).__name__


def test_a_model_that_attends_across_examples_is_found_by_running_it():
    pytest.importorskip("transformers")
    model = BUILD["llama"]()
    # with its key/value cache on (no use_cache=False), transformers does not read
    # packed sequences from position_ids: the probe must see examples read each other
    spec = dataclasses.replace(spec_for(model), call_kwargs={})
    said = packing_mismatch(model, spec)
    assert said is not None and "lets example 1 read another" in said
    assert packing_mismatch(model, spec_for(model)) is None


def test_a_model_without_packed_inputs_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    assert "declares no inputs" in packing_refusal(generic_spec(model))
    odd = dataclasses.replace(spec_for(gpt()), packed_inputs=("segment_ids",))
    assert "segment_ids" in packing_refusal(odd)
    with pytest.raises(ConfigError, match=r"^data.packing=True: .*declares no inputs") as e:
        Trainer(model, examples(), config={"model": MODEL, "data": {"packing": True}})
    assert "\n" not in str(e.value)


def test_packing_is_refused_where_ranks_hold_parts_of_each_row():
    """Context parallelism's ring attends causally over the whole row: across the
    examples packed in it. Refused before any process group, naming both settings."""
    from disttrain.config import load_config
    from disttrain.run_checks import resolve

    config = load_config(overrides=["model.seq_len=16", "data.packing=true", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"^data.packing=True: does not combine with "
                       r"parallel.cp=2.*or parallel.cp = 1\)$") as e:
        resolve(config, world_size=2, spec=spec_for(gpt()))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra, named", [
    ({"collate_fn": lambda rows: rows}, "collate_fn"),
    ({"loss_fn": token_loss}, "token_loss"),
])
def test_the_trainer_refuses_what_packed_rows_cannot_take(extra, named):
    with pytest.raises(UserError, match=named):
        Trainer(gpt(), examples(), config={"model": MODEL, "data": {"packing": True}},
                **extra)


class _WithLengths(torch.utils.data.Dataset):
    """Examples that say their lengths without being read (as ExampleDataset does)."""

    def __init__(self, data: list, lengths: list[int]) -> None:
        self.data, self.lengths, self.reads = data, lengths, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.reads += 1
        return self.data[i]


def test_a_dataset_that_knows_its_lengths_is_not_read_to_pack_it():
    data = examples()
    known = _WithLengths(data, list(LENGTHS))
    rows = PackedExamples(known, SEQ, seed=1234)
    assert known.reads == 0
    plain = PackedExamples(data, SEQ, seed=1234)
    assert [rows.row_examples(r) for r in range(len(rows))] == \
        [plain.row_examples(r) for r in range(len(plain))]
    assert torch.equal(rows[3]["input_ids"], plain[3]["input_ids"])
    with pytest.raises(DataError, match="example 0 has 17 tokens"):
        PackedExamples(_WithLengths(data, [17, *LENGTHS[1:]]), SEQ, seed=0)
    wrong = PackedExamples(_WithLengths(data, [LENGTHS[0] - 1, *LENGTHS[1:]]), SEQ, seed=0)
    with pytest.raises(DataError, match="changed length"):
        for r in range(len(wrong)):
            wrong[r]
