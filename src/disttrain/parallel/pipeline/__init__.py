"""Pipeline parallelism: cut a model (by its spec) into chunks, schedule them, run the schedule.

    plan = plan_stages(spec, pp=2, v=1)                     # or cuts=[2] explicitly
    chunks = build_chunks(model, spec, plan, pp_comm.rank)  # original submodules
    schedule = build_schedule("1f1b", pp=2, m=8)            # pure data, per-rank actions
    result = run_pipeline(chunks, micro_batches, token_loss, pp_comm, schedule,
                          activation_shape=(b, T, d), loss_scale=1 / global_count)
    sync_tied_grads(chunks, pp_comm)                        # tok_emb / head copies
    optimizer.step()

``validate_schedule``, ``simulate`` and ``check_nccl_order`` need no process group (config
validation, planning); ``chunk_param_names`` maps a chunk's parameter names to the full model's.
"""

from .build import build_chunks, chunk_param_names
from .chunks import PipelineChunk
from .cuts import StageCosts, StagePlan, balanced_cuts, plan_stages, spec_costs
from .p2p import Message, check_nccl_order, check_posts, message_groups
from .runner import ActionTiming, PipelineStepResult, run_pipeline
from .schedules import (
                        BACKWARD,
                        FORWARD,
                        SCHEDULES,
                        Action,
                        Schedule,
                        analytic_bubble,
                        build_schedule,
                        validate_schedule,
)
from .simulate import ScheduleDeadlock, bubble_fractions, check_schedule, simulate
from .tied import exchange_tied_grads, sync_tied_grads

__all__ = ["BACKWARD", "FORWARD", "SCHEDULES", "Action", "ActionTiming", "PipelineChunk",
           "PipelineStepResult", "Schedule", "ScheduleDeadlock",
           "StageCosts", "StagePlan", "analytic_bubble", "balanced_cuts", "build_chunks",
           "build_schedule", "bubble_fractions", "check_schedule", "chunk_param_names",
           "check_nccl_order", "check_posts", "exchange_tied_grads", "Message",
           "message_groups", "plan_stages", "spec_costs", "run_pipeline", "simulate",
           "sync_tied_grads", "validate_schedule"]
