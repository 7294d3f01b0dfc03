"""What the run page charts, and the data behind each chart, shaped for uPlot.

Charts are defined once here (title, metric keys, unit); the page, its JSON refresh endpoint and the
comparison page all go through `chart_data`. Values come from `server.services.metrics.history`,
downsampled in SQL to at most `dashboard_chart_points` buckets per series, each bucket carrying its
last value and its min/max (drawn as a band). Metric names are DESIGN §6's, from the jax-free
`locojax.contract`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from locojax import contract as c
from server.models import AGGREGATE_HOST
from server.schemas import MetricSeries


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    keys: tuple[str, ...]
    unit: str = ""
    stacked: bool = False  # series drawn on top of each other (parts of one whole)


# The run page, in reading order: is it learning, is it stable, what does it cost.
RUN_CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Reward (mean)", (c.REWARD_MEAN,)),
    # Held-out prompts (the spec's eval block): greedy accuracy and pass@k, every eval.every steps.
    Chart("eval", "Held-out evaluation", (c.EVAL_ACCURACY, c.EVAL_PASS_AT_K)),
    Chart("loss", "Loss", (c.LOSS_TOTAL, c.LOSS_POLICY)),
    Chart("kl", "KL to the reference policy", (c.LOSS_KL,)),
    Chart("completion", "Completion length", (c.COMPLETION_LEN_MEAN,), unit="tokens"),
    Chart("throughput", "Throughput", (c.THROUGHPUT_ROLLOUT_TOKENS, c.THROUGHPUT_TRAIN_TOKENS), unit="tokens/s"),
    Chart("step_time", "Time per step", (c.TIME_STEP,), unit="s"),
    # The paper's split of each step: devices busy, host orchestration while devices wait, network.
    Chart("split", "Where each step's time went", (c.TIME_DEVICE, c.TIME_HOST, c.TIME_NETWORK), unit="s",
          stacked=True),
)
RUN_CHART_KEYS: tuple[str, ...] = tuple(dict.fromkeys(key for chart in RUN_CHARTS for key in chart.keys))
STEP_TIME_KEY = c.TIME_STEP


def _compact(value: float | None) -> float | None:
    """6 significant digits (charts and their legends show 4): halves the JSON of a chart, which a live
    page fetches every few seconds. JSON has no inf/NaN; those become gaps."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.6g}")


def align(series: list[MetricSeries]) -> tuple[list[int], list[dict[str, list[float | None]]]]:
    """One shared x axis (the union of the series' steps) and each series' columns on it, None where a
    series has no point: uPlot draws every series of a chart against one x array."""
    steps = sorted({step for one in series for step in one.steps})
    position = {step: index for index, step in enumerate(steps)}
    columns = []
    for one in series:
        last: list[float | None] = [None] * len(steps)
        low: list[float | None] = [None] * len(steps)
        high: list[float | None] = [None] * len(steps)
        for step, value, minimum, maximum in zip(one.steps, one.last, one.min, one.max):
            index = position[step]
            last[index], low[index], high[index] = _compact(value), _compact(minimum), _compact(maximum)
        columns.append({"last": last, "min": low, "max": high})
    return steps, columns


def series_summary(one: MetricSeries) -> dict[str, Any]:
    """The numbers a reader without JavaScript gets instead of the chart."""
    if not one.steps:
        return {"key": one.key, "points": 0}
    return {"key": one.key, "points": len(one.steps), "last_step": one.steps[-1], "last": one.last[-1],
            "min": min(one.min), "max": max(one.max), "bucket_steps": one.bucket_steps}


def chart_data(chart: Chart, series_by_key: dict[str, MetricSeries], labels: list[str] | None = None) -> dict[str, Any]:
    """`{"id", "title", "unit", "stacked", "x", "series": [{"label", "last", "min"?, "max"?}], "points", ...}`
    (`min`/`max` only for downsampled series)."""
    series = [series_by_key.get(key) or MetricSeries(key=key, host=AGGREGATE_HOST, steps=[], last=[], min=[], max=[],
                                                     bucket_steps=1)
              for key in chart.keys]
    steps, columns = align(series)
    return {
        "id": chart.id, "title": chart.title, "unit": chart.unit, "stacked": chart.stacked, "x": steps,
        # Raw points (one step per bucket) have min == max == last: no band, and a third of the bytes.
        "series": [{"label": (labels[index] if labels else one.key),
                    **(column if one.bucket_steps > 1 else {"last": column["last"]})}
                   for index, (one, column) in enumerate(zip(series, columns))],
        "summaries": [series_summary(one) for one in series],
        "bucket_steps": max((one.bucket_steps for one in series), default=1),
        "points": len(steps),
    }
