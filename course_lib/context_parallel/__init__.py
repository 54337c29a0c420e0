"""Context parallelism: one sequence split over the ranks, attention computed by ring attention.

    from course_lib.context_parallel import ring_attention, split_sequence, unsplit_sequence
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ring": ("LAYOUTS", "block_attention", "merge", "positions", "zigzag_split", "contiguous_split",
                       "split_sequence", "unsplit_sequence", "RingStats", "start_ring_pass", "finish_ring_pass",
                       "ring_attention"),
    "workers": ("attention_inputs", "full_attention_reference", "ring_attention_run"),
    "exercise_workers": ("check_ring_attention", "merge_with_lse"),
})
