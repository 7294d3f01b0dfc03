"""TensorBoard event files beside `metrics.jsonl`: every metric of every step, one directory per host
(`tensorboard/host<i>`) and one for the aggregate (`tensorboard/all`), so TensorBoard overlays the hosts
of each metric as runs. `tensorboard --logdir <run dir>/tensorboard` opens them.

The sink is on the step's path (`MetricsLogger` calls it once per host and step), so `write` only hands
the record to a thread of its own: building a record's protocol buffers costs ~0.1 ms of Python, which
the run loop must not pay. The thread writes with TensorBoard's own event-file writer, which flushes
every `flush_s` seconds and at `close`; a run killed in between loses at most that much of its event
files (metrics.jsonl, flushed per step, keeps everything).

TensorBoard's modules are imported by the thread that makes the sink, never by the sink's own thread
while steps run: on a TPU VM that import (with boto3, which TensorBoard's file layer loads where it is
installed) was still running on the sink's thread in the steady steps, in GIL bursts that kept the run
loop from its tokens for up to ~5 ms at a time, the chip idle behind it (bench/results/
size_a_host_path_tpu.json). `preload` starts that import in the background earlier, while the run
compiles, so the sink itself then finds it done.
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


def _writer_modules() -> tuple[Any, Any, Any]:
    """TensorBoard's event, summary and event-file writer classes (ImportError without the package),
    with the file layer they write through loaded too."""
    from tensorboard.compat import tf
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    # `tf` is a lazy module: its first use (the writer's first file) imports TensorFlow where installed,
    # else TensorBoard's stub of it, whose file layer imports boto3 where that is installed. Use it here.
    tf.io.gfile.exists(".")
    return Event, Summary, EventFileWriter


def preload() -> threading.Thread:
    """Import TensorBoard's writer modules in a background thread (started here) and return it: for a
    caller about to compile for a while, so that a `TensorBoardSink` made after finds them imported.
    Without the package, the sink says so when it is made."""
    def load() -> None:
        try:
            _writer_modules()
        except ImportError:
            pass

    thread = threading.Thread(target=load, name="tensorboard-preload", daemon=True)
    thread.start()
    return thread


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
        try:
            self._modules: tuple[Any, Any, Any] | None = _writer_modules()
        except ImportError as exc:  # a machine without the package: the run goes on, its records are dropped
            warnings.warn(f"no TensorBoard event files under {self.root}: {exc}", stacklevel=2)
            self._modules = None
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
        if self._modules is None:
            while self._queue.get() is not _STOP:
                pass
            return
        Event, Summary, EventFileWriter = self._modules
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
