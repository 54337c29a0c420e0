"""Lab 2 with Hugging Face Accelerate: the course's training loop, one process or several.

    python scripts/accelerate_train.py --max_steps 20
    accelerate launch --multi_gpu --num_processes 2 scripts/accelerate_train.py --max_steps 20

(`--cpu --num_processes 2` would silently start a single process.) Every TrainConfig flag works: --help.
"""

from course_lib.integrations.accelerate_train import main

if __name__ == "__main__":
    main()
