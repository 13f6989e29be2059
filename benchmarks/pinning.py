"""Pin a vLLM server to one core and its client to another on a small CPU host.

In the GPU recipes the rollout engine and what feeds it (the trainer, the tool sandboxes, the rollout loop)
run on different devices; on a 2-core host they fight over the same cores unless pinned apart. vLLM's CPU
backend binds its OpenMP threads itself and starts threads as the engine comes up, so the server's pin is
re-applied at every poll rather than once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def vllm_threads(root: int) -> list[int]:
    """Thread ids of every vLLM process descending from ``root`` (API server, engine core, worker)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo += [int(c) for c in children]
        if "vllm" in cmdline.lower():  # the engine core and its worker retitle themselves "VLLM::..."
            found += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return found


class ServerPinner(threading.Thread):
    """Keeps every thread of the vLLM server(s) descending from ``root`` on ``core``."""

    def __init__(self, root: int, core: int):
        super().__init__(daemon=True)
        self.root, self.core, self.stop = root, core, threading.Event()
        self.pinned: set[int] = set()

    def run(self) -> None:
        while True:
            self.pin_now()
            if self.stop.wait(0.5):
                return

    def pin_now(self) -> None:
        for tid in vllm_threads(self.root):
            try:
                if os.sched_getaffinity(tid) != {self.core}:
                    os.sched_setaffinity(tid, {self.core})
                self.pinned.add(tid)
            except OSError:  # the thread ended
                pass


def pin_this_process(core: int) -> None:
    """Every thread of this process on ``core``; threads and processes it starts later inherit the pin."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})
