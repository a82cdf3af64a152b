"""``disttrain train`` on instruction and chat data (data.format = jsonl) from a tiny
Llama pretrained directory with its tokenizer, as the fine-tuning guide prints it: the
loss counts the trained tokens only (against a plain computation), bad input exits 2 in
one line naming file and line, and ``disttrain export --format hf`` of the run, which
has no checkpoint, exports its final weights."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from chat_support import save_llama, write_jsonl
from safetensors.torch import load_file
from test_cli import run_cli

from disttrain.cli import main
from disttrain.config import load_config
from disttrain.data import examples_from_config
from disttrain.errors import EXIT_USAGE

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

pytest.importorskip("transformers")

WORDS = "one two three four five six seven".split()
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "finetune.md"


def _tail(i: int) -> list[str]:
    return [w for bit, w in enumerate(WORDS) if (i + 1) >> bit & 1]


def _reference(tok, n: int) -> tuple[list[dict], dict[tuple, list[int]]]:
    """``n`` examples of both shapes and, written out token by token here, the ids and
    labels each must become (ChatML with its default system turn; -100 off the answer)."""
    records, expected = [], {}
    for i in range(n):
        tail = _tail(i)
        if i % 2:
            records.append({"prompt": " ".join(["what", "is", *tail, "?"]),
                            "completion": " ".join([*tail, "."])})
            context, answer = ["what", "is", *tail, "?"], [*tail, ".", "<|im_end|>"]
        else:
            records.append({"messages": [
                {"role": "user", "content": " ".join(["hello", *tail])},
                {"role": "assistant", "content": " ".join(["hi", *tail])}]})
            context = ["<|im_start|>", "system", "be", "brief", "<|im_end|>", "<|im_start|>",
                       "user", "hello", *tail, "<|im_end|>", "<|im_start|>", "assistant"]
            answer = ["hi", *tail, "<|im_end|>"]
        ids = tok.convert_tokens_to_ids(context + answer)
        expected[tuple(ids)] = [-100] * len(context) + ids[len(context):]
    return records, expected


def _plain_loss(model, examples: list[tuple[list[int], list[int]]]) -> float:
    """Summed cross-entropy over the trained (label != -100) next tokens of each example
    alone, unpadded, divided by their number."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in examples:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(logits, target, ignore_index=-100,
                                                       reduction="sum").item()
            count += int((target != -100).sum())
    return total / count


def _guide_commands(after: str = "## Instruction and chat") -> list[list[str]]:
    """The commands of the fine-tuning guide's first bash block after ``after`` (the
    chat section's train and export commands, by default)."""
    text = GUIDE.read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text[text.index(after):], re.S).group(1)
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


def _run_guide_train(root: Path, train: list[str], changed: list[str]):
    """``train`` (a guide command) run in ``root`` with ``changed`` settings after the
    printed ones (later --set values win), the cache in ``root``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["DISTTRAIN_CACHE"] = str(root / "cache")
    proc = run_cli([*train[1:], "--quiet", *[a for v in changed for a in ("--set", v)]],
                   env, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """The guide's commands, run as printed in a directory holding ./my-llama and
    ./chat.jsonl, one step long, with the whole training split as the global batch
    and the tiny model's context; the data prepared here first, in the same cache."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    llama = save_llama(root / "my-llama", "chatml", seq=32)
    records, expected = _reference(AutoTokenizer.from_pretrained(llama), 24)
    write_jsonl(root / "chat.jsonl", records)
    train, export = _guide_commands()
    assert train[:2] == ["disttrain", "train"] and export[:2] == ["disttrain", "export"]
    printed = [train[i + 1] for i, arg in enumerate(train) if arg == "--set"]
    changed = ["model.seq_len=32", "data.val_fraction=0.25"]  # later --set values win
    config = load_config(overrides=[v.replace("=./", f"={root}/") for v in printed + changed]
                         + [f"data.cache_dir={root / 'cache'}"])
    prepared = examples_from_config(config.data, config.model)
    changed += ["train.steps=1", "train.warmup_steps=0", "train.eval_samples=64",
                f"train.global_batch={prepared.examples['train']}", "train.log_every=1"]
    _run_guide_train(root, train, changed)
    return root, llama, prepared, expected, export


def test_the_loss_counts_the_trained_tokens_only(chat_run):
    from transformers import AutoModelForCausalLM

    root, llama, prepared, expected, _ = chat_run
    run_dir = root / "runs" / "chat"
    assert [p.name for p in (root / "cache").glob("examples-*/")] == \
        [prepared.directory.name]  # the run reused what was prepared
    splits = {}
    for split in ("train", "val"):
        ds = prepared.dataset(split)
        samples = [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist())
                   for i in range(len(ds))]
        assert all(expected[tuple(ids)] == labels for ids, labels in samples)
        splits[split] = samples
    assert len(splits["train"]) + len(splits["val"]) == len(expected)
    model = AutoModelForCausalLM.from_pretrained(llama).float().eval()
    summary = json.loads((run_dir / "summary.json").read_text())
    step1 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the same fp32 weights; only the summation order differs (padded batches, chunked
    # fused loss, one example at a time here)
    assert summary["initial_eval_loss"] == pytest.approx(
        _plain_loss(model, splits["val"]), rel=1e-5)
    assert step1[0]["step"] == 1 and step1[0]["loss"] == pytest.approx(
        _plain_loss(model, splits["train"]), rel=1e-5)


def _one_packed_step(root: Path, llama: Path, prepared, train: list[str], run: str):
    """``train`` (a guide command that packs, writing ``runs/<run>``) run for one step
    over every packed row of the training split at the tiny model's context: (its first
    metrics record, the base model in fp32, the training examples as (ids, labels), the
    number of rows)."""
    from transformers import AutoModelForCausalLM

    from disttrain.data.packing import PackedExamples

    seq = 32
    ds = prepared.dataset("train")
    rows = len(PackedExamples(ds, seq, seed=load_config().train.seed))
    _run_guide_train(root, train, [f"model.seq_len={seq}", "data.val_fraction=0.25",
                                   "train.steps=1", "train.warmup_steps=0",
                                   "train.eval_samples=64", "train.log_every=1",
                                   f"train.global_batch={rows}"])
    step1 = json.loads((root / "runs" / run / "metrics.jsonl").read_text().splitlines()[0])
    base = AutoModelForCausalLM.from_pretrained(llama).float().eval()
    samples = [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist())
               for i in range(len(ds))]
    return step1, base, samples, rows


def test_packed_rows_train_the_loss_of_the_examples_alone(chat_run):
    """The guide's packed command on the same examples, every packed row in the one
    step's batch: the step's loss is the plain per-example loss over trained tokens
    (rows of several examples each, positions restarting: nothing attends across)."""
    root, llama, prepared, _, _ = chat_run
    (train,) = _guide_commands("the chat examples of the previous section, packed")
    assert "data.packing=true" in train
    step1, model, samples, rows = _one_packed_step(root, llama, prepared, train, "chat-packed")
    assert rows < len(samples)  # rows hold several examples each
    # the same fp32 weights; the summation order differs (rows, the chunked fused loss)
    assert step1["step"] == 1 and step1["loss"] == pytest.approx(
        _plain_loss(model, samples), rel=1e-5)


def test_the_whole_job_of_the_guide_runs_as_printed(chat_run, tmp_path):
    """The guide's three commands (chat data, packing, LoRA at tp 2, peft and merged
    exports of the final weights) on the tiny Llama, one step, every packed row in it:
    the step's loss is the base's per-example loss over trained tokens (LoRA's B starts
    at zero), and the merged model's logits are peft's on the base with the adapters."""
    from transformers import AutoModelForCausalLM

    root, llama, prepared, _, _ = chat_run
    train, *exports = _guide_commands("## The whole job")
    assert [a for a in train if a.startswith("model.lora_rank")] and len(exports) == 2
    step1, base, samples, _ = _one_packed_step(root, llama, prepared, train, "chat-lora")
    # fp32 throughout; the sums run in other orders (rows, tp shards, the fused loss)
    assert step1["loss"] == pytest.approx(_plain_loss(base, samples), rel=1e-5)
    for argv in exports:
        assert argv[:2] == ["disttrain", "export"]
        assert main([*[a.replace("./", f"{root}/", 1) if a.startswith("./") else
                       str(root / a) if a.startswith("runs/") else a
                       for a in argv[1:]]]) == 0
    merged = AutoModelForCausalLM.from_pretrained(root / "my-llama-chat").float().eval()
    ids = torch.tensor([samples[0][0]])
    with torch.no_grad():
        got, before = merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert (got - before).abs().max() > 1e-4  # one step of lr 2e-4 moved the adapters
    assert (root / "my-llama-chat-lora" / "adapter_model.safetensors").is_file()
    peft = pytest.importorskip("peft", reason="peft is optional (the 'peft' extra): the "
                               "adapter files are checked with it where installed")
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, root / "my-llama-chat-lora")(
            input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # merged vs two matmuls


def test_export_of_a_run_without_checkpoints_uses_its_final_weights(chat_run, capsys,
                                                                    monkeypatch):
    """The guide's export line, in the run's directory."""
    from transformers import AutoModelForCausalLM

    root, export = chat_run[0], chat_run[-1]
    run_dir, out = root / export[2], root / export[export.index("--out") + 1]
    assert not (run_dir / "checkpoints").exists()
    monkeypatch.chdir(root)
    assert main(export[1:]) == 0
    assert capsys.readouterr().out.strip() == \
        f"wrote {Path(export[export.index('--out') + 1])} (step 1, from the final " \
        "weights model.safetensors)"
    final = load_file(str(run_dir / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in final.items())


def _train_args(root, llama, data, *extra):
    return ["train", "--nproc", "1", "--set", f"model.pretrained={llama}",
            "--set", "data.format=jsonl", "--set", f"data.path={data}",
            "--set", "model.seq_len=32", "--set", f"data.cache_dir={root / 'bad-cache'}",
            *extra]


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "hi", "completion": "ok"', "not valid JSON"),
    ('{"messages": [{"role": "moderator", "content": "hi"}]}',
     "message 1 has unknown role 'moderator'"),
    ('{"prompt": "hi"}', "missing field 'completion'"),
    (json.dumps({"prompt": "two " * 40, "completion": "ok"}),
     "is 42 tokens long, more than model.seq_len=32"),
])
def test_bad_input_exits_2_in_one_line_naming_file_and_line(chat_run, capsys, line,
                                                            problem):
    root, llama = chat_run[:2]
    data = root / "bad.jsonl"
    data.write_text('{"prompt": "yes", "completion": "no"}\n' + line + "\n")
    assert main(_train_args(root, llama, data)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"disttrain: error: {data}:2: {problem}") and err.count("\n") == 1


def test_skipped_examples_are_counted_before_launch(chat_run, capsys, monkeypatch):
    """Under skip the launcher reports the count; stopped at the launch itself here."""
    import disttrain.launch.agent as agent

    root, llama = chat_run[:2]
    data = write_jsonl(root / "some-bad.jsonl", [
        {"prompt": "yes", "completion": "no"}, "{bad", {"prompt": "hi", "completion": "ok"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                          "content": "ok"}]}])

    monkeypatch.setattr(agent, "launch", lambda opts, target: 0)
    assert main(_train_args(root, llama, data, "--set", "data.on_bad_example=skip",
                            "--run-dir", str(root / "skip-run"))) == 0
    err = capsys.readouterr().err
    assert (f"disttrain: data.on_bad_example=skip: skipped 1 of 4 examples ({data}:2: "
            "not valid JSON") in err


@pytest.mark.parametrize("extra, named", [
    (["--set", "data.format=jsonl", "--set", "data.path=."], "data.tokenizer"),
    (["--set", "data.truncate=true"], "data.truncate"),
    (["--set", "data.format=jsonl", "--set", "data.path=/no/such.jsonl"], "data.path"),
])
def test_configurations_that_cannot_work_are_refused(capsys, extra, named):
    assert main(["train", "--nproc", "1", *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"disttrain: error: {named}=") and err.count("\n") == 1
