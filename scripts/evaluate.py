"""Held-out loss and perplexity of any course checkpoint (single-process, DDP, ranked or sharded).

    python scripts/evaluate.py runs/tiny
    python scripts/evaluate.py runs/ranked/step_40 --json
"""

from course_lib.evaluation import main

if __name__ == "__main__":
    main()
