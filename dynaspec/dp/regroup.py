"""A rank's side of re-forming its group (§7d): which group it steps in, the move it was told
about, and the handshake that makes a new group decide as one.

The front end sends ``Regroup(epoch, members, agree)``. A rank moves:
- at once when it has no group (it just started, it is a replacement, or its exchange failed)
  or when ``agree`` is false (a member was lost: the old group cannot complete an exchange);
- else after the tick where every member's row names the epoch (``StepAgreement.join_epoch``):
  the old group is whole and keeps stepping until all move at the same step boundary, so a
  replacement joins without a pause on the survivors beyond the group's forming.
A newer Regroup replaces a pending one, also while forming (``RankGroup.form`` polls).

The handshake on the new group: every member sends its tick count and longest step; the
member with the most ticks (the lowest such) sends its K policy's engine-wide state, one value
(``LockstepPolicy.state``), to the others, and every member continues from it at that tick
count. At epoch 0 rank 0's
step cost table is shared first, as at every start (``share_cost_model``).
"""

from __future__ import annotations

from collections.abc import Callable

from dynaspec.dp.agreement import StepAgreement, Tick
from dynaspec.dp.group import Membership, RankGroup
from dynaspec.dp.lockstep_policy import LockstepPolicy, share_cost_model
from dynaspec.dp.messages import RankSpec, Regroup
from dynaspec.spec_decode.policy.policy_state import PolicyState


class GroupSwitch:
    def __init__(self, store, spec: RankSpec) -> None:
        self.store, self.spec, self.rank = store, spec, spec.rank
        self.group: RankGroup | None = None
        self.epoch = -1
        first = Regroup(0, tuple(range(spec.world_size)), agree=False)
        self.pending: Regroup | None = None if spec.joining else first
        self.agreed = False  # every member's row named pending.epoch: move after this step

    def offer(self, msg: Regroup) -> None:
        newest = self.pending.epoch if self.pending is not None else self.epoch
        if msg.epoch > newest:
            self.pending, self.agreed = msg, False

    @property
    def join_epoch(self) -> int:
        """What this rank's row says (StepAgreement.join_epoch)."""
        p = self.pending
        return p.epoch if p is not None and p.agree and self.group is not None else 0

    def due(self) -> bool:
        p = self.pending
        return p is not None and (not p.agree or self.group is None or self.agreed)

    def after_tick(self, tick: Tick) -> None:
        if self.pending is not None and tick.join_epoch == self.pending.epoch:
            self.agreed = True

    def switch(self, agreement: StepAgreement, policy: LockstepPolicy | None,
               stop: Callable[[], bool]) -> None:
        """Form the pending group and step in it from now on. ``stop()`` reads the rank's
        commands and says whether it must leave. Raises GroupAbandoned (a newer Regroup, or
        stopping) or CollectiveError (a member did not come)."""
        target = self.pending
        assert target is not None
        if self.rank not in target.members:
            raise RuntimeError(f"rank {self.rank} is not a member of group {target.epoch}")
        timeout = self.spec.start_timeout_s if target.epoch == 0 else agreement.timeout_s()
        group = RankGroup.form(self.store, Membership(target.epoch, target.members), self.rank,
                               timeout, lambda: stop() or self.pending is not target)
        self._handshake(group, agreement, policy, timeout)
        self.lose()
        self.group, self.epoch = group, target.epoch
        if self.pending is target:
            self.pending = None
        agreement.gather, agreement.world_size = group.gather, group.size

    def lose(self) -> None:
        """The group failed (or is replaced): drop it; wait for the front end's Regroup."""
        if self.group is not None:
            self.group.retire()
        self.group, self.agreed = None, False

    @staticmethod
    def _handshake(group: RankGroup, agreement: StepAgreement, policy: LockstepPolicy | None,
                   timeout: float) -> None:
        rows = group.gather([float(agreement.num_ticks), agreement.longest_step_s], timeout)
        ticks = [r[0] for r in rows]
        leader = ticks.index(max(ticks))
        if group.membership.epoch == 0 and policy is not None:
            share_cost_model(policy, group.rank,
                             lambda obj: group.broadcast_object(obj, 0, timeout))
        mine = policy.state if policy is not None and group.index == leader else None
        state = group.broadcast_object(mine, leader, timeout)
        if policy is not None and group.index != leader:
            assert state is None or isinstance(state, PolicyState)  # the leader's policy.state
            policy.adopt(state)
        agreement.num_ticks = int(max(ticks))
        agreement.longest_step_s = max(r[1] for r in rows)
        agreement.last = None
