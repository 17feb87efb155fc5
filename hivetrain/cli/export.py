"""``hivetrain export CKPT --out DIR``: write a checkpoint as a transformers model directory
(``hivetrain.coordinator.export``). Exit codes: 0 exported, 1 the export failed (the message says why), 2 bad
arguments."""

from __future__ import annotations

import logging
import sys

from hivetrain.cli.args import export_parser
from hivetrain.coordinator.checkpoint import CheckpointInvalid
from hivetrain.coordinator.export import export_transformers
from hivetrain.coordinator.export import logger as export_logger


def main(args_list: list[str]) -> int:
    """``hivetrain export CKPT --out DIR``: returns the exit code (0 ok, 1 export failed, 2 bad arguments)."""
    parser = export_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        print("hivetrain export: --max-seq-len must be a positive number of tokens", file=sys.stderr)
        return 2
    if args.preset and args.model:
        print("hivetrain export: give --preset or --model, not both", file=sys.stderr)
        return 2
    # the export's own lines (which epoch went out, and a warning if the run was set for more) reach the user, not
    # only a log: "exported to DIR" alone did not say which epoch it was (issue 26)
    said = logging.StreamHandler(sys.stdout)
    said.setFormatter(logging.Formatter("%(message)s"))
    export_logger.addHandler(said)
    export_logger.setLevel(logging.INFO)
    export_logger.propagate = False
    try:
        export_transformers(
            args.checkpoint,
            args.preset or args.model,
            args.out,
            max_seq_len=args.max_seq_len,
            overwrite=args.force,
            tokenizer=args.tokenizer,
        )
    except (OSError, ValueError, CheckpointInvalid) as exc:
        print(f"hivetrain export: {exc}", file=sys.stderr)
        return 1
    finally:
        export_logger.removeHandler(said)
        export_logger.propagate = True
    return 0  # the export said "exported epoch N (hash) to OUT"
