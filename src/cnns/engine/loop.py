"""The training loop: updates, the metrics outfeed, step lines, checkpoints, interrupts, divergence.

Per-update metrics stay on the device in the outfeed and are read back at the host's synchronisations, which
`RunLength` places (at most `--device-iterations` updates apart, and at every step line, checkpoint and epoch's
end), so the loop never blocks on the step's results in between. Divergence is found in those read-back
metrics: a non-finite loss costs no read-back of its own.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Iterator

import torch

from cnns import profiling
from cnns.engine.cadence import RunLength
from cnns.engine.compilation import compilation_failures_named
from cnns.engine.feed import DeviceFeed
from cnns.engine.step import NonFiniteError, StepMetrics, TrainStep
from cnns.errors import CnnsError
from cnns.parallel.world import World
from cnns.runfolder.log import RunLog
from cnns.lr_schedules import ScheduleSpec, lr_at


class Outfeed:
    """Per-update metrics kept as device tensors until the next host synchronisation.

    With replicas the drained numbers are summed over them (one small all-reduce per
    synchronisation), so every process logs the global batch's loss, accuracy and image count. With
    pipeline stages only the last stage's count (the stage that computes loss and accuracy).
    """

    def __init__(self, world: World | None = None):
        self.pending: list[tuple[int, float, StepMetrics]] = []
        self.world = world or World()

    def push(self, iteration: int, lr: float, metrics: StepMetrics) -> None:
        self.pending.append((iteration, lr, metrics))

    def drain(self) -> list[dict]:
        """One transfer for all pending updates: [{iteration, lr, loss, correct, samples, backed_off}]."""
        if not self.pending:
            return []
        values = torch.stack([torch.stack([m.loss_sum.float(), m.correct.float(),
                                           torch.tensor(float(m.samples), device=m.loss_sum.device)])
                              for _, _, m in self.pending])
        if not self.world.is_last_stage:
            values.zero_()  # a pipeline's metrics are its last stage's
        host = self.world.sum_(values).cpu().tolist()
        replicas = self.world.replicas
        rows = [
            {"iteration": it, "lr": lr, "loss": loss / max(1, len_micro(m) * replicas), "correct": correct,
             "samples": int(samples), "backed_off": m.backed_off}
            for (it, lr, m), (loss, correct, samples) in zip(self.pending, host)
        ]
        self.pending.clear()
        return rows


def len_micro(metrics: StepMetrics) -> int:
    return getattr(metrics, "micro_batches", 1)


def micro_batch_stream(source, start_micro_batch: int) -> Iterator:
    """Micro-batches across epochs, starting at a position counted in micro-batches from the start."""
    per_epoch = len(source)
    epoch, offset = divmod(start_micro_batch, per_epoch)
    for e in count(epoch):
        yield from source.epoch(e, offset)
        offset = 0


class StopRequest:
    """Set by SIGTERM/SIGINT; the loop finishes the current update, checkpoints and stops.

    A second signal stops at once (KeyboardInterrupt): checkpoints are written atomically, so even
    then no truncated checkpoint is left behind.
    """

    def __init__(self):
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    @contextmanager
    def installed(self):
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


class Diverged(CnnsError):
    """Training met a non-finite loss or non-finite weights; `update` is the first update found so.
    The session completes the line with the last finite checkpoint and what to try."""

    def __init__(self, update: int, what: str):
        super().__init__(f"training diverged at update {update}: {what}")
        self.update, self.what = update, what


def first_divergence(rows: list[dict]) -> Diverged | None:
    """The first read-back update whose loss is NaN or Inf. An update that dynamic loss scaling skipped
    and backed off from is an overflow the lower scale retries (float16's usual start), not divergence."""
    for row in rows:
        if not math.isfinite(row["loss"]) and not row["backed_off"]:
            return Diverged(row["iteration"] + 1, f"its loss is {row['loss']}")
    return None


@dataclass
class LoopResult:
    final_iteration: int
    interrupted_by: str | None
    checkpoints: list[int] = field(default_factory=list)
    seconds: float = 0.0
    last_loss: float | None = None
    last_train_acc: float | None = None


class TrainingLoop:
    """Runs updates from `start_iteration` to the end of the run.

    Step lines, checkpoints and host synchronisations fall where `RunLength` says (positions counted from
    iteration 0 whatever the start, so a restored run keeps the uninterrupted run's cadence); an interrupt adds
    one of each. Each synchronisation checks the read-back losses, and a non-finite one stops the run
    (`Diverged`) before anything of it is logged or saved.
    """

    def __init__(self, step: TrainStep, feed: DeviceFeed, source, schedule: ScheduleSpec, length: RunLength,
                 grad_accum: int, global_batch_size: int, num_train_samples: int, log: RunLog,
                 save_checkpoint: Callable[[int], None], start_iteration: int = 0,
                 after_update: Callable[[], None] | None = None, world: World | None = None):
        self.step = step
        self.feed = feed
        self.source = source
        self.schedule = schedule
        self.length = length
        self.grad_accum = grad_accum
        self.global_batch_size = global_batch_size
        self.num_train_samples = num_train_samples
        self.log = log
        self.save_checkpoint = save_checkpoint
        self.start_iteration = start_iteration
        self.after_update = after_update  # e.g. the moving average of the weights
        self.world = world or World()

    def epoch_of(self, iteration: int) -> float:
        return self.global_batch_size * iteration / self.num_train_samples

    def run(self, stop: StopRequest) -> LoopResult:
        with self.log.progress(self.length.total_iterations, self.start_iteration, "training", "update") as bar:
            return self._run(stop, bar)

    def _run(self, stop: StopRequest, bar) -> LoopResult:
        length = self.length
        # The data position: every update so far consumed `grad_accum` micro-batches.
        stream = self.feed(micro_batch_stream(self.source, self.start_iteration * self.grad_accum))
        outfeed = Outfeed(self.world)
        result = LoopResult(final_iteration=self.start_iteration, interrupted_by=None)
        # With replicas a signal may reach the processes in different updates: they agree after
        # every update (a one-number all-reduce on the host), so all stop after the same one.
        stopping = (lambda: self.world.any(bool(stop))) if self.world.distributed else (lambda: bool(stop))
        start_all = interval_start = time.perf_counter()
        window: list[dict] = []
        last_log = self.start_iteration
        warmup: tuple[float, int] | None = None  # (seconds, images) of the first update
        for iteration in range(self.start_iteration, length.total_iterations):
            with profiling.marked(profiling.UPDATE):
                with profiling.marked(profiling.DATA):
                    micro = [next(stream) for _ in range(self.grad_accum)]
                lr = lr_at(self.schedule, iteration)
                try:
                    with compilation_failures_named():
                        metrics = self.step(micro, lr)
                except NonFiniteError as exc:
                    raise NonFiniteError(f"floating-point exception at iteration {iteration + 1}: {exc} "
                                         "(--fp-exceptions)") from None
                metrics.micro_batches = len(micro)
                if self.after_update is not None:
                    self.after_update()
            outfeed.push(iteration, lr, metrics)
            if warmup is None:
                warmup = self._first_update_done(metrics, interval_start)
                interval_start = time.perf_counter()  # throughput leaves the first update out
            if bar is not None:
                bar.update(1)
            done = iteration + 1
            stop_now = stopping()
            if not (length.sync_due(done) or stop_now):
                continue
            rows = outfeed.drain()  # the host synchronisation
            diverged = first_divergence(rows)
            if diverged is not None:
                raise diverged
            window.extend(rows)
            # Where the cadence puts a line (before the first, `Compilation time:` is the run's sign of life).
            if length.line_due(done) or stop_now:
                elapsed = time.perf_counter() - interval_start
                images, timed = sum(r["samples"] for r in window), len(window)
                if last_log == self.start_iteration:
                    images, timed = images - warmup[1], timed - 1
                    if timed == 0:  # the interval was the first update alone: count it after all
                        elapsed, images, timed = elapsed + warmup[0], images + warmup[1], 1
                row = self._log_step(window, done, elapsed, images, timed, time.perf_counter() - start_all)
                if bar is not None:
                    bar.set_postfix_str(f"epoch {row['epoch']:.2f}, loss {row['loss_avg']:.3f}, "
                                        f"{row['img_per_sec']:.0f} img/s")
                result.last_loss = window[-1]["loss"]
                result.last_train_acc = 100.0 * window[-1]["correct"] / window[-1]["samples"]
                window = []
                last_log = done
                interval_start = time.perf_counter()
            if length.checkpoint_due(done) or stop_now:
                self.save_checkpoint(done)
                result.checkpoints.append(done)
            result.final_iteration = done
            if stop_now:
                result.interrupted_by = stop.signal_name or "a signal to another process"
                break
        result.seconds = time.perf_counter() - start_all
        return result

    def _first_update_done(self, metrics: StepMetrics, started: float) -> tuple[float, int]:
        """Graphcore's application's `Compilation time:` line: the first update, which pays for any compilation,
        kernel selection and first-touch allocation. Waits for the device this once."""
        if metrics.loss_sum.is_cuda:
            torch.cuda.synchronize(metrics.loss_sum.device)
        seconds = time.perf_counter() - started
        self.log.print(f"Compilation time: {seconds:.3f}s.")
        return seconds, metrics.samples * self.world.replicas

    def _log_step(self, rows: list[dict], done: int, elapsed: float, images: int, timed_updates: int,
                  total_time: float) -> dict:
        """One step line and training.csv row; throughput and time per update over the timed updates."""
        updates = len(rows)
        loss_avg = sum(r["loss"] for r in rows) / updates
        acc_avg = 100.0 * sum(r["correct"] for r in rows) / max(1, sum(r["samples"] for r in rows))
        last = rows[-1]
        row = {
            "step": done * self.grad_accum, "iteration": done, "epoch": self.epoch_of(done), "lr": last["lr"],
            "loss_batch": last["loss"], "loss_avg": loss_avg,
            "train_acc_batch": 100.0 * last["correct"] / last["samples"], "train_acc_avg": acc_avg,
            "it_time": elapsed / timed_updates, "img_per_sec": images / elapsed if elapsed > 0 else 0.0,
            "total_time": total_time,
        }
        self.log.training_step(row)
        return row
