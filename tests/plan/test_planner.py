"""disttrain plan: published closed forms, the schedules' in-flight counts, the search
over a trillion-parameter model, and the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from disttrain.cli import main
from disttrain.config.schema import ModelConfig
from disttrain.models import num_params
from disttrain.parallel.pipeline import build_schedule
from disttrain.parallel.pipeline.pricing import in_flight
from disttrain.plan import (
    PRESETS,
    ModelShape,
    Options,
    PlannedLayout,
    estimate,
    layer_activation_bytes,
    parse_model,
    search,
)
from disttrain.plan.memory import model_state_bytes
from disttrain.shape import gpt_shape, rank_params


def test_zero_paper_example_exactly():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64-way data parallel,
    # mixed-precision Adam (K = 12): 120, 31.4, 16.6 and 1.9 GB per device
    want = {0: 120.0, 1: 31.40625, 2: 16.640625, 3: 1.875}
    for zero, gb in want.items():
        got = model_state_bytes(7.5e9, replicas=64, zero=zero, master_copy=True).model_states / 1e9
        assert got == pytest.approx(gb, rel=1e-12)
    # disttrain's own accounting: fp32 parameters and gradients, 8 B of Adam state
    assert model_state_bytes(7.5e9, replicas=64, zero=0).model_states == 16 * 7.5e9


# Korthikanti et al. 2022, Table 2: activation bytes per layer (16-bit activations,
# dropout, no fused attention), s = seq, b = micro-batch, h = hidden, a = heads, t = tp
KORTHIKANTI = {
    ("none", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", True): lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h),
    ("selective", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", True): lambda s, b, h, a, t: s * b * h / t * 34,
    ("full", False): lambda s, b, h, a, t: 2 * s * b * h,
    ("full", True): lambda s, b, h, a, t: 2 * s * b * h / t,
}


@pytest.mark.parametrize("recompute, sp", sorted(KORTHIKANTI))
def test_activation_formulas_of_korthikanti(recompute, sp):
    for h, a, s, b, t in ((12288, 96, 2048, 1, 8), (25600, 160, 2048, 1, 8),
                          (4096, 32, 4096, 2, 4), (1024, 16, 1024, 4, 1)):
        if sp and t == 1:
            continue
        shape = ModelShape(layers=2, hidden=h, heads=a, seq=s, vocab=51200, dropout=True,
                           flash=False)
        got = layer_activation_bytes(shape, b=b, shards=t, sp=sp, recompute=recompute,
                                     precision="bf16", accounting="mixed")
        assert got == pytest.approx(KORTHIKANTI[recompute, sp](s, b, h, a, t), rel=1e-12)


def test_activation_variants_that_the_paper_does_not_cover():
    base = ModelShape(layers=2, hidden=4096, heads=32, seq=4096, vocab=32000)
    s, b, h = 4096, 1, 4096
    dense = layer_activation_bytes(base, b=b, precision="bf16", accounting="mixed")
    # no dropout, fused attention: 4sbh norms, 4sbh matmul inputs, 24sbh split, 4asb lse
    assert dense == s * b * h * 32 + 4 * 32 * s * b
    gated = replace(base, gated=True, ffn=11008)
    grown = layer_activation_bytes(gated, b=b, precision="bf16", accounting="mixed")
    assert grown - dense == 2 * s * b * (4 * 11008 - 2 * 4 * h)  # gate, up, act, product
    gqa = replace(base, kv_heads=8)
    shrunk = layer_activation_bytes(gqa, b=b, precision="bf16", accounting="mixed")
    assert dense - shrunk == 2 * s * b * 2 * (h - 8 * 128)  # k and v at the kv width


def test_in_flight_is_what_the_schedules_keep():
    for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3)):
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp, 4 * pp):
                schedule = build_schedule(name, pp=pp, m=m, v=v)
                for rank, actions in enumerate(schedule.actions):
                    alive = peak = 0
                    for a in actions:
                        alive += 1 if a.kind == "F" else -1
                        peak = max(peak, alive)
                    assert in_flight(name, pp, m, v, rank) == peak, (name, pp, m, v, rank)


def test_gpt_shape_counts_the_models_parameters():
    for cfg in (ModelConfig(), ModelConfig(n_layer=3, d_model=96, n_head=6, seq_len=64,
                                          vocab_size=300)):
        shape = gpt_shape(cfg)
        assert shape.num_params() == num_params(cfg)
        # tp and pp split it without losing or doubling anything but the replicas
        whole = sum(rank_params(shape, 1, n, r == 0, r == 1, 2)
                    for r, n in enumerate((cfg.n_layer - 1, 1)))
        assert whole == num_params(cfg) + cfg.vocab_size * cfg.d_model  # tied copy


def _one_trillion() -> tuple[ModelShape, object]:
    # Narayanan et al. 2021's 1T model: 128 layers, hidden 25600, 160 heads
    shape = ModelShape(name="1t", layers=128, hidden=25600, heads=160, seq=2048,
                       vocab=51200, dropout=True, flash=False)
    return shape, replace(PRESETS["a100-80gb"], nodes=384)


def test_search_over_a_trillion_parameters_keeps_only_rows_that_fit():
    shape, cluster = _one_trillion()
    assert shape.num_params() == pytest.approx(1.008e12, rel=1e-3)
    # every degree, schedule and micro-batch, in the modes of Narayanan et al.'s run (no
    # ZeRO, full recomputation): 130,940 layouts rather than 1.57 million, the same rules
    result = search(shape, cluster, 3072, Options(accounting="mixed"), top=20, zero=(0,),
                    recompute=("full",))
    assert len(result.rows) == 20 and result.rejected["does not fit in memory"] > 0
    assert result.least_overflow_gib > 0
    budget = cluster.memory_gib * 2**30
    for row in result.rows:
        assert row.fits and row.memory_bytes <= budget
        full = estimate(shape, cluster, row.layout, 3072, Options(accounting="mixed"),
                        all_stages=True)
        assert max(s.total for s in full.stages) == pytest.approx(row.memory_bytes)
    times = [r.step_time_s for r in result.rows]
    assert times == sorted(times)


def test_megatron_1t_layout_is_predicted_near_its_published_throughput():
    # Narayanan et al. 2021, Table 1: 1T, tp 8 x pp 64 x dp 6, batch 3072, full
    # recomputation: 163 TFLOP/s per A100 (52% of peak). Not fitted to: the presets
    # come from datasheets and public microbenchmarks, so this is a check (+4% today;
    # bench/plan.py prints it).
    shape, cluster = _one_trillion()
    est = estimate(shape, cluster, PlannedLayout(tp=8, pp=64, dp=6, mbs=1, recompute="full"),
                   3072, Options(accounting="mixed"))
    assert est.tflops_per_gpu == pytest.approx(163, rel=0.1)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_json_rows_with_every_field(capsys):
    code, out, _ = _plan(capsys, "--model", "layers=8,hidden=512,heads=8,seq=256,vocab=5000",
                         "--cluster", "gpu=h100-80gb,gpus_per_node=4,nodes=2",
                         "--global-batch", "64", "--json", "--top", "3")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 3
    for row in rows:
        for key in ("tp", "pp", "cp", "dp", "v", "mbs", "zero", "recompute", "sp", "step_time_s",
                    "tflops_per_gpu", "mfu", "tokens_per_s", "memory_gib",
                    "memory_breakdown_gib", "bottleneck", "rejected"):
            assert key in row
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == 8
        assert set(row["memory_breakdown_gib"]) == {"params", "grads", "optimizer",
                                                     "activations", "communication",
                                                     "other"}


def test_one_layout_explained_and_emitted_as_a_runnable_config(capsys, tmp_path):
    out_toml = tmp_path / "best.toml"
    code, out, _ = _plan(capsys, "--model", "gpt", "--cluster", "gpu=a100-80gb,"
                         "gpus_per_node=8", "--global-batch", "16", "--layout",
                         "tp=2,pp=2,mbs=2,zero=1", "--explain", "--emit-config",
                         str(out_toml))
    assert code == 0 and "best: tp=2,pp=2,cp=1,dp=2" in out and "bottleneck" in out
    from disttrain.config import load_config
    from disttrain.run_checks import resolve
    config = load_config(out_toml)
    assert (config.parallel.tp, config.parallel.pp, config.train.micro_batch) == (2, 2, 2)
    resolve(config, 8)


@pytest.mark.parametrize("args, message", [
    (["--cluster", "gpu=a100-80gb", "--global-batch", "8"], "needs --model"),
    (["--model", "layers=2,hidden=64", "--global-batch", "8"], "lacks heads, seq, vocab"),
    (["--model", "gpt", "--cluster", "gpu=v100", "--global-batch", "8"], "not a preset"),
    (["--model", "gpt", "--global-batch", "8", "--layout", "tp=3"], "does not divide"),
    (["--model", "gpt", "--global-batch", "6", "--layout", "tp=2,pp=2,dp=2,mbs=4"],
     "does not divide the global batch"),
    (["--model", "gpt", "--global-batch", "8", "--layout", "tp=2,pp=2,dp=4"],
     "tp x pp x cp x dp != 8 devices"),
    (["--model", "/nonexistent/config.json", "--global-batch", "8"], "cannot read"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = _plan(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_nothing_fits_says_by_how_much(capsys):
    code, _, err = _plan(capsys, "--model", "layers=96,hidden=12288,heads=96,seq=2048,"
                         "vocab=50257", "--cluster", "gpu=a100-40gb,gpus_per_node=8",
                         "--global-batch", "8")
    assert code == 2 and "no layout" in err and "over by" in err


def test_transformers_configs_are_read(tmp_path):
    llama = tmp_path / "config.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096,
                                 "intermediate_size": 11008, "num_attention_heads": 32,
                                 "num_key_value_heads": 32, "num_hidden_layers": 32,
                                 "vocab_size": 32000, "max_position_embeddings": 4096,
                                 "tie_word_embeddings": False}))
    shape = parse_model(f"{llama},seq=2048")
    assert shape.seq == 2048 and shape.gated and shape.norm == "rmsnorm"
    assert shape.num_params() == 6_738_415_616  # Llama-2-7B's published count
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
                                "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}))
    assert parse_model(str(gpt2)).num_params() == 124_439_808  # GPT-2 small


def test_framework_time_adds_on_a_cpu_and_hides_behind_a_gpus_kernels():
    shape = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=100)
    lay = PlannedLayout(dp=1, mbs=2)  # 4 micro-batches of 2
    base = replace(PRESETS["a100-80gb"], gpus_per_node=1, layer_overhead_s=0.0,
                   async_dispatch=False)
    plain = estimate(shape, base, lay, 8, Options(precision="fp32")).step_time_s
    host = replace(base, layer_overhead_s=1e-3, tensor_overhead_s=1e-5)
    added = estimate(shape, host, lay, 8, Options(precision="fp32")).step_time_s
    tensors = 4 * (4 + 4 + 4) + 1 + 2  # per layer: matrices, biases, norms; embedding;
    # the final norm (tied head, no learned positions)
    assert added - plain == pytest.approx(4 * 4 * 1e-3 + tensors * 1e-5, rel=1e-9)
    # on a GPU the host runs ahead: a layer takes the longer of kernels and host time
    big = ModelShape(layers=4, hidden=4096, heads=32, seq=4096, vocab=32000)
    gpu = PRESETS["h100-80gb"]
    lay8 = PlannedLayout(dp=8, mbs=1)
    with_host = estimate(big, gpu, lay8, 8, Options()).step_time_s
    without = estimate(big, replace(gpu, layer_overhead_s=0.0), lay8, 8,
                       Options()).step_time_s
    assert with_host == without


def test_plan_states_the_loss_it_assumed_and_the_fused_loss_holds_less(capsys, tmp_path):
    """--fused-loss off prices the full logits; left out, --config's train.fused_loss
    decides (on by default); the table's first line and each JSON row say which, and an
    emitted config keeps it. At vocabulary 50,257 the logits of 8 x 2048 tokens (3 GiB in
    fp32) are far more than the fused loss's gradients and chunk."""
    model = "layers=4,hidden=1024,heads=16,seq=2048,vocab=50257"
    args = ["--model", model, "--cluster", "gpu=a100-80gb,gpus_per_node=1",
            "--global-batch", "8", "--layout", "mbs=8"]
    code, out, _ = _plan(capsys, *args)
    assert code == 0 and "fused linear + cross-entropy" in out.splitlines()[0]
    rows = {}
    for flag in ("on", "off"):
        code, out, _ = _plan(capsys, *args, "--json", "--fused-loss", flag)
        rows[flag] = json.loads(out)[0]
        assert code == 0 and rows[flag]["fused_loss"] == (flag == "on")
    saved = (rows["off"]["memory_breakdown_gib"]["activations"]
             - rows["on"]["memory_breakdown_gib"]["activations"])
    assert saved > 2.0, rows  # of the 3 GiB of fp32 logits [8 x 2048, 50257]
    config = tmp_path / "off.toml"
    config.write_text("[train]\nfused_loss = false\n")
    code, out, _ = _plan(capsys, *args, "--config", str(config), "--emit-config",
                         str(tmp_path / "best.toml"))
    assert code == 0 and "loss on the full logits" in out.splitlines()[0]
    from disttrain.config import load_config
    assert load_config(tmp_path / "best.toml").train.fused_loss is False
