"""``python -m campaign_orchestrator.demo --artifacts DIR [--force] [--xtok]``: build the demo models (cached);
``--xtok`` also the teacher with a byte-level BPE tokenizer (``@demo/teacher_bpe``, campaigns/demo_xtok.yaml)."""

import argparse
import json

from campaign_orchestrator.demo.build import build_demo_models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    ap.add_argument("--xtok", action="store_true", help="also the teacher with a byte-level BPE tokenizer")
    args = ap.parse_args()
    print(json.dumps(build_demo_models(args.artifacts, force=args.force, xtok=args.xtok), indent=2))


if __name__ == "__main__":
    main()
