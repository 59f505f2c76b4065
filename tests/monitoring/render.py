"""Draws the dashboard's panels from a real Prometheus (query_range of each panel's
queries) with matplotlib: the documentation image when no Grafana can run."""

from __future__ import annotations

import math
from pathlib import Path

from .prom import Prometheus, dashboard

_UNITS = {"s": "seconds", "reqps": "requests/s", "short": "", "percentunit": "fraction"}


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prom: Prometheus, start: float, end: float, out: Path, rate_interval: str = "15s") -> int:
    """Writes one PNG with every panel; returns the number of panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 2.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel["title"], fontsize=10, loc="left")
        for target in panel["targets"]:
            expr = target["expr"].replace("$namespace", ".*").replace("$__rate_interval", rate_interval)
            series = prom.query_range(expr, start, end)
            if panel["type"] == "table":
                rows_text = [
                    legend(target["legendFormat"], s["metric"]) + f"   value {s['values'][-1][1]}" for s in series
                ]
                ax.text(0.02, 0.5, "\n".join(rows_text), fontsize=10, family="monospace", va="center")
                ax.set_axis_off()
                continue
            for s in series:
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                ax.plot(xs, ys, linewidth=1, label=legend(target["legendFormat"], s["metric"]))
        if panel["type"] != "table":
            ax.set_ylabel(_UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), ""), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper left", ncol=2)
            ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_axis_off()
    fig.suptitle(
        "openengine-serve dashboard: rendered with matplotlib from the queries of "
        "deploy/monitoring/openengine-dashboard.json\nagainst a real Prometheus scraping "
        "`openengine-serve up` under load (not a Grafana screenshot; x axis: seconds)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return len(panels)
