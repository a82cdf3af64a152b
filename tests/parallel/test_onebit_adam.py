"""1-bit Adam (train.optimizer = onebit_adam) against references computed here.

- warmup only (freeze_step beyond the run): torch's AdamW in one process;
- with the freeze: an independent single-process simulation of W workers (each one's
  gradient on its slice of the global batch, its momentum over the frozen step size
  compressed to scale x sign per chunk with its own residual, each chunk's server
  averaging, compressing again, keeping its residual), written with plain tensors (no
  bit packing, no collectives);
- resume: from a checkpoint taken after the freeze, the same trajectory as the
  uninterrupted run, bit for bit; from another layout (dp 4 -> dp 2 x pp 2), the
  residuals are cut and averaged as documented.

One spawn of 4 ranks runs every distributed case.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support import SyntheticTokens, fit_tiny, state_of, tiny_config

from disttrain.checkpoint import open_checkpoint
from disttrain.data import GlobalOrderSampler, collate_token_batch
from disttrain.errors import ConfigError
from disttrain.models import GPT, token_loss
from disttrain.parallel.onebit import OnebitAdam
from disttrain.parallel.placement import whole_model_placement
from disttrain.parallel.replicated import ReplicatedState
from disttrain.testing import run_distributed
from disttrain.train.optim import lr_at
from disttrain.validation import resolve

STEPS, FREEZE = 8, 3
# Gradients reach the parameters through different summation orders (one process
# against all-reduces and pipeline stages): ~1e-7 relative. Adam divides by sqrt(v), so
# that becomes ~1e-7 of lr per step; 1e-5 allows it, while a wrong scale, a missing
# residual or a wrong average moves parameters by ~lr = 3e-3.
ATOL = 1e-5
# After the freeze an element whose compressed value sits within rounding of zero may
# take the other sign in one of the two computations: that element then differs by up
# to ~2 lr. At most this fraction of the elements may do so (none did when written).
FLIPPED = 1e-3


def _onebit(**keys):
    return dict(optimizer="onebit_adam", freeze_step=FREEZE, **keys)


# ------------------------------------------------------------------ references
def _worker_grads(model, data, cfg, step: int, workers: int) -> tuple[list, float]:
    """Each worker's summed-loss gradient on its slice of global batch ``step``, and the
    global number of loss terms."""
    batch = resolve(cfg, workers).batch
    sampler = GlobalOrderSampler(len(data), cfg.train.seed)
    grads, total = [], 0.0
    for w in range(workers):
        idx = sampler.rank_slice(step * batch.global_batch, batch.global_batch, w, workers)
        b = collate_token_batch([data[i] for i in idx])
        model.zero_grad()
        loss_sum, count = token_loss(model(b["input_ids"]), b["targets"])
        loss_sum.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        total += float(count)
    return grads, total


def _clip(tensors: list[torch.Tensor], norm: float, limit: float) -> None:
    if limit > 0 and norm > limit:
        for t in tensors:
            t.mul_(limit / (norm + 1e-6))


def _compress(x: torch.Tensor) -> torch.Tensor:
    """mean |x| x sign(x), sign(0) = +1 (an empty chunk stays empty)."""
    if x.numel() == 0:
        return x.clone()
    return x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)


def reference_onebit(workers: int, steps: int = STEPS, **train) -> dict[str, torch.Tensor]:
    cfg = tiny_config(steps=steps, **_onebit(**train))
    t = cfg.train
    data = SyntheticTokens()
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    params = list(model.parameters())
    decay = [t.weight_decay if p.dim() >= 2 else 0.0 for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    worker_err = [[torch.zeros(p.numel()) for p in params] for _ in range(workers)]
    server_err = [torch.zeros(p.numel()) for p in params]
    for step in range(steps):
        lr = lr_at(step, t, t.lr)
        grads, total = _worker_grads(model, data, cfg, step, workers)
        if step < FREEZE:  # AdamW on the global gradient
            g = [sum(gw[i] for gw in grads) / total for i in range(len(params))]
            _clip(g, math.sqrt(sum(float(x.pow(2).sum()) for x in g)), t.grad_clip)
            for i in range(len(params)):
                m[i] = t.beta1 * m[i] + (1 - t.beta1) * g[i]
                v[i] = t.beta2 * v[i] + (1 - t.beta2) * g[i] ** 2
        else:  # each worker's estimate of the global gradient, compressed momentum
            est = [[workers * x / total for x in gw] for gw in grads]
            sq = sum(float(x.pow(2).sum()) for gw in est for x in gw) / workers
            for gw in est:
                _clip(gw, math.sqrt(sq), t.grad_clip)
            for i, p in enumerate(params):
                # compressed in units of the frozen step size sqrt(v_hat) + eps
                d = ((v[i] / (1 - t.beta2 ** FREEZE)).sqrt() + 1e-8).reshape(-1)
                n = p.numel()
                chunk = 8 * math.ceil(n / (8 * workers))
                bounds = [(min(n, j * chunk), min(n, (j + 1) * chunk)) for j in range(workers)]
                sent = []
                for w in range(workers):
                    x = ((t.beta1 * m[i] + (1 - t.beta1) * est[w][i]).reshape(-1) / d
                         + worker_err[w][i])
                    c = torch.cat([_compress(x[a:b]) for a, b in bounds])
                    worker_err[w][i] = x - c
                    sent.append(c)
                avg = torch.stack(sent).mean(0) + server_err[i]
                out = torch.cat([_compress(avg[a:b]) for a, b in bounds])
                server_err[i] = avg - out
                m[i] = (out * d).view(p.shape)
        with torch.no_grad():
            k = step + 1
            for i, p in enumerate(params):
                bc1 = 1 - t.beta1 ** k
                bc2 = 1 - t.beta2 ** min(k, FREEZE)
                p.mul_(1 - lr * decay[i])
                p.sub_(lr / bc1 * m[i] / ((v[i] / bc2).sqrt() + 1e-8))
    return state_of(model)


def reference_adamw(steps: int) -> dict[str, torch.Tensor]:
    """torch's AdamW, whole global batch in one process."""
    cfg = tiny_config(steps=steps)
    t, data = cfg.train, SyntheticTokens()
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.dim() < 2],
                              "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2))
    sampler = GlobalOrderSampler(len(data), t.seed)
    g = resolve(cfg, 1).batch.global_batch
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t, t.lr)
        b = collate_token_batch([data[i] for i in sampler.indices(step * g, g)])
        loss_sum, count = token_loss(model(b["input_ids"]), b["targets"])
        opt.zero_grad()
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
    return state_of(model)


# ------------------------------------------------------------------ 4 ranks
def _copy_checkpoint(src: Path, dst: Path, step: int) -> None:
    """A run dir holding only ``src``'s checkpoint of ``step`` (as if it stopped there)."""
    if dist.get_rank() == 0:
        name = f"step-{step:08d}"
        (dst / "checkpoints").mkdir(parents=True)
        shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
        (dst / "checkpoints" / "latest").write_text(name + "\n")
    dist.barrier()


def _four_rank_cases(run_dir: str) -> dict:
    """Every case in one set of processes; rank 0 writes each run's final weights."""
    root = Path(run_dir)
    fit_tiny(5, f"{run_dir}/warm", optimizer="onebit_adam", freeze_step=100)
    replicas = fit_tiny(STEPS, f"{run_dir}/dp4", **_onebit())
    fit_tiny(STEPS, f"{run_dir}/dp2pp2", **_onebit(pp=2))
    fit_tiny(STEPS, f"{run_dir}/dp2tp2", **_onebit(tp=2))
    saving = {"every": 4, "keep": 2, "async": False}
    fit_tiny(STEPS, f"{run_dir}/save", checkpoint=saving, **_onebit())
    _copy_checkpoint(root / "save", root / "resumed", 4)
    fit_tiny(STEPS, f"{run_dir}/resumed", checkpoint=saving, **_onebit())
    _copy_checkpoint(root / "save", root / "resharded", 4)
    fit_tiny(STEPS, f"{run_dir}/resharded", checkpoint=saving, **_onebit(pp=2))
    return replicas


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("onebit")
    replicas = run_distributed(_four_rank_cases, 4, args=(str(run_dir),), timeout=300)
    return replicas, run_dir


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _close(actual: dict, expected: dict, atol: float = ATOL, flipped: float = 0.0) -> None:
    """``actual`` (a weights file: a tied weight once) against the same names in
    ``expected``: at most ``flipped`` of the elements further apart than ``atol``."""
    assert actual.keys() <= expected.keys() and len(actual) >= len(expected) - 1
    off = total = 0
    for name in actual:
        diff = (actual[name] - expected[name]).abs()
        off += int((diff > atol).sum())
        total += diff.numel()
    worst = max(float((actual[k] - expected[k]).abs().max()) for k in actual)
    assert off <= flipped * total, (f"{off} of {total} elements differ by more than "
                                    f"{atol} (at most {worst})")


def test_warmup_is_adamw(four_ranks):
    _close(_weights(four_ranks[1] / "warm"), reference_adamw(5))


@pytest.mark.parametrize("case,workers", [("dp4", 4), ("dp2pp2", 2)])
def test_matches_the_simulated_workers(four_ranks, case, workers):
    expected = reference_onebit(workers)
    cfg = tiny_config()
    torch.manual_seed(cfg.train.seed)
    initial = state_of(GPT(cfg.model))
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 5e-3  # the reference trains: agreeing with it is not agreeing on nothing
    _close(_weights(four_ranks[1] / case), expected, flipped=FLIPPED)


def test_replicas_hold_the_same_parameters(four_ranks):
    ranks = four_ranks[0]
    for rank in ranks[1:]:
        _close(rank, ranks[0], atol=0.0)


def test_resume_after_the_freeze_is_exact(four_ranks):
    root = four_ranks[1]
    _close(_weights(root / "resumed"), _weights(root / "save"), atol=0.0)
    _close(_weights(root / "save"), _weights(root / "dp4"), atol=0.0)


def test_checkpoint_holds_the_residuals(four_ranks):
    run_dir = four_ranks[1]
    ckpt = open_checkpoint(run_dir / "save" / "checkpoints" / "step-00000004")
    cfg = tiny_config()
    torch.manual_seed(0)
    shapes = {n: tuple(p.shape) for n, p in GPT(cfg.model).named_parameters()}
    names = ckpt.reader.names("optim/")
    for name, shape in shapes.items():
        assert ckpt.reader.shape(f"optim/{name}/worker_error") == (4, *shape)
        assert ckpt.reader.shape(f"optim/{name}/server_error") == shape
        assert f"optim/{name}/exp_avg" in names
    moved = ckpt.reader.tensor(f"optim/{next(iter(shapes))}/worker_error")
    assert float(moved.abs().max()) > 0  # the residuals were saved, not zeros


@pytest.mark.parametrize("case", ["resharded", "dp2tp2"])
def test_other_layouts_finish_near_the_dp4_run(four_ranks, case):
    """dp 4 -> dp 2 x pp 2 after the freeze, and dp 2 x tp 2 (each tp shard compressed
    on its own: other chunks, other scales): other trajectories, but the same run, every
    weight within a few steps' moves (lr 3e-3 each) of the dp 4 run's."""
    root = four_ranks[1]
    ours, dp4 = _weights(root / case), _weights(root / "dp4")
    assert all(torch.isfinite(t).all() for t in ours.values())
    assert max(float((ours[k] - dp4[k]).abs().max()) for k in dp4) < 4 * 2 * 3e-3


# ------------------------------------------------------------------ one process
class _Source:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.tensors if n.startswith(prefix))

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)


def test_residuals_reshard_to_another_dp_size():
    """Saved at dp 4, loaded at dp 2 rank 1: the worker residual is the mean of the four
    saved rows, the server residual the elements rank 1 serves at dp 2."""
    layer = torch.nn.Linear(5, 7)
    comm = SimpleNamespace(size=2, rank=1)
    opt = OnebitAdam([{"params": list(layer.parameters()), "weight_decay": 0.0}], comm,
                     freeze_step=1)
    state = ReplicatedState(layer, whole_model_placement(layer), dp_rank=1, dp_size=2)
    g = torch.Generator().manual_seed(0)
    saved = {}
    for name, p in layer.named_parameters():
        saved[f"optim/{name}/worker_error"] = torch.randn(4, *p.shape, generator=g)
        saved[f"optim/{name}/server_error"] = torch.randn(p.shape, generator=g)
        saved[f"optim/{name}/exp_avg"] = torch.randn(p.shape, generator=g)
        saved[f"optim/{name}/exp_avg_sq"] = torch.rand(p.shape, generator=g)
        saved[f"optim/{name}/step"] = torch.tensor(3.0)
        saved[f"model/{name}"] = p.detach().clone()
    state.load_state(_Source(saved), opt)
    for name, p in layer.named_parameters():
        mean = saved[f"optim/{name}/worker_error"].mean(0)
        torch.testing.assert_close(opt.rank_state(p)["worker_error"], mean)
        n = p.numel()
        chunk = 8 * math.ceil(n / 16)
        start, stop, data = opt.range_state(p)["server_error"]
        assert (start, stop) == (min(n, chunk), min(n, 2 * chunk))
        torch.testing.assert_close(data, saved[f"optim/{name}/server_error"].reshape(-1)[start:stop])
        assert "worker_error" not in opt.state[p]  # kept outside optimizer.state
    assert opt.steps_taken == 3 and opt.compressing


def test_a_residual_of_the_wrong_shape_is_refused():
    layer = torch.nn.Linear(5, 7)
    opt = OnebitAdam([{"params": list(layer.parameters()), "weight_decay": 0.0}],
                     SimpleNamespace(size=2, rank=0), freeze_step=1)
    state = ReplicatedState(layer, whole_model_placement(layer), dp_rank=0, dp_size=2)
    saved = {f"model/{n}": p.detach().clone() for n, p in layer.named_parameters()}
    saved["optim/weight/worker_error"] = torch.zeros(2, 7, 4)  # a crafted shape
    with pytest.raises(ValueError, match=r"optim/weight/worker_error: checkpoint shape"):
        state.load_state(_Source(saved), opt)


@pytest.mark.parametrize("keys,field", [
    (dict(zero=1), "train.optimizer"),
    (dict(sync="local_sgd"), "train.optimizer"),
    (dict(codec="topk"), "comm.codec"),
])
def test_refused_combinations_name_the_field(keys, field):
    cfg = tiny_config(optimizer="onebit_adam", **keys)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(cfg, 2)
