"""The fused linear + cross-entropy against ``F.cross_entropy`` on the full logits.

In-process (tp 1): the summed loss, its count and the gradients of the hidden states,
the weight and the bias equal plain PyTorch's (``F.linear`` then ``F.cross_entropy``
with ``reduction="sum"``), with ignored targets (a whole row too), label smoothing,
chunk sizes that divide the token count and ones that do not; under bf16 autocast the
fused loss follows the unfused one. Which heads it stands in for (the GPT's, a
transformers Llama's; not where the config or the forward changes the logits), and the
swap on a pipeline chunk. One spawn of 4 ranks then runs, over groups of 4 and of 2
(sub-groups {0, 1}, {2, 3}): the vocabulary-parallel function on each rank's rows, the
tensor-parallel GPT (with and without sequence parallelism) with its head swapped for
the fused loss, and the GPT cut into pipeline stages with the fused loss on the last,
each against the one-process full-logits loss and every gradient.

Tolerance (fp32): rtol 1e-5, atol 1e-5. The fused loss sums the same terms per chunk
and over tp ranks in other groupings (~1e-7 relative); a lost or doubled chunk, a
counted ignored token, smoothing applied to the wrong terms or a gradient row from the
wrong vocabulary shard moves the loss or a gradient by 1e-2 or more.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from group_checks import assert_check_passed
from support import TINY_MODEL

from disttrain.comm import Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT
from disttrain.parallel import tensor as tpl
from disttrain.parallel.fused_loss import (
    CHUNK_LOGIT_BYTES,
    HiddenStatesHead,
    default_chunk_tokens,
    fuse_output_head,
    linear_cross_entropy,
    replace_submodule,
)
from disttrain.parallel.fused_loss import functions as fused_functions
from disttrain.targets import IGNORE_INDEX, LABEL_IGNORE_INDEX

TOL = {"rtol": 1e-5, "atol": 1e-5}
B, T, D, V = 3, 7, 16, 40  # 21 tokens; V divisible by tp 2 and 4
SCALE = 0.7  # the upstream gradient of the sum (a loss scale, 1 / token count)


KERNELS_HERE = ("cpu", "cuda")  # the fused path (two kernels on CUDA) run eagerly on CPU


@pytest.fixture(params=["in_place", "kernels"])
def path(request, monkeypatch):
    """Each chunk's softmax both ways: in place over fp32 logits (the CPU's), and the
    fused path CUDA compiles (one reduction and one elementwise pass), run eagerly."""
    if request.param == "kernels":
        monkeypatch.setattr(fused_functions, "KERNEL_DEVICES", KERNELS_HERE)
    return request.param


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, **tol: float) -> None:
    torch.testing.assert_close(actual, expected, **(tol or TOL),
                               msg=lambda m: f"{what}: {m}")


def _inputs(seed: int, ignore: int, bias: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden [B, T, D], weight [V, D], bias [V], targets [B, T]: 3 ignored positions
    in row 0 and the whole of row 2."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) / D ** 0.5 * 3
    b = torch.randn(V, generator=g) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 2:5] = ignore
    targets[2] = ignore
    return hidden, weight, b, targets


def _leaves(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _reference(hidden, weight, bias, targets, ignore, smoothing):
    """Plain PyTorch: the full logits, F.cross_entropy summed; gradients of SCALE x it."""
    h, w, b = _leaves(hidden, weight, bias)
    logits = F.linear(h, w, b)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=ignore, reduction="sum", label_smoothing=smoothing)
    (SCALE * loss).backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("chunk", [1, 4, 21, 64, None])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [IGNORE_INDEX, LABEL_IGNORE_INDEX])
def test_loss_and_every_gradient_equal_cross_entropy_on_full_logits(chunk, smoothing,
                                                                    ignore, path):
    hidden, weight, bias, targets = _inputs(1, ignore)
    ref_loss, ref_h, ref_w, ref_b = _reference(hidden, weight, bias, targets, ignore,
                                               smoothing)
    h, w, b = _leaves(hidden, weight, bias)
    loss, count = linear_cross_entropy(h, w, targets, bias=b, ignore_index=ignore,
                                       label_smoothing=smoothing, chunk_tokens=chunk)
    (SCALE * loss).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert isinstance(count, torch.Tensor) and count.dtype == torch.int64
    assert int(count) == int((targets != ignore).sum()) == 11
    _close(loss.detach(), ref_loss, "loss")
    _close(h.grad, ref_h, "hidden grad")
    _close(w.grad, ref_w, "weight grad")
    _close(b.grad, ref_b, "bias grad")
    assert not h.grad[2].any(), "an ignored row got a gradient"


def test_compiled_kernels_compile_twice_at_most_whatever_the_token_count(monkeypatch):
    """The fused path's two functions compiled (inductor's C++ backend standing in for
    Triton): one step after another with a different token count each (chat data
    unpacked) and chunks that leave a shorter last one, each function compiles at most
    twice (the first shape static, then the rows symbolic), not once per count (static
    shapes: 2 per function per count, past dynamo's recompile limit), and every step's
    loss and gradients equal the full logits'."""
    torch._dynamo.reset()
    monkeypatch.setattr(fused_functions, "KERNEL_DEVICES", KERNELS_HERE)
    monkeypatch.setattr(fused_functions, "COMPILE_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(fused_functions, "_COMPILED", {})
    counters = torch._dynamo.utils.counters
    counters.clear()
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, D, generator=g) / D ** 0.5
    for n in (12, 7, 19, 5, 16, 11):
        hidden = torch.randn(n, D, generator=g)
        targets = torch.randint(0, V, (n,), generator=g)
        targets[0] = IGNORE_INDEX
        ref_loss, ref_h, ref_w, _ = _reference(hidden.unsqueeze(0), weight, None,
                                               targets.unsqueeze(0), IGNORE_INDEX, 0.1)
        h, w = _leaves(hidden, weight)
        loss, _ = linear_cross_entropy(h, w, targets, label_smoothing=0.1, chunk_tokens=8)
        (SCALE * loss).backward()
        _close(loss.detach(), ref_loss, f"{n} tokens: loss")
        _close(h.grad, ref_h.squeeze(0), f"{n} tokens: hidden grad")
        _close(w.grad, ref_w, f"{n} tokens: weight grad")
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 4, f"{graphs} graphs for 2 functions over 5 row counts (8, 4, 7, 3, 5)"
    torch._dynamo.reset()


def test_without_bias_and_a_frozen_weight_only_the_hidden_gradient_is_computed(path):
    hidden, weight, _, targets = _inputs(2, IGNORE_INDEX, bias=False)
    ref_loss, ref_h, _, _ = _reference(hidden, weight, None, targets, IGNORE_INDEX, 0.0)
    h = hidden.clone().requires_grad_()
    loss, _ = linear_cross_entropy(h, weight, targets, chunk_tokens=5)
    (SCALE * loss).backward()
    _close(loss.detach(), ref_loss, "loss")
    _close(h.grad, ref_h, "hidden grad")
    assert weight.grad is None


def test_without_gradients_the_loss_is_the_same_and_nothing_is_kept(path):
    hidden, weight, bias, targets = _inputs(3, IGNORE_INDEX)
    ref_loss, *_ = _reference(hidden, weight, bias, targets, IGNORE_INDEX, 0.0)
    h, w, b = _leaves(hidden, weight, bias)
    with torch.no_grad():
        loss, count = linear_cross_entropy(h, w, targets, bias=b, chunk_tokens=6)
    _close(loss, ref_loss, "loss under no_grad")
    assert not loss.requires_grad and loss.grad_fn is None and int(count) == 11


def test_a_second_backward_is_refused():
    hidden, weight, bias, targets = _inputs(4, IGNORE_INDEX)
    h, w = _leaves(hidden, weight)
    loss, _ = linear_cross_entropy(h, w, targets, chunk_tokens=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_under_bf16_autocast_it_follows_the_unfused_head(path):
    """Both multiply in bf16 and take the softmax in fp32; the fused one adds the weight
    gradient's chunks in fp32, the unfused one rounds it to bf16 once: they agree to
    bf16's precision (2^-8 relative, atol 2e-2 on gradients of order 1)."""
    hidden, weight, bias, targets = _inputs(5, IGNORE_INDEX)
    h1, w1, b1 = _leaves(hidden, weight, bias)
    h2, w2, b2 = _leaves(hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h1, w1, b1).flatten(0, 1).float(),
                              targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss, _ = linear_cross_entropy(h2, w2, targets, bias=b2, chunk_tokens=4)
    ref.backward()
    loss.backward()
    bf16 = {"rtol": 1e-2, "atol": 2e-2}
    _close(loss.detach(), ref.detach(), "bf16 loss", **bf16)
    for got, want, what in ((h2, h1, "hidden"), (w2, w1, "weight"), (b2, b1, "bias")):
        assert got.grad.dtype == torch.float32, what
        _close(got.grad, want.grad, f"bf16 {what} grad", **bf16)


@pytest.mark.parametrize("kwargs, message", [
    ({"weight": torch.zeros(V, D + 1)}, "weight has shape"),
    ({"bias": torch.zeros(V + 1)}, "bias has shape"),
    ({"targets": torch.zeros(B, T + 1, dtype=torch.long)}, "targets for"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
])
def test_wrong_arguments_are_refused_with_the_fix(kwargs, message):
    hidden, weight, bias, targets = _inputs(6, IGNORE_INDEX)
    given = {"weight": weight, "targets": targets, "bias": bias, **kwargs}
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(hidden, given.pop("weight"), given.pop("targets"), **given)


def test_default_chunk_keeps_the_logits_of_a_chunk_under_the_budget():
    assert default_chunk_tokens(8192, 50304) == CHUNK_LOGIT_BYTES // (4 * 50304) == 1334
    assert default_chunk_tokens(8192, 50304 // 4) == 5336  # tp 4: four times the tokens
    assert default_chunk_tokens(10, 64) == 10 and default_chunk_tokens(0, 64) == 1


# ---- which heads it stands in for, and the swap ------------------------------------------

def _llama(cls: type | None = None, **config: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    values = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0, **config}
    return (cls or transformers.LlamaForCausalLM)(transformers.LlamaConfig(**values))


def test_the_gpt_and_a_transformers_llama_name_a_head_the_fused_loss_stands_in_for():
    from disttrain.models import gpt_spec
    from disttrain.parallel.fused_loss import head_refusal
    from disttrain.spec import spec_for

    cfg = ModelConfig(**TINY_MODEL)
    assert gpt_spec(cfg).head == "head" and head_refusal(GPT(cfg), gpt_spec(cfg)) is None
    llama = _llama()
    spec = spec_for(llama)
    assert spec.head == "lm_head" and head_refusal(llama, spec) is None  # ran its twin
    with torch.device("meta"):
        on_meta = _llama()
    assert head_refusal(on_meta, spec_for(on_meta)) is None


@pytest.mark.parametrize("family, key", [("gemma2", "final_logit_softcapping"),
                                         ("cohere", "logit_scale")])
def test_a_config_that_changes_the_logits_after_the_head_leaves_it_off(family, key):
    transformers = pytest.importorskip("transformers")
    from disttrain.parallel.fused_loss import head_refusal
    from disttrain.spec import spec_for

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
             "pad_token_id": 0}
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=8, **small))
    else:
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**small))
    spec = spec_for(model)
    assert spec.head is None and key in spec.head_refusal
    assert key in head_refusal(model, spec)


def test_a_forward_that_changes_the_heads_output_is_seen_and_left_unfused():
    """No config key says so: running the model (its small twin) shows the logits are
    not the head's output tensor, unchanged."""
    transformers = pytest.importorskip("transformers")
    from disttrain.parallel.fused_loss import head_refusal
    from disttrain.spec import spec_for

    class DoubledLogits(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = _llama(DoubledLogits)
    spec = spec_for(model)
    assert spec.head == "lm_head"
    assert "changes the output of its head 'lm_head'" in head_refusal(model, spec)


def test_the_swap_on_a_pipeline_chunk_leaves_the_model_its_own_modules():
    """The last chunk of a transformers model runs the model's forward on a shell: the
    head swapped there (and a module at a nested path) is swapped in the shell, the
    model keeps its own; the chunk then returns hidden states, and gives logits again
    once the head is back."""
    from disttrain.parallel.pipeline import build_chunks, plan_stages
    from disttrain.spec import spec_for

    model = _llama()
    spec = spec_for(model)
    last = build_chunks(model, spec, plan_stages(spec, pp=2), 1)[0]
    head, norm = model.lm_head, model.model.norm
    inputs = SimpleNamespace(args=(), kwargs={"input_ids": torch.arange(8).unsqueeze(0)})
    hidden = torch.randn(1, 8, 32)
    seen = {}

    def keep(_m, args, _out) -> None:
        seen["in"] = args[0]

    hook = norm.register_forward_hook(keep)
    with torch.no_grad():
        want_logits = last(hidden, inputs)
    hook.remove()
    fused = fuse_output_head("lm_head", (last, last.replace_module))
    stand_in = torch.nn.Identity()
    assert last.replace_module("model.norm", stand_in) is norm
    assert model.lm_head is head and model.model.norm is norm
    assert last.get_submodule("model.norm") is stand_in
    with torch.no_grad():
        out = last(hidden, inputs)  # its block's output: no norm, no head after it
        torch.testing.assert_close(out, seen["in"], rtol=0, atol=0)
        fused.restore()
        last.replace_module("model.norm", norm)
        logits = last(hidden, inputs)
    assert last.get_submodule("lm_head") is head
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)


# ---- vocabulary-parallel: one spawn of 4 ranks, tp 4 and tp 2 --------------------------

def _check_vocab_parallel(comm: Communicator) -> None:
    """Each rank's rows of W and b: the same loss on every rank, the hidden gradient
    summed over tp (the copy into the tp region) and each rank's rows of the weight and
    bias gradients equal the full ones; two small all-reduces per chunk, no logits."""
    size, rank = comm.size, comm.rank
    for devices, chunk, smoothing in ((("cuda",), 4, 0.0), (("cuda",), 21, 0.1),
                                      (("cuda",), 5, 0.2), (KERNELS_HERE, 4, 0.0),
                                      (KERNELS_HERE, 5, 0.2)):
        fused_functions.KERNEL_DEVICES = devices  # in place, then the fused path
        hidden, weight, bias, targets = _inputs(7, IGNORE_INDEX)
        ref_loss, ref_h, ref_w, ref_b = _reference(hidden, weight, bias, targets,
                                                   IGNORE_INDEX, smoothing)
        h = hidden.clone().requires_grad_()
        w, b = _leaves(weight.chunk(size)[rank], bias.chunk(size)[rank])
        start = comm.ledger.seq
        loss, count = linear_cross_entropy(tpl.copy_to_tp_region(h, comm), w, targets,
                                           bias=b, label_smoothing=smoothing,
                                           chunk_tokens=chunk, comm=comm)
        records = list(comm.ledger.records)[-(comm.ledger.seq - start):]
        (SCALE * loss).backward()
        what = f"{devices}: chunk {chunk}, smoothing {smoothing}"
        _close(loss.detach(), ref_loss, f"{what}: loss")
        assert int(count) == 11
        _close(h.grad, ref_h, f"{what}: hidden grad")
        _close(w.grad, ref_w.chunk(size)[rank], f"{what}: weight grad rows")
        _close(b.grad, ref_b.chunk(size)[rank], f"{what}: bias grad rows")
        chunks = -(-B * T // chunk)
        assert [r.op for r in records] == ["all_reduce"] * 2 * chunks, records
        assert all(torch.Size(r.shape).numel() <= 3 * chunk for r in records), records


def _check_gpt_head(comm: Communicator, sequence_parallel: bool) -> None:
    """The tensor-parallel GPT (tied head, vocabulary-parallel) with its head swapped
    for the fused loss: the model returns hidden states [B, T, d], the loss and every
    parameter's gradient equal the full GPT's unfused ones; the head comes back."""
    torch.manual_seed(0)
    full = GPT(ModelConfig(**{**TINY_MODEL, "n_head": 4}))
    model = copy.deepcopy(full)
    tp = tpl.apply_tensor_parallel(model, comm, sequence_parallel=sequence_parallel)
    vocab_head = model.head
    fused = fuse_output_head("head", (model, functools.partial(replace_submodule, model)))
    assert isinstance(model.head, HiddenStatesHead) and model.head.weight is model.tok_emb.weight
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, TINY_MODEL["seq_len"]), generator=g)
    targets = torch.randint(0, TINY_MODEL["vocab_size"], ids.shape, generator=g)
    targets[1, :5] = IGNORE_INDEX
    ref = F.cross_entropy(full(ids).flatten(0, 1), targets.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    (ref / 27).backward()
    hidden = model(ids)
    assert hidden.shape == (2, TINY_MODEL["seq_len"], TINY_MODEL["d_model"])
    loss, count = fused.token_loss(hidden, targets, IGNORE_INDEX)
    (loss / 27).backward()
    tp.sync_replicated_grads()
    _close(loss.detach(), ref.detach(), "GPT loss")
    assert int(count) == 27
    full_params = dict(full.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(full_params)
    for name, p in model.named_parameters():
        _close(p.grad, tp.local_from_global(name, full_params[name].grad), f"{name}.grad")
    fused.restore()
    assert model.head is vocab_head


def _check_pipeline(comm: Communicator) -> None:
    """The 4-block GPT cut into comm.size stages (1F1B, 4 micro-batches), its head on the
    last stage (a copy of the tied weight there) swapped for the fused loss: the
    summed loss and every parameter's gradient (tied copies summed between the first
    and last stage) equal the full GPT's with F.cross_entropy on its logits."""
    from disttrain.models import gpt_spec
    from disttrain.parallel.pipeline import (
        build_chunks,
        build_schedule,
        chunk_param_names,
        plan_stages,
        run_pipeline,
        sync_tied_grads,
    )

    cfg = ModelConfig(**{**TINY_MODEL, "n_layer": 4})
    torch.manual_seed(0)
    full, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(full.state_dict())
    spec = gpt_spec(cfg)
    chunks = build_chunks(model, spec, plan_stages(spec, pp=comm.size), comm.rank)
    last = next((c for c in chunks if c.is_last), None)
    fused = fuse_output_head("head", None if last is None else (last, last.replace_module))
    g = torch.Generator().manual_seed(9)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=g)
        targets[0, :3] = IGNORE_INDEX
        batches.append((ids, targets))
    ref_loss = sum(F.cross_entropy(full(i).flatten(0, 1), t.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
                   for i, t in batches)
    (ref_loss / 100).backward()
    result = run_pipeline(chunks, batches, lambda y, t: fused.token_loss(y, t, IGNORE_INDEX),
                          comm, build_schedule("1f1b", pp=comm.size, m=4),
                          activation_shape=(2, cfg.seq_len, cfg.d_model), loss_scale=1 / 100)
    sync_tied_grads(chunks, comm)
    if last is not None:
        _close(torch.as_tensor(result.loss_sum).float(), ref_loss.detach(), "pipeline loss")
        assert int(result.count) == 4 * 2 * cfg.seq_len - 4 * 3
    full_params = dict(full.named_parameters())
    for chunk in chunks:
        names = chunk_param_names(chunk)
        for n, p in chunk.named_parameters():
            _close(p.grad, full_params[names[n]].grad, f"stage {comm.rank}: {n}.grad")


CHECKS = {
    "function": _check_vocab_parallel,
    "pipeline": _check_pipeline,
    "gpt": functools.partial(_check_gpt_head, sequence_parallel=False),
    "gpt_sp": functools.partial(_check_gpt_head, sequence_parallel=True),
}


@pytest.mark.parametrize("size", (4, 2))
@pytest.mark.parametrize("check", list(CHECKS))
def test_vocabulary_parallel_and_pipelined_fused_loss_match_the_full_logits(check, size):
    assert_check_passed(__name__, check, size, (4, 2), "tp")
