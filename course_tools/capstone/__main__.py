"""python -m course_tools.capstone SCRIPT [options] -- SCRIPT ARGUMENTS: the capstone's checks (harness.py).

    python -m course_tools.capstone scripts/ddp_simulation_train.py --resume-flag=--resume -- \\
        --max_steps {steps} --batch_size {rows_per_rank} --out_dir {out_dir} --log_dir {log_dir} --dataset synthetic

Exit code 0 when every check holds, 1 when one fails, 2 for bad arguments.
"""

import argparse
import shlex
import sys

from course_tools.capstone.harness import PLACEHOLDERS, Harness


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    script_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, script_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m course_tools.capstone", description=__doc__.splitlines()[0],
                                     epilog="Placeholders in the script arguments: "
                                            + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
    parser.add_argument("script", help="your training script (what you would start with torchrun)")
    parser.add_argument("--resume-flag", default="--resume",
                        help="arguments that make the script resume from its checkpoint (default --resume)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run (default 8)")
    parser.add_argument("--stop-at", type=int, default=3, help="SIGTERM after this step in the stop run (default 3)")
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks (default 8)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the distributed runs (default 2)")
    parser.add_argument("--work", help="folder for the runs' outputs and logs (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    parser.add_argument("--only", choices=("stop",), help="stop: only the SIGTERM run and its check")
    args = parser.parse_args(argv)
    if not script_args:
        parser.error("give the script's arguments after `--`, with placeholders such as --max_steps {steps} "
                     "--out_dir {out_dir}")
    try:
        harness = Harness(args.script, script_args, resume_args=shlex.split(args.resume_flag), steps=args.steps,
                          stop_at=args.stop_at, global_batch=args.global_batch, ranks=args.ranks, work=args.work,
                          timeout_s=args.timeout)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    result = harness.run(only=args.only)
    print(result.summary())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
