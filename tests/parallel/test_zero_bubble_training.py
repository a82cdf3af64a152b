"""The zero-bubble schedules (zb1 = ZB-H1, zbv) through the Trainer: the built-in GPT
and a tiny transformers Llama (8 blocks, so a V of 2 x 4 chunks fits) end with the
final weights of one process, at pp 2 and 4, m = pp and 2 pp micro-batches, with tp 2
or dp 2 under ZeRO-1, 2 and 3 beside, and ZeRO-3 with tp 2 at world 8 (ZeRO-3: B
gathers a chunk's weights as 1F1B's backward does, a W reads none of them, a
tensor-parallel linear's W computes no input gradient again, and the gradients
accumulate unsharded until the chunk's last W reduces them); a checkpoint saved under
zbv resumes under zb1 and under 1F1B on the same trajectory.

atol 1e-4 (as tests/parallel/test_hybrid.py): the layouts sum the same terms in other
orders (micro-batches, tp shards, the split B / W passes group the weight gradients by
layer), ~1e-7 per step in fp32; a W pass missing or run twice, a gradient sent to the
wrong chunk of the V or a tied weight not summed moves weights by 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch
from hf_support import padded_rows, plain_loop
from support import TINY_MODEL, SyntheticTokens, _tiny_train, full_state

from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds and trains: not in the quick check

STEPS, LAYERS, BATCH = 3, 8, 16
GPT_MODEL = {**TINY_MODEL, "n_layer": LAYERS, "n_head": 4}
HF_TRAIN = {"steps": STEPS, "global_batch": BATCH, "lr": 3e-3, "schedule": "constant",
            "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.1, "log_every": 4,
            "eval_samples": 8}
VOCAB, SEQ = 64, 12
# (name, dp, pp, tp, zero, schedule, m); m = grad_accum, the schedule's micro-batches
WORLD4 = [("pp2-tp2-zb1-m2", 1, 2, 2, 0, "zb1", 2), ("pp2-tp2-zbv-m4", 1, 2, 2, 0, "zbv", 4),
          ("dp2-pp2-z1-zb1-m4", 2, 2, 1, 1, "zb1", 4),
          ("dp2-pp2-z1-zbv-m2", 2, 2, 1, 1, "zbv", 2),
          ("pp4-zb1-m4", 1, 4, 1, 0, "zb1", 4), ("pp4-zb1-m8", 1, 4, 1, 0, "zb1", 8),
          ("pp4-zbv-m4", 1, 4, 1, 0, "zbv", 4), ("pp4-zbv-m8", 1, 4, 1, 0, "zbv", 8),
          ("dp2-pp2-z2-zbv-m4", 2, 2, 1, 2, "zbv", 4),
          ("dp2-pp2-z3-zb1-m4", 2, 2, 1, 3, "zb1", 4),
          ("dp2-pp2-z3-zbv-m2", 2, 2, 1, 3, "zbv", 2),
          # activation checkpointing: W reruns what reads a checkpointed block's saved
          # tensors, which it recomputes (refused under ZeRO-3, whose weights are freed)
          ("pp2-tp2-zb1-m2-ckpt", 1, 2, 2, 0, "zb1", 2, {"activation_checkpointing": "full"}),
          ("dp2-pp2-z2-zbv-m4-ckpt", 2, 2, 1, 2, "zbv", 4,
           {"activation_checkpointing": "full"})]
# saved at step 2 under the first layout, resumed for the last step under the others
RESUME = [(2, 2, 1, 1, "zbv", 2), (1, 4, 1, 0, "zb1", 4), (1, 2, 2, 0, "1f1b", 2)]
WORLD8 = [("pp4-tp2-zbv-m8", 1, 4, 2, 0, "zbv", 8), ("pp4-tp2-zb1-m4", 1, 4, 2, 0, "zb1", 4),
          ("dp2-pp4-z1-zb1-m8", 2, 4, 1, 1, "zb1", 8),
          ("dp2-pp4-z1-zbv-m4", 2, 4, 1, 1, "zbv", 4),
          # ZeRO-3 with tp beside it: B gathers a chunk's tp shards' flats, W reads none
          ("dp2-pp2-tp2-z3-zb1-m4", 2, 2, 2, 3, "zb1", 4),
          ("dp2-pp2-tp2-z3-zbv-m2", 2, 2, 2, 3, "zbv", 2)]


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def _fit_gpt(run_dir: str, dp: int = 1, pp: int = 1, tp: int = 1, zero: int = 0,
             schedule: str = "1f1b", m: int = 1, steps: int = STEPS,
             checkpoint: dict | None = None, start: int = 0, train: dict | None = None
             ) -> dict[str, torch.Tensor] | None:
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    train = {**_tiny_train(), "steps": steps, "global_batch": BATCH, "grad_accum": m,
             "schedule": "constant", "warmup_steps": 0, "grad_clip": 1.0, **(train or {})}
    cfg = load_config(values={"model": GPT_MODEL, "train": train,
                              "checkpoint": checkpoint or {"every": 0},
                              "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero,
                                           "pp_schedule": schedule},
                              "monitor": {"peak_tflops": 1.0}})
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(GPT(cfg.model), SyntheticTokens(mask=True), token_loss, cfg,
                      run_dir=run_dir, collate_fn=collate_token_batch, progress=False)
    trainer.fit()
    assert trainer.start_step == start, (run_dir, trainer.start_step)
    return full_state(trainer.parallel)


def _fit_llama(run_dir: str, dp: int, pp: int, tp: int, zero: int, schedule: str,
               m: int, train: dict | None = None) -> dict[str, torch.Tensor] | None:
    from disttrain import Trainer

    trainer = Trainer(_llama(), padded_rows(4 * BATCH, SEQ, VOCAB), config={
        "train": {**HF_TRAIN, "grad_accum": m, **(train or {})}, "checkpoint": {"every": 0},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero, "pp_schedule": schedule},
        "monitor": {"peak_tflops": 1.0}}, run_dir=run_dir, progress=False)
    trainer.fit()
    return full_state(trainer.parallel)


def _fit_cases(root: str, cases: list[tuple], resume: list[tuple] = ()) -> dict:
    out = {}
    for name, *layout in cases:
        train = layout.pop() if isinstance(layout[-1], dict) else None  # [train] extras
        out["gpt", name] = _fit_gpt(f"{root}/gpt-{name}", *layout, train=train)
        out["llama", name] = _fit_llama(f"{root}/llama-{name}", *layout, train=train)
    if resume:
        import shutil

        import torch.distributed as dist

        every = {"every": 2, "async": False}
        _fit_gpt(f"{root}/saved", *resume[0], steps=2, checkpoint=every)
        for k, layout in enumerate(resume[1:]):
            if dist.get_rank() == 0:
                shutil.copytree(f"{root}/saved", f"{root}/resumed-{k}")
            dist.barrier()
            out["resumed", k] = _fit_gpt(f"{root}/resumed-{k}", *layout, checkpoint=every,
                                        start=2)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("ref")
    gpt = run_distributed(_fit_gpt, 1, args=(str(root / "gpt"),), timeout=120)[0]
    llama = plain_loop(_llama(), padded_rows(4 * BATCH, SEQ, VOCAB), HF_TRAIN,
                       steps=STEPS, batch=BATCH)
    return {"gpt": gpt, "llama": {k: v.detach().clone() for k, v in
                                  llama.named_parameters()}}


def _check(got: dict, references: dict, cases: list) -> None:
    for family in ("gpt", "llama"):
        want = references[family]
        for name, *_ in cases:
            weights = got[family, name]
            assert weights is not None, (family, name)
            # the GPT's head.weight is tok_emb.weight (tied): one of them in a full state
            assert set(want) - set(weights) <= {"head.weight"}, (family, name)
            for k in set(want) & set(weights):
                what = f"{family} {name} {k}"
                torch.testing.assert_close(weights[k], want[k], atol=1e-4, rtol=0,
                                           msg=lambda m, what=what: f"{what}: {m}")


def test_zero_bubble_schedules_follow_one_process_at_world_4(references, tmp_path):
    got = run_distributed(_fit_cases, 4, args=(str(tmp_path), WORLD4, RESUME),
                          timeout=600)[0]
    _check(got, references, WORLD4)
    for k in range(len(RESUME) - 1):  # a checkpoint of zbv resumed under zb1 and 1f1b
        _check({("gpt", "resumed"): got["resumed", k], ("llama", "resumed"): references[
            "llama"]}, references, [("resumed",)])


def test_zero_bubble_schedules_follow_one_process_at_world_8(references, tmp_path):
    got = run_distributed(_fit_cases, 8, args=(str(tmp_path), WORLD8), timeout=600)[0]
    _check(got, references, WORLD8)


@pytest.mark.parametrize("parallel, train, field", [
    ({"pp": 4, "pp_schedule": "zbv"}, {}, "parallel.pp_schedule"),  # 8 chunks, 4 blocks
    # W would recompute a checkpointed block whose weights ZeRO-3 freed after its B
    ({"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "zb1"},
     {"activation_checkpointing": "full"}, "train.activation_checkpointing"),
    ({"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "zbv"},
     {"activation_checkpointing": "every_k"}, "train.activation_checkpointing"),
    # a compiled block's backward is one node, and refuses the graph kept for W
    ({"pp": 2, "pp_schedule": "zb1"}, {"compile": True}, "train.compile"),
])
def test_zero_bubble_layouts_that_cannot_run_are_refused_with_the_fix(parallel, train,
                                                                      field):
    from disttrain.config import load_config
    from disttrain.errors import ConfigError
    from disttrain.run_checks import resolve

    values = {"model": {**GPT_MODEL, "n_layer": 4}, "train": {"grad_accum": 4, **train},
              "parallel": parallel, "checkpoint": {"every": 0}}
    with pytest.raises(ConfigError) as info:
        resolve(load_config(values=values), 4)
    assert info.value.field == field and info.value.fix
    assert "\n" not in str(info.value)
