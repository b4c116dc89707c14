"""Where the guard's steps begin and end, for the two workers sglang-jax's scheduler drives.

The guard (:class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary`) composes one of these, as sglang-jax's own
``ModelWorkerClient`` (``tp_worker_overlap_thread.py``) wraps a ``ModelWorker``:

* :class:`InlineSteps`, a plain ``ModelWorker``: the batch's requests are read on the thread that runs the forward,
  and the step ends when the scheduler calls ``guard.after_step()`` after processing the results.
* :class:`OverlapSteps`, the overlap scheduler's ``ModelWorkerClient``: the scheduler's thread hands a batch to the
  client, whose thread runs the forward a step later. The requests are read on the scheduler's thread as the batch is
  handed over (the token history as it is then) and passed to the forward by the batch's ``bid``; the radix sweep is
  planned there too (the tree as that thread holds it); the step ends on the forward's thread, right after the
  forward, so the canary's state is only touched from one thread. Decode input ids are placeholders the client
  resolves on device: HEAD and TAIL get its future-token map to resolve them alike.
"""

from __future__ import annotations

from kvcanary_jax.integrations._sglang_mapping import is_overlap_client, radix_entries


class InlineSteps:
    """A plain ``ModelWorker``: everything on the scheduler's thread, the step ended by ``after_step``."""

    overlap = False

    def __init__(self, worker):
        self.model_worker = worker

    def install(self, guard) -> None:
        """Nothing beyond the model worker's own method, which the guard replaces."""

    def uninstall(self, guard) -> None:
        """Nothing to give back."""

    def pending_for(self, guard, model_worker_batch):
        """The forward's Pending, taken now (this is the scheduler's thread)."""
        return guard._take(model_worker_batch)

    def sweep_entries(self, guard):
        """None: the sweep runs in :meth:`after_step`, from the tree as it is then."""
        return None

    def launch_extras(self) -> dict:
        return {}

    def end_forward(self, guard, pending) -> None:
        """Nothing: the scheduler ends the step with ``after_step`` once it processed the results."""

    def after_step(self, guard) -> None:
        """The radix sweep when due, then the lagged report check."""
        if guard.tree_cache is not None and guard.monitor.sweep_due:
            guard.sweep()
        guard._check()


class OverlapSteps:
    """The overlap scheduler's ``ModelWorkerClient``: requests read as the batch is handed over, the step ended on
    the forward's thread."""

    overlap = True

    def __init__(self, client):
        self.client, self.model_worker = client, client.worker
        self._pending: dict = {}  # bid -> Pending, from the scheduler's thread to the forward's
        self._client_generate = None

    def install(self, guard) -> None:
        """Takes each batch's Pending as the scheduler hands it to the client."""
        self._client_generate = self.client.forward_batch_generation

        def enqueue(model_worker_batch, *args, **kwargs):
            self._pending[model_worker_batch.bid] = guard._take(model_worker_batch)
            return self._client_generate(model_worker_batch, *args, **kwargs)

        self.client.forward_batch_generation = enqueue

    def uninstall(self, guard) -> None:
        self.client.forward_batch_generation = self._client_generate

    def pending_for(self, guard, model_worker_batch):
        """The Pending the scheduler's thread took for this batch."""
        return self._pending.pop(model_worker_batch.bid)

    def sweep_entries(self, guard):
        """The radix slots to sweep after this batch's forward, when due (the tree as the scheduler holds it now)."""
        interval = guard.config.sweep_interval
        if guard.tree_cache is None or interval <= 0 or guard.enqueued % interval:
            return None
        return radix_entries(guard.tree_cache)

    def launch_extras(self) -> dict:
        """The future-token map the batch's placeholders resolve with (read on the forward's thread)."""
        return {"future_map": self.client.future_token_ids_map}

    def end_forward(self, guard, pending) -> None:
        """The step's end, on the forward's thread: the planned sweep, then the lagged report check."""
        if pending.sweep is not None:
            for action in pending.before_sweep:
                action(guard)
            guard.sweep(pending.sweep)
        guard._check()

    def after_step(self, guard) -> None:
        raise RuntimeError("under the overlap scheduler the worker's thread ends each step itself; do not call "
                           "after_step()")  # fmt: skip


def steps_for(worker) -> InlineSteps | OverlapSteps:
    """The step scheduling of the worker the scheduler calls."""
    return OverlapSteps(worker) if is_overlap_client(worker) else InlineSteps(worker)
