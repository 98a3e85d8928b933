"""Memory mode's shadow workers in a child process (`modelcanary serve`, events.backend: memory), so
that embedding inference and judging never run on the proxy's event loop.

- `parent.py`: `run_in_child`, the ShadowRunner `serve` runs on the proxy's loop. It starts the
  child, hands it sampled traffic through a bounded queue (when the queue is full the record is
  dropped and counted, `modelcanary_shadow_dropped_total{reason="queue_full"}`: the proxy never
  waits for a slow or dead child), publishes the EvaluationRecords the child sends back on the
  proxy's bus (the controller runs there), and starts a new child when one dies;
- `child.py`: the child, the same shadow workers as `modelcanary collect` (collectors.worker) over a
  bus made of the two queues;
- `relay.py`: the child's shadow metrics, shipped to the parent every second and exposed on the
  parent's /metrics summed with the parent's own (and with earlier children's, so counters never
  go back when a child is replaced).
"""

from collectors.embedded.parent import run_in_child

__all__ = ["run_in_child"]
