"""Scenario 4, backlog scaling: one relay drains a large backlog (1,000,000 rows by
default); the rate of the last 10% is compared with the rate of the first 10%.

Delivered rows pile up behind the relay as it goes, so a claim whose cost grew
with delivered history would show here as a slower tail.  The same again with
delete-on-deliver, where the table shrinks instead (and purged rows leave
InnoDB delete-marks for the purge thread).
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.report import ScenarioResult
from bench.scenarios import Results
from bench.scenarios.common import batch_size, template
from bench.scenarios.relay_runs import drain_backlog, require_relay


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("backlog-scaling", "first 10% vs last 10% of a large backlog")
    n = cfg.backlog_rows
    res.settings = {"rows": n, "batch_size": batch_size(cfg), "relays": 1}
    source = template(ctx, n)
    for delete in (False, True):
        label = "scale-delete" if delete else "scale"
        out = drain_backlog(
            ctx, source=source, rows=n, relays=1, label=label, delete_on_deliver=delete
        )
        p = out.progress
        first = 0.1 * n / (p.time_at(0.1 * n) - p.first_nonzero())
        last = p.rate_between(0.9 * n, n)
        res.rows.append(
            {
                "finalize": "delete" if delete else "mark delivered",
                "rows": n,
                "seconds": out.seconds,
                "events/s": out.rate,
                "first 10%/s": first,
                "last 10%/s": last,
                "last vs first": last / first,
                **out.cpu_row(),
            }
        )
        suffix = "_delete" if delete else ""
        res.figures[f"rate{suffix}"] = out.rate
        res.figures[f"last_vs_first{suffix}"] = last / first
        res.notes.extend(out.notes)
        if out.profile:
            mode = "delete" if delete else "mark delivered"
            res.tables[f"profile of the relay ({mode}), share of its loop's wall time"] = (
                out.profile
            )
    return res
