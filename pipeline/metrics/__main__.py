"""Command line for the metrics.

    python -m pipeline.metrics --pred PRED.json --ref REF.json \
        --protocol densevid|soda|etbench|padcaptioner [--ref-format longvale|chronusav|activitynet|youcook2|shards]
        [--skip-missing | --missing-as-zero] [--json] [--per-video] [--report DIR]

--json prints ONE JSON object (every metric on the 0-1 scale at full precision,
per-threshold values, the protocol and its variant, counts, problems); without it a
short table is printed. Progress and java chatter go to stderr. Exit status 2 on
unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.metrics import PROTOCOLS, SODA_DIRECTIONS, evaluate, public_result, write_report
from pipeline.metrics.io import REF_FORMATS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.metrics", description="Dense video captioning metrics (docs/design/method.md section 3).")
    ap.add_argument("--pred", required=True, help="predictions: ActivityNet results JSON or engine output (.json / .jsonl)")
    ap.add_argument("--ref", required=True, help="references: LongVALE/ActivityNet JSON, ChronusAV JSON, YouCook2 JSON, or a shard dir/.tar")
    ap.add_argument("--protocol", choices=PROTOCOLS, default="padcaptioner")
    ap.add_argument("--ref-format", choices=REF_FORMATS, default=None, help="default: detected from the file")
    miss = ap.add_mutually_exclusive_group()
    miss.add_argument("--skip-missing", dest="missing", action="store_const", const="skip", help="densevid: leave videos without predictions out (LongVALE; default)")
    miss.add_argument("--missing-as-zero", dest="missing", action="store_const", const="zero", help="densevid: count videos without predictions as 0 (ActivityNet / PDVC)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the nonsense references")
    ap.add_argument("--soda-cider", action="store_true", help="also report SODA_c with CIDEr-D")
    ap.add_argument("--soda-direction", choices=SODA_DIRECTIONS, default="published",
                    help="SODA_c pair direction: published (fujiso/SODA, reference scored as the hypothesis; default) "
                         "or documented (METEOR's own: prediction as the hypothesis)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--per-video", action="store_true", help="include per-video values in the JSON")
    ap.add_argument("--report", default=None, metavar="DIR", help="write index.html + PNGs here")
    ap.add_argument("--report-videos", type=int, default=50, help="timelines drawn in the report")
    ap.add_argument("--progress", action="store_true", help="show progress bars on stderr")
    args = ap.parse_args(argv)

    try:
        result = evaluate(
            args.pred, args.ref, args.protocol, ref_format=args.ref_format, missing=args.missing,
            seed=args.seed, soda_cider=args.soda_cider, soda_direction=args.soda_direction, progress=args.progress,
        )
    except ValueError as exc:  # InputError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.report:
        index = write_report(result, args.pred, args.ref, args.report, max_videos=args.report_videos, ref_format=args.ref_format)
        print(f"report: {index}", file=sys.stderr)
    if args.json:
        print(json.dumps(public_result(result, args.per_video), ensure_ascii=False))
        return 0
    c = result["counts"]
    print(f"protocol: {result['protocol']}   videos: {c['videos']}   with predictions: {c['videos_with_predictions']}   problems: {c['problems']}")
    for name, value in result["metrics"].items():
        print(f"  {name:<14} {value:.4f}   ({100 * value:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
