"""The training loop: any ``nn.Module``, any map-style dataset, an optional loss.

    trainer = disttrain.Trainer(model, dataset, loss_fn, {"train": {"steps": 100}})
    summary = trainer.fit()

A batch is what ``collate_fn`` (default: stacks mapping samples, else torch's
``default_collate``) makes of a micro-batch's samples (fetched in one ``__getitems__``
call where the dataset has one, as a Hugging Face ``datasets.Dataset`` does): a pair
``(inputs, targets)``, called as ``model(inputs)``, or a mapping whose entries other
than ``labels`` / ``targets`` are the model's keyword arguments (see :mod:`.batch`).
``loss_fn(outputs, targets)`` returns either the mean loss over the micro-batch's
samples or a pair ``(summed loss, number of loss terms)`` (e.g. target tokens); without
one, the causal-LM loss over the counted label tokens. Gradients are normalised by the
global number of loss terms in the step, so the update is the same on any number of
ranks and with any accumulation split.

:meth:`Trainer.fit` assembles the run (:func:`.assemble.assemble_run`: this rank's part
of the model composed by :func:`disttrain.parallel.compose`, its data, reporting and
checkpoints), then runs its steps (:func:`.step.run_steps`, one step read top to bottom in
:func:`.step.train_step`), or the loop of a sync mode that runs its own; it uses the
strategies only through their declared interfaces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from ..comm import Communicator
from ..comm.transport import yield_to_compute
from ..config import Config, RunPlan, load_config
from ..data.packing import PackedCollate, PackedExamples
from ..data.samples import tensor_rows
from ..errors import DivergenceError, UserError
from ..lora import add_lora, lora_settings
from ..models import token_loss
from ..monitor.callbacks import Callback
from ..parallel.compose import Parallelized
from ..parallel.interfaces import TensorSource
from ..run_checks import resolve
from ..spec import ModelSpec, spec_for
from ..weights import InitFn, initial_weights, on_meta, open_pretrained
from .assemble import RunInputs, assemble_run, build_mesh, finished_summary
from .batch import LossFn, collate_samples
from .checkpointing import RunCheckpoints
from .finish import finish_run
from .outputs import RunDirectory
from .run import Run, run_own_loop
from .rundir import stops_once
from .runtime import Runtime, init_runtime, shutdown, world_size_from_env
from .step import run_steps, worker_gradients


def _as_config(config: Config | Mapping | None) -> Config:
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    return load_config(values=dict(config))


def _packed(dataset: Dataset, eval_dataset: Dataset | None, collate_fn: Any,
            loss_fn: LossFn | None, config: Config, spec: ModelSpec
            ) -> tuple[Dataset, Dataset | None, Callable[[list], Any]]:
    """``data.packing``: the examples (and held-out examples) as packed rows
    (:mod:`disttrain.data.packing`), and the collation that hands the model the inputs
    its spec takes them through."""
    if collate_fn is not None:
        raise UserError("data.packing = true builds the batches itself (rows of packed "
                        "examples); pass no collate_fn, or set data.packing = false")
    if loss_fn is token_loss:
        raise UserError("data.packing = true gives the loss unshifted labels (-100 where "
                        "not trained); token_loss takes shifted targets: pass no loss_fn "
                        "(the causal-LM loss on labels)")
    seq_len, seed = config.model.seq_len, config.train.seed
    rows = PackedExamples(dataset, seq_len, seed)
    eval_rows = None if eval_dataset is None else PackedExamples(eval_dataset, seq_len, seed)
    return rows, eval_rows, PackedCollate(spec.packed_inputs)


class Trainer:
    """Trains ``model`` on ``dataset`` with the strategies the config selects.

    The config is validated when the Trainer is made, before any process group, against
    the model's ``spec`` (default: :func:`~disttrain.spec.spec_for` the model);
    the process group (if none exists yet) is created by :meth:`fit` from the
    environment that ``disttrain run`` / torchrun set, or as a world of one.
    ``callbacks`` (:class:`~disttrain.Callback`) are called at the points of the run,
    beside the loggers ``monitor.loggers`` names (:mod:`disttrain.monitor.callbacks`).
    A model built under ``torch.device("meta")`` is never held whole: each rank gives
    storage to its own part only and fills it from the seeded initialiser
    (:mod:`disttrain.weights`), with ``init_fn`` (one module's own tensors initialised
    in place; default: the model's own, for the built-in GPT and transformers models).
    ``pretrained``: a transformers model directory whose safetensors weights the model
    starts from (each rank reads its own part; :func:`disttrain.weights.pretrained_model`
    builds the matching model on meta). With ``data.packing`` the dataset's samples are
    examples (``input_ids`` and ``labels`` of any length up to ``model.seq_len``), packed
    into rows with attention kept inside each (:mod:`disttrain.data.packing`); the
    Trainer collates the rows itself. With ``model.lora_rank`` > 0 the Trainer first
    adds LoRA adapters to ``model`` in place (:func:`disttrain.lora.add_lora`) and
    freezes the rest.

    During and after :meth:`fit`, ``parallel``, ``optimizer``, ``world``,
    ``checkpoints``, ``runtime`` and ``start_step`` are the run's.
    """

    def __init__(self, model: nn.Module, dataset: Dataset, loss_fn: LossFn | None = None,
                 config: Config | Mapping | None = None, *, eval_dataset: Dataset | None = None,
                 collate_fn: Callable[[list], Any] | None = None,
                 run_dir: str | Path | None = None, flops_per_token: int | None = None,
                 progress: bool = True, spec: ModelSpec | None = None,
                 callbacks: Sequence[Callback] = (), init_fn: InitFn | None = None,
                 pretrained: str | Path | None = None) -> None:
        self.config = _as_config(config)
        self.spec = spec or spec_for(model)  # read before adapters wrap its layers
        adapters = lora_settings(self.config.model)
        if adapters is not None:  # model.lora_rank: the base frozen, adapters beside it
            add_lora(model, adapters, self.spec, self.config.train.seed)
        self.plan: RunPlan = resolve(self.config, world_size_from_env(), self.spec, model)
        # where the values come from (None: the model's own), read per rank once composed
        seeded = (initial_weights(model, self.config.train.seed, init_fn)
                  if on_meta(model) else None)
        self.weights: TensorSource | None = (
            open_pretrained(pretrained, model, rest=seeded) if pretrained else seeded)
        if collate_fn is None:  # the default collation takes a datasets.Dataset's rows
            dataset = tensor_rows(dataset)  # as tensors
            eval_dataset = None if eval_dataset is None else tensor_rows(eval_dataset)
        if self.config.data.packing:  # examples -> rows of model.seq_len tokens
            dataset, eval_dataset, collate_fn = _packed(
                dataset, eval_dataset, collate_fn, loss_fn, self.config, self.spec)
        self.model = model
        self.inputs = RunInputs(
            model=model, dataset=dataset, eval_dataset=eval_dataset, loss_fn=loss_fn,
            collate_fn=collate_fn or collate_samples, config=self.config, plan=self.plan,
            spec=self.spec, weights=self.weights, flops_per_token=flops_per_token,
            progress=progress, callbacks=list(callbacks))
        self.directory = RunDirectory(Path(run_dir) if run_dir is not None else None)
        self._runtime: Runtime | None = None
        self._run: Run | None = None

    # ----------------------------------------------------------------- the run's parts
    @property
    def run(self) -> Run:
        """The assembled run (during and after :meth:`fit`)."""
        if self._run is None:
            raise RuntimeError("the run is assembled by fit(): call it first")
        return self._run

    @property
    def runtime(self) -> Runtime:
        """The process group, device and rank of this process (during and after :meth:`fit`)."""
        if self._runtime is None:
            raise RuntimeError("the process group is set up by fit(): call it first")
        return self._runtime

    @property
    def rank(self) -> int:
        """This process's global rank (valid during and after :meth:`fit`)."""
        return self.runtime.rank

    @property
    def is_main(self) -> bool:
        """Whether this process is global rank 0 (the one that writes shared files)."""
        return self.runtime.is_main

    @property
    def run_dir(self) -> Path | None:
        """Where the run writes (None until chosen, when none was given)."""
        return self.directory.path

    @property
    def start_step(self) -> int:
        """0, or the step a resumed run continues from."""
        return self.run.start_step

    @property
    def parallel(self) -> Parallelized:
        """This rank's part of the model and its strategies
        (:class:`disttrain.parallel.Parallelized`)."""
        return self.run.parallel

    @property
    def optimizer(self) -> Any:
        """The optimizer stepping this rank's parameters (or its shard of them)."""
        return self.run.model.optimizer

    @property
    def world(self) -> Communicator:
        """The communicator over every rank of the run."""
        return self.run.world

    @property
    def checkpoints(self) -> RunCheckpoints:
        """The run's checkpoints: saving, loading and the latest one."""
        return self.run.checkpoints

    # ----------------------------------------------------------------- fit
    def fit(self) -> dict[str, Any]:
        """Train for ``train.steps`` steps; return the run summary (also written to
        ``summary.json`` in the run directory)."""
        # under torchrun's restarts: a stop on purpose (a divergence, a replica group
        # left behind, ...) is recorded, and the next attempt stops at once
        with stops_once(self.directory.path):
            p = self.config.parallel
            runtime = init_runtime(self.config.train.device, p.backend, p.timeout_s)
            self._runtime = runtime
            mesh = None
            try:
                with ExitStack() as closing:
                    mesh = build_mesh(self.inputs, runtime)
                    finished = finished_summary(self.inputs, mesh, self.directory.path)
                    if finished is not None:
                        return finished
                    self._run = run = assemble_run(self.inputs, runtime, mesh,
                                                   self.directory, self, closing)
                    return self._fit(run)
            finally:
                shutdown(runtime, mesh.ledger if mesh is not None else None)

    def _fit(self, run: Run) -> dict[str, Any]:
        if self.runtime.device.type == "cpu":  # the ranks compute on the host's cores
            yield_to_compute()  # every group of the run exists by now
        run.reporter.train_start()
        own = run.parallel.own_loop
        try:
            result = (run_steps(run) if own is None else
                      run_own_loop(run, own, lambda lists: worker_gradients(run, lists)))
        except DivergenceError:
            run.checkpoints.close()  # a save of an earlier, finite step completes
            raise
        run.reporter.bar.close()
        run.cadence.close()
        summary = finish_run(run, result)
        run.reporter.train_end(summary)
        return summary
