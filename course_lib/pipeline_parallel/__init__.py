"""Pipeline parallelism: stages and micro-batches from scratch, the GPipe and 1F1B schedules,
torch.distributed.pipelining.

    from course_lib.pipeline_parallel import GPTStage, PipelineRunner
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "schedules": ("COMPUTE_KINDS", "gpipe_schedule", "one_f_one_b_schedule", "SCHEDULES", "schedule_actions",
                  "max_in_flight", "simulate_schedule", "predicted_bubble_fraction", "measured_bubble_fraction",
                  "with_idle", "pipeline_comm_bytes"),
    "stage": ("split_layers", "GPTStage", "full_model_name", "shifted_cross_entropy", "tied_weight_group",
              "broadcast_tied_weight", "allreduce_tied_grad", "apply_pipeline", "PipelineRunner"),
    "torch_pipelining": ("TORCH_SCHEDULES", "build_torch_pipeline", "torch_pipeline_step"),
    "workers": ("bubble_sweep", "pipeline_train", "reference_run", "check_schedule_on_ranks"),
    "comm_workers": ("exchange", "check_stage_loop", "stage_loop_reference", "peak_in_flight"),
    "p2p_record": ("record_p2p",),
})
