"""``python -m training --config FILE`` (under torchrun, or alone for one process)."""

import argparse
import sys

from training.recipes import TrainingError, run


def main() -> int:
    ap = argparse.ArgumentParser(description="Train a LoRA/QLoRA adapter under FSDP2.")
    ap.add_argument("--config", required=True, help="TrainJob JSON file")
    args = ap.parse_args()
    try:
        run(args.config)
    except TrainingError as e:
        print(f"training failed: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
