"""``rope-ext export`` and ``rope-ext doctor``."""

from __future__ import annotations

import argparse

from rope_ext.serving.doctor import MISMATCH, diagnose, render
from rope_ext.serving.export import export


def cmd_export(args: argparse.Namespace) -> int:
    record = export(args.model, args.out, args.target, methods=args.methods, max_length=args.max_length,
                    layout=args.layout, allow_approximate=args.allow_approximate, overwrite=args.overwrite)
    plan = record["plan"]
    print(f"{args.target}: {plan['status']}: {plan['reason']}")
    for line in record["other_engines"]:
        print(f"warning: {line}")
    print(f"written to {args.out}/ (export.json says what and how); serve it with:")
    for line in record["commands"]:
        print(f"  {line}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    findings = diagnose(args.source)
    print(render(findings))
    return 1 if any(finding.level == MISMATCH for finding in findings) else 0
