"""--ft: what the loop takes from the quorum keeper each tick: the keeper's own polls (and the node
relay's), the step each replica committed, which restarted replicas are training again, and
the newest checkpoint for `ftrun status`.

The keeper (ftrun.supervisor.quorum) decides the quorum; here its view becomes the worker
records' states and the console's lines.
Part of the Supervisor (a mixin: it updates the loop's own worker records and status).
A script that never joins a quorum is found here (_check_ft_api); the loop turns the run to group restarts.
Must never start, stop or signal a worker, and never be called from outside the loop's thread.
"""

from __future__ import annotations

from ftrun.supervisor.nodes import one_line
from ftrun.supervisor.progress_reader import note_steps
from ftrun.supervisor.worker import WorkerState


class QuorumFollow:
    """The --ft part of the Supervisor's tick (ftrun.supervisor.run holds the state)."""

    def _poll_quorum(self, now: float) -> None:
        q = self.quorum
        try:
            if self.relay is not None:
                self.relay.poll(now)
            q.poll(now)
        except Exception as e:  # the store went away: the loop's other checks will say so
            if not self._quorum_failing:
                self._quorum_failing = True
                self.console.note(f"quorum poll failed: {one_line(e)}", style="yellow")
            return
        self._quorum_failing = False
        for rank, inc in q.rejoined:  # a worker became its next incarnation in place: its process lives on
            for w in self.workers:
                if w.rank == rank and w.alive:
                    w.incarnation = inc
                    self.progress.forget(rank)
        q.rejoined.clear()
        if self.cfg.checkpoint_dir and now == self._last_progress:
            self._poll_checkpoint()  # a few times a second, with the progress poll
        while q.history:
            self.console.note(q.history.pop(0), style="cyan")
        for w in self.workers:
            info = q.info.get(w.rank)
            if w.alive and info and info.get("inc") == w.incarnation and w.first_step_seen:
                # Fresher than the progress key (read a few times a second): the step now.
                if note_steps(w, int(info.get("step") or 0), now):
                    self._dirty = True
        for w in self.workers:
            if w.state in (WorkerState.RECOVERING, WorkerState.STARTING, WorkerState.RUNNING) and w.alive:
                if q.replica_fields(w.rank)["in_quorum"] and w.state != WorkerState.RUNNING:
                    if w.state == WorkerState.RECOVERING and w.last_failure is not None:
                        took = now - w.last_failure.when
                        w.rejoin_s = took
                        who = (f"rank {w.rank}" if self.k == 1 else
                               f"replica {w.rank // self.k} (rank {w.rank} failed)")
                        if q.epoch_id in q.fresh_epochs:
                            self.console.note(f"{who} is training again {took:.2f} s after it failed; no replica "
                                              f"held the trained state: {q.fresh_start}", style="green")
                        else:
                            self.console.note(f"{who} is training again, healed from a peer "
                                              f"{took:.2f} s after it failed", style="green")
                    w.state = WorkerState.RUNNING
                    self._dirty = True
        if self._check_ft_api():
            return
        if self.status.quorum_id != q.epoch_id:
            self._dirty = True  # the run's figures are taken at every write (_write_state)

    def _check_ft_api(self) -> bool:
        """A worker that steps without ever asking to join a quorum runs a script without ftrun.ft:
        none of its replicas can heal from a peer, and one restarted alone could not join the
        script's own process group. Such a run gets what it gets without --ft, group restarts
        (every worker with its own default group again), said once. Several nodes keep replica
        restarts (their group restarts are agreed at the start), with the line. True when the
        quorum is given up."""
        q = self.quorum
        if self._warned_no_ft_api or q is None:
            return False
        plain = [w.rank for w in self.workers if w.first_step_seen and not q.info.get(w.rank)]
        if not plain:
            return False
        self._warned_no_ft_api = True
        how = ("a failure restarts all workers, as without --ft" if self.nodes is None else
               "drop --ft for group restarts")
        self.console.note(f"--ft: rank {plain[0]} trains without ftrun.ft (it never asked to join a quorum), so a "
                          f"failed replica cannot heal from a peer: {how} (wrap the model, optimizer and loop with "
                          f"ftrun.ft for replica restarts; see scripts/train_ft.py)", style="bold yellow")
        if self.nodes is not None:
            return False
        self._to_group_restarts()
        return True

    def _poll_checkpoint(self) -> None:
        """The newest good checkpoint and the saves failed since, for `ftrun status`."""
        try:
            ck = self._checkpoints.poll(self.store)
        except Exception:
            return
        if ck is not None:
            self.status.checkpoint = ck
            self.ledger.checkpoint(ck)  # once per good checkpoint (a failed save changes nothing there)
            self._dirty = True
