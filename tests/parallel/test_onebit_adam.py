"""1-bit Adam (train.optimizer = onebit_adam) against references computed here.

- warmup only (freeze_step beyond the run): torch's AdamW in one process;
- with the freeze: an independent single-process simulation of W workers (each one's
  gradient on its slice of the global batch; b1 times the last averaged momentum plus
  its gradient's share, over the frozen step size, plus its residual, compressed to
  scale x sign per chunk; each chunk's server averaging, compressing again, keeping its
  residual), written with plain tensors (no bit packing, no collectives);
- under ZeRO-1: the same simulation with the chunks cut from ZeRO's flat buffers,
  rebuilt here (each block's matrices, its other parameters, then the rest);
- resume: from a checkpoint taken after the freeze, the same trajectory as the
  uninterrupted run, bit for bit (with and without ZeRO-1); from another layout (dp 4
  -> dp 2 x pp 2, ZeRO-1 -> replicas), the residuals are cut and averaged as
  documented.

One spawn of 4 ranks runs every distributed case.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from support import SyntheticTokens, copy_checkpoint, fit_tiny, state_of, tiny_config

from disttrain.checkpoint import open_checkpoint
from disttrain.data import GlobalOrderSampler, collate_token_batch
from disttrain.errors import ConfigError
from disttrain.models import GPT, token_loss
from disttrain.parallel.onebit import OnebitAdam
from disttrain.parallel.placement import whole_model_placement
from disttrain.parallel.replicated import ReplicatedState
from disttrain.plan.memory import model_state_bytes
from disttrain.run_checks import resolve
from disttrain.testing import run_distributed
from disttrain.train.optim import lr_at

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

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


def _flat_groups(model: GPT) -> list[list[torch.nn.Parameter]]:
    """ZeRO's flat buffers of the tiny GPT, rebuilt: per block, then the rest (the tied
    embedding once), matrices and the others apart."""
    units = [list(b.parameters()) for b in model.blocks]
    inside = {id(p) for u in units for p in u}
    units.append([p for p in model.parameters() if id(p) not in inside])
    return [[p for p in u if (p.dim() >= 2) == matrices]
            for u in units for matrices in (True, False)
            if any((p.dim() >= 2) == matrices for p in u)]


def reference_onebit(workers: int, steps: int = STEPS, zero: int = 0,
                     **train) -> dict[str, torch.Tensor]:
    cfg = tiny_config(steps=steps, **_onebit(**train))
    t = cfg.train
    data = SyntheticTokens()
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    params = list(model.parameters())
    decay = [t.weight_decay if p.dim() >= 2 else 0.0 for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    # runs of each compressed vector: a parameter (evenly, multiples of 8) or a buffer
    index = {id(p): i for i, p in enumerate(params)}
    vectors = ([[index[id(p)] for p in g] for g in _flat_groups(model)] if zero
               else [[i] for i in range(len(params))])
    worker_err = [[None] * len(vectors) for _ in range(workers)]
    server_err = [None] * len(vectors)
    for step in range(steps):
        lr = lr_at(step, t, t.lr)
        grads, total = _worker_grads(model, data, cfg, step, workers)
        denom = [(v[i] / (1 - t.beta2 ** min(step + 1, FREEZE))).sqrt() + 1e-8
                 for i in range(len(params))]
        if step < FREEZE:  # AdamW on the global gradient
            g = [sum(gw[i] for gw in grads) / total for i in range(len(params))]
            _clip(g, math.sqrt(sum(float(x.pow(2).sum()) for x in g)), t.grad_clip)
            for i in range(len(params)):
                m[i] = t.beta1 * m[i] + (1 - t.beta1) * g[i]
                v[i] = t.beta2 * v[i] + (1 - t.beta2) * g[i] ** 2
            denom = [(v[i] / (1 - t.beta2 ** (step + 1))).sqrt() + 1e-8
                     for i in range(len(params))]
            direction = [m[i] / denom[i] for i in range(len(params))]
        else:  # each worker's estimate of the global gradient, compressed momentum
            est = [[workers * x / total for x in gw] for gw in grads]
            sq = sum(float(x.pow(2).sum()) for gw in est for x in gw) / workers
            for gw in est:
                _clip(gw, math.sqrt(sq), t.grad_clip)
            direction = [None] * len(params)
            for k, members in enumerate(vectors):
                # in units of the frozen step size sqrt(v_hat) + eps
                d = torch.cat([denom[i].reshape(-1) for i in members])
                n = d.numel()
                if zero:  # ZeRO's shards: the buffer padded to a multiple of the workers
                    stride = -(-n // workers)
                else:
                    stride = 8 * math.ceil(n / (8 * workers))
                bounds = [(min(n, j * stride), min(n, (j + 1) * stride))
                          for j in range(workers)]

                def flat(ts, members=members):
                    return torch.cat([ts[i].reshape(-1) for i in members])

                def compress(x, bounds=bounds):
                    return torch.cat([_compress(x[a:b]) for a, b in bounds])

                sent = []
                for w in range(workers):
                    if worker_err[w][k] is None:  # the freeze: the warmup's momentum
                        worker_err[w][k] = t.beta1 * flat(m) / d
                    x = (1 - t.beta1) * flat(est[w]) / d + worker_err[w][k]
                    c = compress(x)
                    worker_err[w][k] = x - c
                    sent.append(c)
                z = torch.stack(sent).mean(0)
                if server_err[k] is not None:
                    z = z + server_err[k]
                out = compress(z)  # the momentum over d, the same on every rank
                server_err[k] = z - out
                for w in range(workers):
                    worker_err[w][k] = worker_err[w][k] + t.beta1 * out
                offset = 0
                for i in members:
                    size = params[i].numel()
                    direction[i] = out[offset:offset + size].view(params[i].shape)
                    m[i] = direction[i] * denom[i]
                    offset += size
        with torch.no_grad():
            for i, p in enumerate(params):
                p.mul_(1 - lr * decay[i])
                p.sub_(lr / (1 - t.beta1 ** (step + 1)) * direction[i])
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
def _four_rank_cases(run_dir: str) -> tuple[dict, dict]:
    """Every case in one set of processes; rank 0 writes each run's final weights."""
    root = Path(run_dir)
    fit_tiny(5, f"{run_dir}/warm", optimizer="onebit_adam", freeze_step=100)
    replicas = fit_tiny(STEPS, f"{run_dir}/dp4", **_onebit())
    fit_tiny(STEPS, f"{run_dir}/dp2pp2", **_onebit(pp=2))
    fit_tiny(STEPS, f"{run_dir}/dp2tp2", **_onebit(tp=2))
    sharded = fit_tiny(STEPS, f"{run_dir}/z1dp4", **_onebit(zero=1))
    fit_tiny(STEPS, f"{run_dir}/z1dp2pp2", **_onebit(zero=1, pp=2))
    saving = {"every": 4, "keep": 2, "async": False}
    fit_tiny(STEPS, f"{run_dir}/save", checkpoint=saving, **_onebit())
    copy_checkpoint(root / "save", root / "resumed", 4)
    fit_tiny(STEPS, f"{run_dir}/resumed", checkpoint=saving, **_onebit())
    copy_checkpoint(root / "save", root / "resharded", 4)
    fit_tiny(STEPS, f"{run_dir}/resharded", checkpoint=saving, **_onebit(pp=2))
    fit_tiny(STEPS, f"{run_dir}/z1save", checkpoint=saving, **_onebit(zero=1))
    copy_checkpoint(root / "z1save", root / "z1resumed", 4)
    fit_tiny(STEPS, f"{run_dir}/z1resumed", checkpoint=saving, **_onebit(zero=1))
    copy_checkpoint(root / "z1save", root / "z1toreplicas", 4)
    fit_tiny(STEPS, f"{run_dir}/z1toreplicas", checkpoint=saving, **_onebit(pp=2))
    copy_checkpoint(root / "save", root / "toz1", 4)
    fit_tiny(STEPS, f"{run_dir}/toz1", checkpoint=saving, **_onebit(zero=1, tp=2))
    return replicas, sharded


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


@pytest.mark.parametrize("case,workers,zero", [("dp4", 4, 0), ("dp2pp2", 2, 0),
                                               ("z1dp4", 4, 1)])
def test_matches_the_simulated_workers(four_ranks, case, workers, zero):
    expected = reference_onebit(workers, zero=zero)
    cfg = tiny_config()
    torch.manual_seed(cfg.train.seed)
    initial = state_of(GPT(cfg.model))
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 5e-3  # the reference trains: agreeing with it is not agreeing on nothing
    _close(_weights(four_ranks[1] / case), expected, flipped=FLIPPED)


@pytest.mark.parametrize("case,zero", [("dp4", 0), ("z1dp4", 1)])
def test_optimizer_memory_is_what_the_planner_counts(four_ranks, case, zero):
    """What each rank reported holding for the optimizer (AdamW's state, residuals and,
    under ZeRO-1, the whole frozen step sizes) against the planner's formula: 13 and 11
    bytes per parameter at dp 4; ZeRO pads each buffer to a multiple of 4 elements."""
    summary = json.loads((four_ranks[1] / case / "summary.json").read_text())
    cfg = tiny_config()
    torch.manual_seed(0)
    n = sum(p.numel() for p in GPT(cfg.model).parameters())
    planned = model_state_bytes(n, replicas=4, zero=zero, optimizer="onebit_adam").optimizer
    for rank in summary["memory_bytes_per_rank"]:
        assert planned <= rank["optimizer"] <= planned * 1.01


def test_the_two_chunkings_differ():
    """ZeRO-1 cuts its chunks from flat buffers, the replicas per parameter: other
    scales, another trajectory (so the ZeRO-1 case checks the chunks it documents)."""
    a, b = reference_onebit(4), reference_onebit(4, zero=1)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 10 * ATOL


@pytest.mark.parametrize("which", [0, 1], ids=["replicas", "zero1"])
def test_replicas_hold_the_same_parameters(four_ranks, which):
    ranks = [r[which] for r in four_ranks[0]]
    for rank in ranks[1:]:
        _close(rank, ranks[0], atol=0.0)


@pytest.mark.parametrize("prefix,run", [("", "dp4"), ("z1", "z1dp4")])
def test_resume_after_the_freeze_is_exact(four_ranks, prefix, run):
    root = four_ranks[1]
    _close(_weights(root / f"{prefix}resumed"), _weights(root / f"{prefix}save"), atol=0.0)
    _close(_weights(root / f"{prefix}save"), _weights(root / run), atol=0.0)


@pytest.mark.parametrize("run", ["save", "z1save"])
def test_checkpoint_holds_the_residuals(four_ranks, run):
    run_dir = four_ranks[1]
    ckpt = open_checkpoint(run_dir / run / "checkpoints" / "step-00000004")
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


@pytest.mark.parametrize("case", ["resharded", "dp2tp2", "z1dp2pp2", "z1toreplicas",
                                  "toz1"])
def test_other_layouts_finish_near_the_dp4_run(four_ranks, case):
    """dp 4 -> dp 2 x pp 2 after the freeze, dp 2 x tp 2 (each tp shard compressed on
    its own: other chunks, other scales), ZeRO-1 at dp 2 x pp 2 (other buffers), and
    after the freeze ZeRO-1 dp 4 -> replicas at dp 2 x pp 2 and replicas dp 4 -> ZeRO-1
    at dp 2 x tp 2: other trajectories, but the same run, every weight within a few
    steps' moves (lr 3e-3 each) of the dp 4 run's."""
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
        server = saved[f"optim/{name}/server_error"]
        torch.testing.assert_close(data, server.reshape(-1)[start:stop])
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
    (dict(zero=2), "train.optimizer"),
    (dict(zero=3), "train.optimizer"),
    (dict(sync="local_sgd"), "train.optimizer"),
    (dict(codec="topk"), "comm.codec"),
])
def test_refused_combinations_name_the_field(keys, field):
    cfg = tiny_config(optimizer="onebit_adam", **keys)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(cfg, 2)
