"""``python -m bench [--smoke] [--scenario NAME ...] [size flags] [--write-docs]``.

Service addresses come from ``--db-url``/``--kafka-bootstrap``/``--redis-url`` or
the ``OUTBOXKIT_TEST_*`` variables that ``deploy/local/up.sh`` prints
(``bench/run.sh`` does both steps).  The DB URL names a server; each run creates
and drops its own database on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from bench import profile
from bench.config import BenchConfig
from bench.context import REPO_ROOT, Services
from bench.report import fmt, write_docs
from bench.runner import RESULTS_DIR, run
from bench.scenarios import names

DOCS = REPO_ROOT / "docs" / "performance.md"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmarks of outboxkit next to the machine's own limits "
        "(docs/performance.md).",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: proves the harness works")
    p.add_argument(
        "--scenario",
        action="append",
        choices=names(),
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(names())}",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--database",
        choices=("mariadb", "postgresql"),
        default="mariadb",
        help="which local database to run on when --db-url is not given: "
        "$OUTBOXKIT_TEST_DB_URL (mariadb, the default) or $OUTBOXKIT_TEST_PG_URL (postgresql)",
    )
    p.add_argument(
        "--db-url",
        help="DB server (each run creates its own database); default: see --database",
    )
    p.add_argument(
        "--kafka-bootstrap",
        default=os.environ.get("OUTBOXKIT_TEST_KAFKA_BOOTSTRAP"),
        help="default $OUTBOXKIT_TEST_KAFKA_BOOTSTRAP",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("OUTBOXKIT_TEST_REDIS_URL"),
        help="for several relays and wake-ups; default $OUTBOXKIT_TEST_REDIS_URL",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="default bench/results")
    p.add_argument(
        "--write-docs", action="store_true", help=f"put this run's tables into {DOCS.name}"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="sample relay 0 of each drain with py-spy; hottest functions go in the tables",
    )
    p.add_argument("--keep", action="store_true", help="keep the run's database and topics")
    sizes = p.add_argument_group("sizes (defaults: the full run; --smoke: tiny)")
    full, smoke = BenchConfig().as_dict(), BenchConfig.smoke().as_dict()
    for f in dataclasses.fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        shown = {
            k: ",".join(map(str, v)) if isinstance(v, tuple | list) else v
            for k, v in (("full", full[f.name]), ("smoke", smoke[f.name]))
        }
        help_text = f"default {shown['full']} (smoke {shown['smoke']})"
        if f.type in ("tuple[int, ...]",):
            sizes.add_argument(flag, type=_ints, metavar="N,N,...", help=help_text)
        elif f.type in ("float",):
            sizes.add_argument(flag, type=float, metavar="S", help=help_text)
        elif f.type in ("int | None",):
            sizes.add_argument(flag, type=int, metavar="N", help="default: the relay's own")
        else:
            sizes.add_argument(flag, type=int, metavar="N", help=help_text)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # tables appear as scenarios finish
    if args.list:
        from bench.scenarios import all_scenarios

        for s in all_scenarios():
            print(f"{s.name:20} {s.title}")
        return 0
    if not args.db_url:
        args.db_url = os.environ.get(
            "OUTBOXKIT_TEST_PG_URL" if args.database == "postgresql" else "OUTBOXKIT_TEST_DB_URL"
        )
    if args.profile and not profile.available():
        # Without it the run would go on and its tables would lack the profiles asked for.
        print(
            "--profile needs py-spy (pip install py-spy): not on PATH nor beside " + sys.executable
        )
        return 2
    if not args.db_url or not args.kafka_bootstrap:
        print('no services: run ./bench/run.sh, or eval "$(deploy/local/up.sh)" first')
        return 2
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(BenchConfig)
        if getattr(args, f.name) is not None
    }
    config = BenchConfig.smoke(**overrides) if args.smoke else BenchConfig(**overrides)
    services = Services(
        db_url=args.db_url, kafka_bootstrap=args.kafka_bootstrap, redis_url=args.redis_url
    )
    report = run(
        config,
        services,
        scenarios=args.scenario,
        results_dir=args.results_dir,
        smoke=args.smoke,
        keep=args.keep,
        profile=args.profile,
    )
    print("\n== goals")
    for g in report["goals"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        bound = g.get("bound in this run")
        allows = "" if bound is None else f"  (this run allows {fmt(bound)})"
        print(
            f"   {g['goal']:50} {g['target']:>8}  measured {fmt(g['measured']):>10}  {met}{allows}"
        )
    print(f"\nresults: {report['path']}")
    if args.write_docs:
        write_docs(DOCS, report)
        print(f"docs: {DOCS}")
    failed = [s for s in report["scenarios"].values() if s.get("error")]
    for s in failed:
        print(f"FAILED {s['name']}: {s['error']}")
    return 1 if failed else 0
