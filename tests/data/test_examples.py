"""data.format = jsonl: instruction and chat examples prepared once and cached, one
sample per example in transformers' labels convention, padded into batches; a bad
example stops preparation naming its file and line, or is skipped and counted."""

from __future__ import annotations

import json

import pytest
import torch
from chat_support import save_tokenizer, write_jsonl

from disttrain.config import load_config
from disttrain.data import PadToSeqLen, example_cache, examples_from_config
from disttrain.data.check import check_corpus_vocab
from disttrain.errors import ConfigError, DataError

pytest.importorskip("transformers")

CHAT = [{"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi how are you"}]


def _records(n: int) -> list[dict]:
    """Both shapes, every example different (its words: the bits of i + 1)."""
    words = "one two three four five six seven".split()
    out = []
    for i in range(n):
        tail = " ".join(w for bit, w in enumerate(words) if (i + 1) >> bit & 1)
        out.append({"prompt": f"what is {tail} ?", "completion": f"{tail} ."} if i % 2 else
                   {"messages": [{"role": "user", "content": f"hello {tail}"},
                                 {"role": "assistant", "content": f"hi {tail}"}]})
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", "chatml")


def _prepare(path, tokenizer_dir, *extra: str, seq_len: int = 32):
    config = load_config(overrides=["data.format=jsonl", f"data.path={path}",
                                    f"data.tokenizer={tokenizer_dir}",
                                    f"data.cache_dir={path.parent / 'cache'}",
                                    f"model.seq_len={seq_len}", *extra])
    return examples_from_config(config.data, config.model)


def _examples(prepared) -> dict[tuple[int, ...], tuple[int, ...]]:
    """input_ids -> labels of every example in both splits."""
    out = {}
    for split in ("train", "val"):
        ds = prepared.dataset(split)
        for i in range(len(ds)):
            s = ds[i]
            out[tuple(s["input_ids"].tolist())] = tuple(s["labels"].tolist())
    return out


def test_a_prepared_example_is_its_ids_with_the_untrained_ones_labelled_minus_100(
        tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "what is two ?", "completion":
                                               "two ."}, {"messages": CHAT}])
    prepared = _prepare(path, tokenizer_dir, "data.val_fraction=0.5")
    assert prepared.examples["train"] + prepared.examples["val"] == 2
    assert min(prepared.examples.values()) == 1  # both splits non-empty
    ids = tok.convert_tokens_to_ids
    completion = ids("what is two ? two . <|im_end|>".split())
    chat = ids("<|im_start|> system be brief <|im_end|> <|im_start|> user hello there "
               "<|im_end|> <|im_start|> assistant hi how are you <|im_end|>".split())
    assert _examples(prepared) == {
        tuple(completion): (-100,) * 4 + tuple(completion[4:]),
        tuple(chat): (-100,) * 12 + tuple(chat[12:])}
    assert prepared.trained_tokens["train"] + prepared.trained_tokens["val"] == 3 + 5
    sample = prepared.dataset("train")[0]
    assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
    assert prepared.dataset("train").lengths.tolist() == [len(sample["input_ids"])]


def test_padding_to_seq_len_labels_the_padding_minus_100():
    samples = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
               {"input_ids": torch.tensor([8, 9]), "labels": torch.tensor([-100, 9])}]
    batch = PadToSeqLen(5, 1)(samples)
    assert set(batch) == {"input_ids", "labels"}  # no attention mask: right padding
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 1], [8, 9, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, 9, -100, -100, -100]]
    with pytest.raises(ValueError, match="does not fit seq_len=2"):
        PadToSeqLen(2, 1)(samples)


def test_a_saved_datasets_dataset_of_both_shapes_gives_the_same_examples(tmp_path,
                                                                         tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    records = _records(10)
    from_jsonl = _prepare(write_jsonl(tmp_path / "a.jsonl", records), tokenizer_dir)
    saved = tmp_path / "saved"
    # every row with every column (from_list takes its columns from the first row)
    rows = [{k: r.get(k) for k in ("prompt", "completion", "messages")} for r in records]
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    from_disk = _prepare(saved, tokenizer_dir)
    assert from_disk.directory != from_jsonl.directory
    assert _examples(from_disk) == _examples(from_jsonl)
    assert from_disk.examples == from_jsonl.examples  # split by content, not by source


def test_the_split_is_by_example_and_adding_examples_moves_none(tmp_path, tokenizer_dir):
    first = _prepare(write_jsonl(tmp_path / "a.jsonl", _records(14)), tokenizer_dir,
                     "data.val_fraction=0.3")
    more = tmp_path / "more"
    more.mkdir()
    second = _prepare(write_jsonl(more / "b.jsonl", _records(14) + _records(30)[14:]),
                      tokenizer_dir, "data.val_fraction=0.3")

    def val(prepared):
        ds = prepared.dataset("val")
        return {tuple(ds[i]["input_ids"].tolist()) for i in range(len(ds))}
    assert val(first) and val(first) < val(second)
    assert first.examples["val"] < second.examples["val"] < 30


def test_prepared_once_then_reused_from_the_cache(tmp_path, tokenizer_dir, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", _records(6))
    first = _prepare(path, tokenizer_dir)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("prepared again")
    monkeypatch.setattr(example_cache, "_build", no_rebuild)
    assert _prepare(path, tokenizer_dir).directory == first.directory
    with pytest.raises(AssertionError, match="prepared again"):  # the key follows seq_len
        _prepare(path, tokenizer_dir, seq_len=25)
    monkeypatch.undo()
    path.write_text(path.read_text() + json.dumps({"prompt": "yes", "completion": "no"}) + "\n")
    assert _prepare(path, tokenizer_dir).directory != first.directory  # a changed file


LONG = {"prompt": "what is " + "two plus " * 14 + "two ?", "completion": "six ."}  # 35 tokens
# (line written, its line number, what the one-line error says)
BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"prompt": "hi"}), "missing field 'completion'"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),
     "message 1 has unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "has no assistant message"),
    (json.dumps(LONG), "is 35 tokens long, more than model.seq_len=32"),
]


@pytest.mark.parametrize("line, problem", BAD_LINES, ids=[p for _, p in BAD_LINES])
def test_a_bad_example_stops_preparation_naming_file_and_line(tmp_path, tokenizer_dir,
                                                              line, problem):
    path = tmp_path / "a.jsonl"
    good = [json.dumps(r) for r in _records(4)]
    path.write_text("\n".join([*good[:2], "", line, *good[2:]]) + "\n")
    with pytest.raises(DataError) as error:
        _prepare(path, tokenizer_dir)
    message = str(error.value)
    assert message.startswith(f"{path}:4: {problem}") and "\n" not in message
    assert message.endswith(")")  # the fix, in brackets
    assert not list((tmp_path / "cache").glob("examples-*/meta.json"))  # nothing cached


def test_a_line_that_is_not_utf8(tmp_path, tokenizer_dir):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"prompt": "hi", "completion": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=f"^{path}:2: the line is not UTF-8"):
        _prepare(path, tokenizer_dir)


def test_skip_counts_and_reports_the_bad_examples(tmp_path, tokenizer_dir):
    good = [json.dumps(r) for r in _records(6)]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join([good[0], "{oops", *good[1:4], json.dumps(LONG), good[4],
                               '{"text": 1}', good[5], '"x"']) + "\n")
    prepared = _prepare(path, tokenizer_dir, "data.on_bad_example=skip")
    assert (prepared.skipped, prepared.read) == (4, 10)
    assert sum(prepared.examples.values()) == 6
    report = prepared.skip_report()
    assert report.startswith("data.on_bad_example=skip: skipped 4 of 10 examples (")
    assert f"{path}:2: not valid JSON" in report and f"{path}:6: is 35 tokens" in report
    assert "\n" not in report and report.endswith("; ...)")  # three named, one more


def test_truncate_cuts_to_seq_len_and_refuses_what_leaves_nothing_to_train(tmp_path,
                                                                           tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [LONG, *_records(3)])
    prepared = _prepare(path, tokenizer_dir, "data.truncate=true", seq_len=34)
    longest = max(max(prepared.dataset(s).lengths, default=0) for s in ("train", "val"))
    assert longest == 34
    # at 32 tokens the prompt alone fills the window
    with pytest.raises(DataError, match=r"a.jsonl:1: has no token to train on within its "
                                        r"first model.seq_len=32 tokens"):
        _prepare(path, tokenizer_dir, "data.truncate=true")


def test_a_chat_without_a_template_stops_even_under_skip(tmp_path):
    directory = save_tokenizer(tmp_path / "plain", "none")
    path = write_jsonl(tmp_path / "a.jsonl", [*_records(4)])
    with pytest.raises(DataError, match=f"^{path}:1: is a chat .* has no chat template"):
        _prepare(path, directory, "data.on_bad_example=skip")


def test_a_dataset_row_is_named_by_its_row(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(
        [{"prompt": "hi", "completion": "ok"}, {"prompt": "yes", "completion": None}])}
    ).save_to_disk(str(saved))
    with pytest.raises(DataError, match=rf"^{saved}\[train\] row 1: missing field "
                                        "'completion'"):
        _prepare(saved, tokenizer_dir)


def test_a_directory_without_a_tokenizer_is_refused_naming_the_field(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = write_jsonl(tmp_path / "a.jsonl", _records(2))
    with pytest.raises(ConfigError, match="^data.tokenizer=.*cannot be loaded as a "
                                          "tokenizer") as error:
        _prepare(path, tmp_path / "model")
    assert "\n" not in str(error.value)


def test_token_ids_beyond_the_model_vocabulary_are_refused(tmp_path, tokenizer_dir):
    prepared = _prepare(write_jsonl(tmp_path / "a.jsonl", _records(4)), tokenizer_dir)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 16}))
    config = load_config(overrides=[f"model.hf_config={tmp_path / 'config.json'}"])
    with pytest.raises(ConfigError, match=f"has vocab_size 16, below the corpus in "
                                          f"{prepared.directory}'s token range"):
        check_corpus_vocab(config.model, prepared, config.explicit)
