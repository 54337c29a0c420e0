"""Lab 2: data-parallel training with N CPU processes acting as N GPUs.

    torchrun --nproc_per_node=2 scripts/ddp_simulation_train.py
    torchrun --nproc_per_node=4 scripts/ddp_simulation_train.py --max_steps 60
    python scripts/ddp_simulation_train.py            # the same script as one process (world size 1)

Each rank trains a replica of the tiny model on its own rows of every global batch; DistributedDataParallel
averages the gradients. Compare the per-rank logs afterwards:

    tail logs/rank_0/train.log logs/rank_1/train.log

The local losses differ (different rows) but stay close (same weights, same data distribution); the global
loss is their mean. Any `python -m course_lib.train` flag works here too (--help).
"""

import sys

from course_lib.train import main

DEFAULTS = ["--strategy", "ddp", "--model_size", "tiny", "--max_steps", "40", "--batch_size", "8",
            "--log_interval", "5", "--eval_interval", "20", "--out_dir", "runs/ddp_simulation", "--no-progress"]

if __name__ == "__main__":
    main(DEFAULTS + sys.argv[1:])  # later flags win, so the command line overrides these defaults
