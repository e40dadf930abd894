"""The decode worker's periodic status line, in the words SGLang operators already grep for."""

from __future__ import annotations

import time

from services.worker.runtime import WorkerRuntime


class DecodeLogLine:
    """Builds `Decode batch, #running-req: ..., gen throughput (token/s): ..., #queue-req: ...`.

    Throughput is tokens generated since the previous line over the time since it. Returns None
    while the worker is idle, so an idle worker's log stays quiet.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        stats = runtime.engine.stats()
        self._last_tokens = stats.generated_tokens
        self._last_spec = (stats.spec_accepted_tokens, stats.spec_verify_rows)
        self._last_time = time.monotonic()

    def next(self) -> str | None:
        stats = self.runtime.engine.stats()
        queues = self.runtime.queue_counts(stats)
        now = time.monotonic()
        generated = stats.generated_tokens - self._last_tokens
        throughput = generated / max(now - self._last_time, 1e-9)
        self._last_tokens, self._last_time = stats.generated_tokens, now
        busy = stats.running or stats.waiting or queues["prealloc"] or queues["transfer"] or generated
        if not busy:
            return None
        total = max(stats.total_pages, 1)
        accepted = stats.spec_accepted_tokens - self._last_spec[0]
        verifies = stats.spec_verify_rows - self._last_spec[1]
        self._last_spec = (stats.spec_accepted_tokens, stats.spec_verify_rows)
        # SGLang's "accept len": tokens one verify yields on average (the target's own one included)
        accept = f"accept len: {1 + accepted / verifies:.2f}, " if verifies else ""
        return (f"Decode batch, #running-req: {stats.running}, #token: {stats.running_tokens}, "
                f"token usage: {(stats.used_pages - stats.reserved_pages) / total:.2f}, "
                f"pre-allocated usage: {stats.reserved_pages / total:.2f}, "
                f"#prealloc-req: {queues['prealloc']}, "
                f"#transfer-req: {queues['transfer']}, #retracted-req: {stats.retracted}, "
                f"{accept}cuda graph: {bool(stats.cuda_graph)}, "
                f"gen throughput (token/s): {throughput:.2f}, #queue-req: {stats.waiting}")
