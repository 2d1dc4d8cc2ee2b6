"""Reporting: the match report, graph dumps, logging, counters and tlparse artifacts.

* ``logging.getLogger("sage_compile")`` (``TORCH_LOGS=+sage_compile`` works): one INFO line per graph,
  DEBUG per site.
* ``torch._dynamo.utils.counters["sage_compile"]``: ``sites``, ``replaced``, ``sdpa_replaced``,
  ``handwritten_replaced``, ``kept``, ``scheme:<name>``, ``kept:<reason>``.
* ``SAGE_COMPILE_DUMP=<dir>``: per compiled graph ``graph_<n>_before.py``, ``graph_<n>_after.py``,
  ``graph_<n>_report.json`` and a human-readable ``graph_<n>_report.txt``.
* ``trace_structured`` artifacts ``sage_compile_before``/``_after``/``_report`` (``TORCH_TRACE`` + tlparse).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re


log = logging.getLogger("sage_compile")
_graph_ids = itertools.count()
_last_reports: list = []


def _short(reason: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "_", reason.split(":")[0].lower()).strip("_")[:60]


def build_report(sites, decisions) -> list[dict]:
    rows = []
    for s, d in zip(sites, decisions):
        row = s.describe()
        row.update({"decision": d.scheme or "kept", "reason": d.reason, "notes": list(d.notes),
                    "prologue": d.prologue})
        rows.append(row)
    return rows


def format_report(rows: list[dict]) -> str:
    n_rep = sum(r["decision"] != "kept" for r in rows)
    lines = [f"sage_compile: replaced {n_rep}/{len(rows)} attention sites"]
    for r in rows:
        shp = "x".join(r["q"] or []) + (f" kv {'x'.join(r['k'] or [])}" if r["k"] != r["q"] else "")
        lines.append(f"  [{r['index']}] {r['kind']:<11} {r['decision']:<9} {shp} {r['dtype']} {r['layout']} "
                     f"mask={r['mask']} causal={r['causal']}" + (f" gqa={r['gqa']}" if r["gqa"] else "")
                     + f" | {r['reason']}" + "".join(f"; {n}" for n in r["notes"]) + f" @ {r['location']}")
    return "\n".join(lines)


def summary_line(rows: list[dict]) -> str:
    kept = [r["reason"] for r in rows if r["decision"] == "kept"]
    s = f"replaced {len(rows) - len(kept)}/{len(rows)} attention sites"
    if kept:
        s += f"; {len(kept)} kept ({'; '.join(sorted(set(kept)))})"
    return s


def record(gm_before_code: str, gm_after_code: str, sites, decisions, dump_dir=None) -> list[dict]:
    """Log, count, dump and trace one compiled graph's rewrite; returns the report rows."""
    from torch._dynamo.utils import counters

    rows = build_report(sites, decisions)
    c = counters["sage_compile"]
    c["graphs"] += 1
    for r in rows:
        c["sites"] += 1
        if r["decision"] == "kept":
            c["kept"] += 1
            c[f"kept:{_short(r['reason'])}"] += 1
        else:
            c["replaced"] += 1
            c[f"{r['kind']}_replaced"] += 1
            c[f"scheme:{r['decision']}"] += 1
    gid = next(_graph_ids)
    log.info("graph %d: %s", gid, summary_line(rows))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", format_report(rows))
    _last_reports.append(rows)
    del _last_reports[:-64]
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        stem = os.path.join(dump_dir, f"graph_{os.getpid()}_{gid}")
        with open(stem + "_before.py", "w") as f:
            f.write(gm_before_code)
        with open(stem + "_after.py", "w") as f:
            f.write(gm_after_code)
        with open(stem + "_report.json", "w") as f:
            json.dump(rows, f, indent=1, default=str)
        with open(stem + "_report.txt", "w") as f:
            f.write(format_report(rows) + "\n")
    try:
        from torch._logging import trace_structured

        for name, payload in (("sage_compile_before", gm_before_code), ("sage_compile_after", gm_after_code),
                              ("sage_compile_report", json.dumps(rows, default=str))):
            trace_structured("artifact", metadata_fn=lambda n=name: {"name": n, "encoding": "string"},
                             payload_fn=lambda p=payload: p)
    except Exception:  # tracing is optional
        pass
    return rows


def last_reports() -> list[list[dict]]:
    """Report rows of the most recent compiled graphs of this process (newest last)."""
    return list(_last_reports)


def clear_reports() -> None:
    _last_reports.clear()
