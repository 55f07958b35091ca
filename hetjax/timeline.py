"""Step timelines: what each part of the machine did during one training step.

With ``train.trace_every=N`` every N-th step is recorded as spans on fixed lanes:

    compute          device compute, one span per stage function (embed, block i fwd/bwd, head)
    host_to_device   param slabs and boundary activations copied to the device
    device_to_host   gradient slabs (and boundary activations) copied to the host
    nvme_read        TensorStore page reads (optimizer state, params, boundary activations)
    nvme_write       TensorStore page writes (the same)
    optimizer        the host optimizer's update of a stage (update-loop thread)

and written to ``<workdir>/trace/step_<n>.json`` (Chrome trace event format: open it in
https://ui.perfetto.dev or chrome://tracing) and ``step_<n>.png`` (a Gantt chart), with
the overlap figure ``step_over_busiest`` = step time / busiest lane's busy time (1.0:
the step is as short as its busiest resource allows; higher: time lost to waiting), and
the bytes each copy lane moved (``moved_bytes``: the sizes of the arrays copied).

How spans are taken. JAX dispatch is asynchronous, so the time a call returns says
nothing about when the device ran it. A traced operation is handed to :func:`watch`
with its outputs and inputs; a per-lane watcher thread waits for them
(``block_until_ready``, which does not hold the GIL) and ends the span when the outputs
are ready. The span starts at the latest of its dispatch, the end of the lane's previous
span (a lane is one serial engine: a compute stream, a copy engine) and the moment its
inputs were seen ready (a gradient's copy to the host starts after the backward that
produced it). Ready times are observed by waiting threads, so spans are accurate to
their wake-up latency (tens of microseconds), not to the device clock. Nothing on the
training thread blocks, so tracing does not serialise dispatch; its cost is the watcher
threads' wake-ups and holding each watched buffer until it is observed ready (the bench
``overhead`` measures it).
TensorStore reads and writes run concurrently inside TensorStore: their spans go from
issue to the future's completion callback and overlapping ones are merged into one
busy span, so every lane's spans are disjoint.

When no recording is active every hook is one global lookup: the hot path pays nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

LANES = ("compute", "host_to_device", "device_to_host", "nvme_read", "nvme_write", "optimizer")
LANE_TITLES = {
    "compute": "device compute",
    "host_to_device": "host -> device",
    "device_to_host": "device -> host",
    "nvme_read": "NVMe read",
    "nvme_write": "NVMe write",
    "optimizer": "host optimizer",
}
COPY_LANES = ("host_to_device", "device_to_host")  # watch()'s arrays are what was copied

_active: Recorder | None = None


def active() -> Recorder | None:
    return _active


def span(lane: str, name: str):
    """Context manager timing a synchronous piece of work on ``lane`` (no-op when off)."""
    rec = _active
    return contextlib.nullcontext() if rec is None else rec.span(lane, name)


def watch(lane: str, name: str, arrays: Any, after: Any = None) -> None:
    """An asynchronously dispatched device operation just issued; its span ends when
    ``arrays`` (any pytree of JAX arrays) are ready, and starts no earlier than its
    inputs ``after`` are (e.g. a copy cannot start before the compute producing it
    ends). No-op when off."""
    rec = _active
    if rec is not None:
        rec.watch(lane, name, arrays, after)


def watch_future(lane: str, name: str, future: Any) -> None:
    """A TensorStore future just issued; its span ends at its completion callback."""
    rec = _active
    if rec is not None:
        rec.watch_future(lane, name, future)


@contextlib.contextmanager
def recording(recorder: Recorder | None):
    """Makes ``recorder`` the active one for the block (None: nothing is recorded)."""
    global _active
    if recorder is None:
        yield None
        return
    _active = recorder
    try:
        yield recorder
    finally:
        _active = None


class Recorder:
    """Collects spans from any thread; :meth:`finish` turns them into a :class:`Timeline`."""

    def __init__(self, step: int = 0):
        self.step = step
        self.t0 = time.perf_counter()
        self._spans: dict[str, list[tuple[float, float, str]]] = {lane: [] for lane in LANES}
        self._moved: dict[str, int] = dict.fromkeys(COPY_LANES, 0)
        self._lock = threading.Lock()
        self._closed = False  # no more spans are added
        self._stopping = False  # no more device work is watched
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        with self._lock:
            if not self._closed:
                self._spans[lane].append((start - self.t0, end - self.t0, name))

    @contextlib.contextmanager
    def span(self, lane: str, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter())

    def watch(self, lane: str, name: str, arrays: Any, after: Any = None) -> None:
        with self._lock:  # finish() may be stopping the watchers from another thread
            if self._stopping:  # e.g. the lock-free optimizer loop, at work after the step
                return
            if lane in self._moved:
                self._moved[lane] += _nbytes(arrays)
            q = self._queues.get(lane)
            if q is None:
                q = self._queues[lane] = queue.Queue()
                t = threading.Thread(
                    target=self._watcher, args=(lane, q), name=f"hetjax-trace-{lane}", daemon=True
                )
                t.start()
                self._threads.append(t)
            q.put((name, time.perf_counter(), arrays, after))

    def _watcher(self, lane: str, q: queue.Queue) -> None:
        import jax

        last_end = self.t0
        while (item := q.get()) is not None:
            name, dispatched, arrays, after = item
            try:
                jax.block_until_ready(after)
                inputs_ready = time.perf_counter()
                jax.block_until_ready(arrays)
            except Exception:  # noqa: BLE001 — a failed op is the training thread's to report
                continue
            end = time.perf_counter()
            del arrays, after, item
            self.add(lane, name, min(max(dispatched, last_end, inputs_ready), end), end)
            last_end = end

    def watch_future(self, lane: str, name: str, future: Any) -> None:
        start = time.perf_counter()
        future.add_done_callback(lambda _f: self.add(lane, name, start, time.perf_counter()))

    def finish(self) -> Timeline:
        """Waits for the watched device work, stops recording (later completions are
        ignored) and returns the step's timeline, ending now."""
        with self._lock:
            self._stopping = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        with self._lock:  # every span recorded ends before ``end``
            self._closed = True
            end = time.perf_counter() - self.t0
            spans = {lane: merge_spans(s) for lane, s in self._spans.items()}
            moved = dict(self._moved)
        return Timeline(self.step, end, spans, moved)


def _nbytes(arrays: Any) -> int:
    """Bytes of a pytree of arrays (a sharded array counts its whole, global size)."""
    import jax  # loaded by whoever dispatched the arrays: no start-up cost here

    return sum(int(a.nbytes) for a in jax.tree.leaves(arrays))


def merge_spans(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Sorted, disjoint spans: overlapping (concurrent) ones become one span whose name
    joins theirs (``a + b``, or ``n ops`` beyond three)."""
    out: list[list] = []
    for start, end, name in sorted(spans):
        if out and start < out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
            out[-1][2].append(name)
        else:
            out.append([start, end, [name]])
    return [
        (s, e, " + ".join(names) if len(names) <= 3 else f"{len(names)} ops: {names[0]} ..")
        for s, e, names in out
    ]


@dataclasses.dataclass
class Timeline:
    step: int
    duration_s: float  # the step's wall time, from the recorder's start to finish()
    spans: dict[str, list[tuple[float, float, str]]]  # lane -> disjoint (start, end, name), s
    # COPY_LANES -> bytes copied during the step (NVMe bytes are the step's metrics)
    moved_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def busy_s(self) -> dict[str, float]:
        return {lane: sum(e - s for s, e, _ in spans) for lane, spans in self.spans.items()}

    def overlap(self) -> dict[str, Any]:
        """The busiest lane and ``step_over_busiest`` = step time / its busy time."""
        busy = self.busy_s()
        lane = max(busy, key=busy.get)
        return {
            "busy_s": busy,
            "busiest_lane": lane,
            "step_over_busiest": self.duration_s / busy[lane] if busy[lane] else float("inf"),
        }

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace event format (loads in Perfetto): one thread per lane, complete
        ("X") events in microseconds."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "hetjax step"}}
        ]
        for tid, lane in enumerate(LANES):
            events.append(
                {"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": lane}}
            )
            events.append(
                {
                    "ph": "M",
                    "pid": 0,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": tid},
                }
            )
            for s, e, name in self.spans[lane]:
                events.append(
                    {
                        "ph": "X",
                        "pid": 0,
                        "tid": tid,
                        "name": name,
                        "cat": lane,
                        "ts": s * 1e6,
                        "dur": (e - s) * 1e6,
                    }
                )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "step": self.step,
                "step_s": self.duration_s,
                "moved_bytes": self.moved_bytes,
                **self.overlap(),
            },
        }

    def write(self, directory: str | Path) -> tuple[Path, Path]:
        """Writes ``step_<n>.json`` and ``step_<n>.png`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        json_path = directory / f"step_{self.step}.json"
        json_path.write_text(json.dumps(self.chrome_trace()))
        png_path = directory / f"step_{self.step}.png"
        self.plot(png_path)
        return json_path, png_path

    def plot(self, path: str | Path) -> None:
        """A Gantt chart of the lanes (matplotlib's object API: no pyplot state, so it
        is safe off the main thread)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(12, 0.5 * len(LANES) + 1.4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]
        for row, lane in enumerate(reversed(LANES)):
            bars = [(s * 1e3, (e - s) * 1e3) for s, e, _ in self.spans[lane]]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[LANES.index(lane)])
        titles = [
            LANE_TITLES[lane]
            + (f" ({self.moved_bytes[lane] / 2**20:.1f} MiB)" if lane in self.moved_bytes else "")
            for lane in reversed(LANES)
        ]
        ax.set_yticks(range(len(LANES)), titles)
        ax.set_xlim(0, self.duration_s * 1e3)
        ax.set_xlabel("ms since the step began")
        o = self.overlap()
        ax.set_title(
            f"step {self.step}: {self.duration_s * 1e3:.1f} ms; busiest lane "
            f"{LANE_TITLES[o['busiest_lane']]} {o['busy_s'][o['busiest_lane']] * 1e3:.1f} ms; "
            f"step / busiest = {o['step_over_busiest']:.2f}"
        )
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
