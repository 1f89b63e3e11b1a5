"""Recovery: nothing lost, nothing counted twice, and nothing re-run on a guess.

A signal receiver can fail (Redis unreachable), a worker can die mid-task or between two steps,
a producer can die between its EVAL and its publishes, and a broker can lose messages. None of
that may leave a flow waiting forever; and a job that is only waiting (a backlog, a long task,
a prefetched message) must never be taken for a lost one. So every repair acts on evidence:

- A **lease** says a holder is alive. A worker renews, every few seconds, the leases of the flow
  jobs it runs (their deadlines in the active set) and of those it has received but not started
  (prefetched, or waiting for an eta: the reserved set). A lease lapses a stall timeout after
  its holder's last renewal, and ends at once when the worker sees the pool process that held
  it die (drop.lua).
- A job's **message is gone** when the job is pending past the stall timeout, no live worker
  holds it, and either the queue has since delivered a job of the same priority that became
  pending more than a stall timeout after it (brokers deliver a queue in order: it was
  overtaken), or the broker reports the queue empty. Both must still hold, for the same job,
  at a second look at least :data:`HOLD_MS` later: a worker leases what it has just fetched
  within that time.

:func:`~.sweep.run_pass` looks at every queue in ``emq:queues`` and repairs what the evidence
shows:

(a) a pending child whose message is gone: re-published from its stored payload; unless
    Celery's result backend holds its final state (a worker without the extension ran it as
    a plain task, and would run it again): then settled from that result, as in (b);
(b) a job whose holder's lease lapsed: Celery's result backend says how its body ended:
    SUCCESS -> complete it with that value, FAILURE -> fail it (the child's policy applies),
    anything else -> re-publish it. A job handed over to a replacement (``Task.replace``) is
    completed or failed from the replacement's result as soon as the backend has it;
(c) a released parent never dispatched a stall timeout after its release, or dispatched and
    its message gone: dispatched (again);
(d) a parent failed by its child whose FAILURE never reached the result backend (its worker
    died between fail.lua and ``settle.parent_failed``), or a failed nested flow whose failure
    never reached its outer flow: record it, carry it;
(e) a child of another slot staged in its queue's outbox but never credited on its parent's
    slot (its worker died between the two steps): credit it (credit.lua is idempotent);
(f) a flow of the chunked path still open past the stall timeout (its producer died between
    open_flow and seal_flow): seal it if every child was written, else fail it.
(g) children of another slot added to a held flow (grow_flow) but still staged on the parent's
    slot past the stall timeout (the adder died between the two slots): write them on their
    slots (add_children, grow_done); (a) then publishes them.

No storm: a job is re-published at most once per stall timeout, doubling for each earlier
re-publish (requeue.lua), a pass re-publishes at most :data:`BUDGET` jobs per queue, and each
re-publish is logged and counted in the queue's ``republished`` counter (``echomq stats``).

Every repair is an atomic transition script that re-checks what the pass saw (state, token,
deadline, score), so two passes at once (two workers, or a worker and ``celery echomq
recover``) cost duplicate work at most, never a double credit.

:class:`~.worker.RecoveryLoop` runs in every worker: it renews that worker's leases, ends those
of its dead pool processes, and runs the pass, one worker of each queue at a time under that
queue's Redis lease.

The modules: ``common`` (settings of a pass, reading stored jobs), ``lost`` (a pending job
whose message is gone, a released parent never published: (a), (c)), ``stalled`` (a lapsed
lease, an unrecorded failure: (b), (d)), ``unfinished`` (the cross-slot path: a child never
credited, a flow never sealed, children added but never written: (e)-(g)),
``sweep`` (one pass over every queue) and ``worker`` (the worker's leases and loop).
"""

from __future__ import annotations

from celery_echomq.worker.recovery.common import BATCH, BUDGET, HOLD_MS, LEASE
from celery_echomq.worker.recovery.sweep import anything_due, recover_now, run_pass
from celery_echomq.worker.recovery.worker import RecoveryLoop, RecoveryStep, leased_pass

__all__ = [
    "BATCH",
    "BUDGET",
    "HOLD_MS",
    "LEASE",
    "RecoveryLoop",
    "RecoveryStep",
    "anything_due",
    "leased_pass",
    "recover_now",
    "run_pass",
]
