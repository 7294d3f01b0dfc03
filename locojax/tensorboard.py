"""TensorBoard event files beside `metrics.jsonl`: every metric of every step, one directory per host
(`tensorboard/host<i>`) and one for the aggregate (`tensorboard/all`), so TensorBoard overlays the hosts
of each metric as runs. `tensorboard --logdir <run dir>/tensorboard` opens them.

The sink is on the step's path (`MetricsLogger` calls it once per host and step), so `write` only hands
the record to a thread of its own: building a record's protocol buffers costs ~0.1 ms of Python, which
the run loop must not pay. The thread writes with TensorBoard's own event-file writer, which flushes
every `flush_s` seconds and at `close`; a run killed in between loses at most that much of its event
files (metrics.jsonl, flushed per step, keeps everything).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from locojax.contract import ALL_HOSTS, Host

_STOP = object()


def host_directory(host: Host) -> str:
    """The event-file directory of one host's records: `host<i>`, or `all` for the aggregate."""
    return ALL_HOSTS if host == ALL_HOSTS else f"host{int(host)}"


class TensorBoardSink:
    """A `MetricSink` writing TensorBoard scalars: one event per (host, step) holding every metric."""

    def __init__(self, root: str | Path, *, flush_s: float = 2.0):
        self.root = Path(root)
        self.flush_s = flush_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tensorboard-sink", daemon=True)
        self._thread.start()

    def write(self, step: int, host: Host, metrics: Mapping[str, float]) -> None:
        self._queue.put((int(step), host, dict(metrics), time.time()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:  # a machine without the package: the run goes on, its records are dropped
            warnings.warn(f"no TensorBoard event files under {self.root}: {exc}", stacklevel=1)
            while self._queue.get() is not _STOP:
                pass
            return

        writers: dict[str, EventFileWriter] = {}
        failed = False
        while (item := self._queue.get()) is not _STOP:
            step, host, metrics, wall_time = item
            try:
                name = host_directory(host)
                if name not in writers:
                    writers[name] = EventFileWriter(str(self.root / name), max_queue_size=1000,
                                                    flush_secs=self.flush_s)
                summary = Summary(value=[Summary.Value(tag=key, simple_value=float(value))
                                         for key, value in metrics.items() if value is not None])
                writers[name].add_event(Event(wall_time=wall_time, step=step, summary=summary))
            except Exception as exc:  # noqa: BLE001 - event files are a view; the run goes on without them
                if not failed:
                    warnings.warn(f"TensorBoard event files under {self.root} stopped: {exc!r}", stacklevel=1)
                failed = True
        for writer in writers.values():
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"closing a TensorBoard event file under {self.root} failed: {exc!r}", stacklevel=1)
