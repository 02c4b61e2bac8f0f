"""--log-straggler: Megatron-LM's straggler report, which ranks compute slowest.

Transcribed from Megatron-LM core_v0.19.0's ``StragglerDetector`` (megatron/core/utils.py; configured by
megatron/training/training.py train(), reported from post_training_step_callbacks every --log-interval
iterations; its flags: megatron/training/config/resilience_config.py StragglerDetectionConfig). Each rank
times its model's forward passes in training (upstream: the forward step; here every call of the
engine's module, by a hook, so DeepSpeed's pipeline engine and the interleaved executor are timed too).
A forward pass holds no data parallel collective, so a slow GPU (or host) shows up as its own longer
time instead of making everyone wait at the gradient all-reduce, where a whole-step time would hide it.
Every --log-interval iterations the ranks' mean forward times are gathered and rank 0 logs (INFO, through
``logging``, so --logging-level 30 silences it):

    INFO:megatron_ds.training.straggler:[2026-11-28 16:20:01] | MnRtt/Rnk: 3453.08ms/8 | MxRtt/Rnk: 3468.20ms/0 | MnEtpt/Rnk: 296.02TF/0 | MxEtpt/Rnk: 297.32TF/8

Rtt: the shortest and longest mean forward time per iteration and their ranks; Etpt: each rank's
estimated model TFLOP/s, the iteration's FLOPs / (its forward time x 3, for the backward pass that is
not timed) / the number of ranks, as upstream. With --straggler-minmax-count N (1 < N < world size) two
more lines list the N ranks with the lowest and the highest Etpt (``^^^^ Bottom N Ranks ...``).
Upstream's GPU temperature, power, utilisation and clock columns need NVML, and its get_batch time a timer
inside its own forward step; they are left out (CPU runs, gloo, have none of them either).

Rank 0 listens on --straggler-ctrlr-port (upstream's controller, the same HTTP answer): each connection
(``curl HOST:PORT``) switches the report off or on at the next report, for every rank.
--disable-straggler-on-startup starts it off.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# upstream's ``amp``: only the forward pass is timed, a third of the iteration's FLOPs
FORWARD_SHARE = 3.0


class ForwardTimer:
    """Time spent in a module's forward passes while it is in training mode, on this rank."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = True
        self._wall: list[float] = []  # seconds of each finished forward
        self._events: list = []  # CUDA (start, stop) event pairs, read at ``take``
        self._started = None
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args) -> None:
        if not (self.enabled and module.training):
            return
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if start is not None:
            start.record()
        self._started = (time.perf_counter(), start)

    def _post(self, module, args, output) -> None:
        if self._started is None:
            return
        began, start = self._started
        self._started = None
        if start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._events.append((start, stop))
        self._wall.append(time.perf_counter() - began)

    def take(self) -> float:
        """Seconds of forward since the last ``take``. On CUDA each pass counts the longer of its host time
        and its device time (upstream: ``max(event time, perf_counter time)``)."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
            total = sum(max(wall, a.elapsed_time(b) / 1000.0) for wall, (a, b) in zip(self._wall, self._events))
        else:
            total = sum(self._wall)
        self._wall, self._events = [], []
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True)
class RankTime:
    rank: int
    ms: float  # mean forward time per iteration
    tflops: float  # estimated TFLOP/s

    def value(self, what: str) -> str:
        """upstream's _ValueWithRank: ``VALUE UNIT/RANK``."""
        return f"{self.ms:.2f}ms/{self.rank}" if what == "ms" else f"{self.tflops:.2f}TF/{self.rank}"


def report_lines(times: list[RankTime], minmax_count: int, now: datetime) -> list[str]:
    """Rank 0's lines for the gathered ``times`` (StragglerDetector.report's format)."""
    by_time = sorted(times, key=lambda t: t.ms)
    by_flops = sorted(times, key=lambda t: t.tflops)
    lines = [f"[{now.strftime('%Y-%m-%d %H:%M:%S')}] | MnRtt/Rnk: {by_time[0].value('ms')} | "
             f"MxRtt/Rnk: {by_time[-1].value('ms')} | MnEtpt/Rnk: {by_flops[0].value('tf')} | "
             f"MxEtpt/Rnk: {by_flops[-1].value('tf')}"]
    world = len(times)
    if 1 < minmax_count < world:
        lines.append(f"^^^^ Bottom {minmax_count} Ranks with lowest  Etpt(TF):"
                     + "".join(f" {t.tflops:.2f}/{t.rank}," for t in by_flops[:minmax_count]))
        lines.append(f"^^^^ Top    {minmax_count} Ranks with highest Etpt(TF):"
                     + "".join(f" {t.tflops:.2f}/{t.rank}," for t in by_flops[world - minmax_count:]))
    return lines


class StragglerDetector:
    """Built on every rank (the report is collective); rank 0 logs and runs the controller."""

    def __init__(self, module: torch.nn.Module, device: torch.device, *, minmax_count: int, enabled: bool,
                 port: int):
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.minmax_count = minmax_count
        self.timer = ForwardTimer(module, device)
        self.timer.enabled = enabled
        self.toggle = False  # set by the controller thread, applied at the next report
        self.port = port
        self._sock = None
        if self.rank == 0:
            self._listen(port)

    @property
    def enabled(self) -> bool:
        return self.timer.enabled

    def report(self, total_flops: float, log_interval: int) -> bool:
        """Collective, every --log-interval iterations: gather, and on rank 0 log, each rank's mean forward
        time over the interval and its estimated TFLOP/s; then apply a pending switch. Whether it logged."""
        logged = False
        if self.enabled and total_flops > 0.0 and log_interval > 0:
            ms = self.timer.take() * 1000.0 / log_interval
            per_iteration = total_flops / log_interval
            # upstream: flops / (ms x 10^9 x world) is TFLOP/s; / 3 for the backward that is not timed
            tflops = per_iteration / (max(ms, 1e-9) * 1e9 * self.world) / FORWARD_SHARE
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(RankTime(self.rank, ms, tflops), gathered, dst=0)
            if self.rank == 0:
                for line in report_lines(gathered, self.minmax_count, datetime.now()):
                    logger.info(line)
                logged = True
        self._apply_toggle()
        return logged

    def _apply_toggle(self) -> None:
        """Rank 0's state (switched if the controller was called) to every rank (upstream _check_toggle)."""
        off = not self.enabled
        if self.rank == 0 and self.toggle:
            off, self.toggle = not off, False
        flag = torch.tensor([off], dtype=torch.uint8, device=self.device)
        dist.broadcast(flag, 0)
        now_on = not bool(flag.item())
        if now_on != self.enabled:
            self.timer.enabled = now_on
            self.timer.take()  # an interval measured while off is not reported
            if self.rank == 0:
                logger.info(f"Toggling StragglerDetector State {'ON' if now_on else 'OFF'}")

    def _listen(self, port: int) -> None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", port))
            sock.listen(128)
        except OSError as err:
            logger.warning(f"StragglerDetector cannot be controlled (--straggler-ctrlr-port {port}): {err}")
            return
        self._sock, self.port = sock, sock.getsockname()[1]
        logger.info(f"Controller ready to recv commands on port {self.port}. Current state "
                    f"{'ON' if self.enabled else 'OFF'}")
        threading.Thread(target=self._serve, name="straggler", daemon=True).start()

    def _serve(self) -> None:
        """Upstream's _handler: each connection asks for a switch, answered in HTTP."""
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed by ``close``
                return
            with conn:
                conn.recv(1024)
                self.toggle = True
                msg = f"Will turn StragglerDetector {'OFF' if self.enabled else 'ON'} at next logging interval"
                conn.sendall(f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}\r\n\r\n{msg}"
                             .encode())
            logger.info(msg)

    def close(self) -> None:
        """Stop timing and listening (the end of training)."""
        self.timer.remove()
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
