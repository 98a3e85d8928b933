"""Memory mode's shadow workers in a child process (`modelcanary serve`, events.backend: memory), so
that embedding inference and judging never run on the proxy's event loop.

- `parent.py`: `run_in_child`, the ShadowRunner `serve` runs on the proxy's loop. It starts the
  child, sends it sampled traffic over a socket, at most `events.queue_size` events waiting (more
  are dropped and counted, `modelcanary_shadow_dropped_total{reason="queue_full"}`: the proxy never
  waits for a slow or dead child), publishes the EvaluationRecords the child sends back on the
  proxy's bus (the controller runs there), and starts a new child when one dies or a reload changes
  the config (the old child first evaluates what it was sent, for a bounded time); what a child
  was sent and never finished is counted, `reason="stopped"`;
- `child.py`: the child, the same shadow workers as `modelcanary collect` (collectors.worker) over a
  bus made of that socket;
- `channel.py`: the socket's frames, read and written on each side's event loop (no thread in the
  proxy competes with its loop for the GIL);
- `relay.py`: the child's shadow metrics, shipped to the parent with each batch of records (and
  every second) and exposed on the parent's /metrics summed with the parent's own (and with earlier children's, so counters never
  go back when a child is replaced).
"""

from collectors.embedded.parent import run_in_child

__all__ = ["run_in_child"]
