"""``rope-ext export`` and ``rope-ext doctor``."""

from __future__ import annotations

import argparse

from rope_ext.serving.doctor import MISMATCH, diagnose, render
from rope_ext.serving.export import export


def cmd_export(args: argparse.Namespace) -> int:
    record = export(args.model, args.out, args.target, methods=args.methods, max_length=args.max_length,
                    layout=args.layout, allow_approximate=args.allow_approximate, overwrite=args.overwrite)
    print_export(record, args.out)
    return 0


def print_export(record: dict, out: str) -> None:
    """What an export wrote: its plan, what the other engines make of it, the serving commands."""
    plan = record["plan"]
    print(f"{record['target']}: {plan['status']}: {plan['reason']}")
    for line in record["other_engines"]:
        print(f"warning: {line}")
    print(f"written to {out}/ (export.json says what and how); serve it with:")
    for line in record["commands"]:
        print(f"  {line}")


def cmd_doctor(args: argparse.Namespace) -> int:
    findings = diagnose(args.source)
    print(render(findings))
    return 1 if any(finding.level == MISMATCH for finding in findings) else 0
