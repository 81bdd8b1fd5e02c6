"""The invariants a chaos run must keep, checked after the fact from its evidence. Pure functions.

    run_completed                    the job finished every step and every surviving agent exited 0
    final_digest_matches_reference   bitwise equal to the fault-free reference run, when every committed
                                     step ran at the reference's world size (otherwise not checked)
    data_exactly_once_per_epoch      the committed steps are 1..N without gaps or repeats, resumes are at
                                     checkpoint steps, replaying the sampler over them consumes each
                                     sample once per epoch, and where the state must equal the
                                     reference's, every step's loss does (so each step saw the same batch)
    no_corrupt_checkpoint_restored   no restore used a copy the harness damaged (see no_corrupt_restore)
    steps_lost_within_interval       each fault cost at most its bound (1 checkpoint interval; 2 for
                                     corrupt-checkpoint, which destroys the newest one on purpose), plus
                                     the steps run while the newest save was still being written when
                                     the fault hit (saves are asynchronous: an uncommitted checkpoint
                                     cannot be restored, but no committed one may be lost); and a fault
                                     that leaves every node's state (a killed or hung worker, a killed
                                     helper) resumes from the newest step all nodes held, or newer
    no_orphan_processes              nothing the harness started, or any of its descendants, is alive
    all_faults_injected              every fault not skipped fired, each corruption was read by a restore (or
                                     superseded: the resume went on from a newer intact state, such as another
                                     node's tier-0 snapshot), and each killed checkpoint helper was started
                                     again by its node's agent
    only_hit_processes_restart       in-process re-formation (elastic-run's default): after a fault, new worker
                                     processes start only where the fault hit (a killed or hung worker: one
                                     process on its node; a lost or cut-off node: none elsewhere; an added node:
                                     its own); every other worker keeps its pid. A worker its agent restarts as
                                     stuck (`reform_fallback`) or hung (`hang_detected`: a peer waiting on a hung
                                     worker makes no progress either) is allowed and named, but not a peer of
                                     hang-worker's stopped worker judged hung (a stopped one is judged first);
                                     broken too when every worker restarted although in-process was expected

A check that cannot be made (e.g. the script emits no `final_digest` event) is `None` with the reason: it never
counts as passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chaos.lineage import Attempt, Lineage, attempts
from chaos.timeline import AgentEvent, CheckpointSkipped, Event, PeerStep, Resumed, Step, WorkerStart
from trainer.data import DataConfig, ElasticSampler


@dataclass(frozen=True)
class Check:
    ok: bool | None
    """True kept, False broken, None not checked."""
    detail: str


@dataclass(frozen=True, kw_only=True)
class FaultOutcome:
    kind: str
    injected: bool
    skipped: str | None
    steps_lost: int
    lost_bound: int
    """Allowed steps lost, in checkpoint intervals."""
    injected_t: float | None = None
    corrupted_step: int | None = None
    corrupted_node: str | None = None
    damaged_steps: tuple[int, ...] = ()
    """Every step the corruption damaged a copy of on its node (tier 1's and tier 0's); () = corrupted_step's."""
    exercised: bool | None = None
    """For a corruption: a restore afterwards found it corrupt and skipped it."""
    superseded_by: int | None = None
    """For a corruption no restore read: the newer step the first resume after it went on from (an intact copy
    of a newer state, such as another node's tier-0 snapshot, left the damaged step nothing to serve)."""
    not_fired: str | None = None
    """Why a fault that was not skipped never fired."""
    corrupted_ranks: tuple[int, ...] = ()
    """The rank directories whose files the harness damaged."""
    node: str | None = None
    """The node the fault hit (the killed worker's, the lost or added one, ...)."""
    in_flight: int = 0
    """Steps run after the newest checkpoint step whose save had not committed on every node when
    the fault hit; they are allowed on top of the bound."""
    held_everywhere: int | None = None
    """The newest step every live node held whole when the fault hit (tier 0's snapshots or tier 1)."""
    resumed_from: int | None = None
    """The step the first resume after the fault went on from."""

    def damaged(self) -> tuple[int, ...]:
        """The steps whose copies the corruption damaged: `damaged_steps`, else the corrupted step (none: ())."""
        return self.damaged_steps or (() if self.corrupted_step is None else (self.corrupted_step,))


@dataclass(frozen=True, kw_only=True)
class Evidence:
    steps: int
    ckpt_every: int
    data: DataConfig | None
    completed: bool
    completion_detail: str
    lineage: Lineage
    events: list[Event]
    faults: list[FaultOutcome]
    orphans: list[str]
    final_digest: str | None
    reference_digest: str | None
    reference_world: int | None
    reference_losses: dict[int, float | None] = field(default_factory=dict)
    startup_lost: int = 0
    """Steps thrown away before the first fault (the first round formed before every node joined)."""
    consumed: dict[int, list[int]] | None = None
    """The sample ids each committed step consumed, as the script logged them; None: not logged."""
    consumed_problems: list[str] = field(default_factory=list)
    """Gaps in that log (a committed step without records, ranks missing)."""
    in_process_expected: bool = False
    """The agents ran with --reform in-process and the default script (trainer): a fault that loses or replaces
    a worker must be followed by a re-formation in place, not a restart of every worker."""


def check_all(ev: Evidence) -> dict[str, Check]:
    return {
        "run_completed": run_completed(ev),
        "final_digest_matches_reference": digest_matches(ev),
        "data_exactly_once_per_epoch": data_exactly_once(ev),
        "no_corrupt_checkpoint_restored": no_corrupt_restore(ev),
        "steps_lost_within_interval": steps_lost_within(ev),
        "no_orphan_processes": no_orphans(ev),
        "all_faults_injected": all_injected(ev),
        "only_hit_processes_restart": only_hit_processes_restart(ev),
    }


def run_completed(ev: Evidence) -> Check:
    if not ev.completed:
        return Check(False, ev.completion_detail)
    last = max(ev.lineage.steps, default=None)
    if ev.lineage.steps and last != ev.steps:
        return Check(False, f"the job exited, but its last committed step is {last}, not {ev.steps}")
    return Check(True, ev.completion_detail)


def digest_matches(ev: Evidence) -> Check:
    if ev.reference_digest is None or ev.final_digest is None:
        return Check(None, "the script emitted no final_digest event (in the reference or the chaos run)")
    worlds = {c.world for c in ev.lineage.steps.values()}
    if None in worlds or ev.reference_world is None:
        return Check(None, "the world size of some committed steps is unknown (no `worker_started` events)")
    if worlds != {ev.reference_world}:
        ran = sorted(w for w in worlds if w is not None)
        return Check(None, f"not comparable: committed steps ran at world sizes {ran}, the reference at "
                           f"{ev.reference_world}; a different world size changes the floating-point sums")
    same = ev.final_digest == ev.reference_digest
    return Check(same, f"final {ev.final_digest[:16]}... {'==' if same else '!='} reference "
                       f"{ev.reference_digest[:16]}... (world size {ev.reference_world})")


def data_exactly_once(ev: Evidence) -> Check:
    lin = ev.lineage
    if not lin.steps:
        return Check(None, "the script emitted no step events")
    problems = list(lin.problems)
    missing = sorted(set(range(1, ev.steps + 1)) - set(lin.steps))
    extra = sorted(set(lin.steps) - set(range(1, ev.steps + 1)))
    if missing:
        problems.append(f"steps never committed: {_ranges(missing)}")
    if extra:
        problems.append(f"steps beyond --steps: {_ranges(extra)}")
    notes = []
    if ev.consumed is not None:
        problems += ev.consumed_problems
        if ev.data is not None:
            problems += _check_consumed(ev.consumed, ev.data)
        notes.append(f"sample ids logged by the workers for {len(ev.consumed)} committed steps: each sample once per "
                     "epoch, each step's ids those of the global data position")
    elif ev.data is not None and not missing:
        problems += _replay_sampler(ev.data, ev.steps)
        notes.append(f"sampler replayed over {ev.steps} committed steps "
                     f"({ev.steps // max(1, ev.data.dataset_size // ev.data.global_batch)} full epoch(s); the script "
                     "logs no sample ids)")
    if ev.reference_losses and ev.reference_world is not None:
        compared = 0
        for step in sorted(lin.steps):
            c = lin.steps[step]
            if c.world != ev.reference_world:
                break  # from here on the state differs from the reference's by design
            ref = ev.reference_losses.get(step)
            if c.loss is not None and ref is not None:
                compared += 1
                if c.loss != ref:
                    problems.append(f"step {step}: loss {c.loss} != reference {ref}: the step did not see the same "
                                    "batch or state as the reference")
                    break
        notes.append(f"{compared} step losses equal to the reference's")
    if problems:
        return Check(False, "; ".join(problems[:5]))
    return Check(True, "; ".join(["committed steps are 1.." + str(ev.steps) + " exactly once", *notes]))


def _check_consumed(consumed: dict[int, list[int]], data: DataConfig) -> list[str]:
    """The logged ids against the sampler's definition: every step consumed exactly its global batch
    of the global position, so no sample of an epoch was skipped or seen twice."""
    sampler = ElasticSampler(data, rank=0, world_size=1)
    per_epoch = (data.dataset_size // data.global_batch) * data.global_batch
    problems: list[str] = []
    seen: dict[int, set[int]] = {}
    last = max(consumed, default=0)
    for step in range(1, last + 1):
        epoch, expected = sampler.epoch, sampler.global_indices()
        sampler.advance()
        ids = consumed.get(step)
        if ids is None:
            continue
        bucket = seen.setdefault(epoch, set())
        twice = bucket.intersection(ids) | {i for i in ids if ids.count(i) > 1}
        if twice:
            problems.append(f"step {step}: samples {sorted(twice)[:5]} consumed twice in epoch {epoch}")
        elif sorted(ids) != sorted(expected):
            problems.append(f"step {step}: consumed {len(ids)} samples that are not the global batch at its data "
                            f"position (e.g. {sorted(set(ids) - set(expected))[:5]})")
        bucket.update(ids)
    for epoch, distinct in seen.items():
        if epoch < sampler.epoch and len(distinct) != per_epoch:
            problems.append(f"epoch {epoch}: {len(distinct)} distinct samples consumed, expected {per_epoch}")
    return problems[:5]


def _replay_sampler(data: DataConfig, steps: int) -> list[str]:
    sampler = ElasticSampler(data, rank=0, world_size=1)
    seen: dict[int, set[int]] = {}
    problems = []
    for step in range(1, steps + 1):
        epoch = sampler.epoch
        ids = sampler.global_indices()
        bucket = seen.setdefault(epoch, set())
        dup = bucket.intersection(ids)
        if dup or len(set(ids)) != len(ids):
            problems.append(f"step {step}: samples {sorted(dup)[:5]} consumed twice in epoch {epoch}")
        bucket.update(ids)
        sampler.advance()
    per_epoch = (data.dataset_size // data.global_batch) * data.global_batch
    for epoch, consumed in seen.items():
        if epoch < sampler.epoch and len(consumed) != per_epoch:
            problems.append(f"epoch {epoch}: {len(consumed)} samples consumed, expected {per_epoch}")
    return problems


def no_corrupt_restore(ev: Evidence) -> Check:
    """No restore used a copy the harness damaged.

    A corrupted step stays suspect until training reaches it again (and saves it anew). A resume from
    it is fine when the node holding the damaged files was not in the group, or none of its ranks
    owned a damaged file, or it reported the damaged copy unreadable (the checksum caught it and
    another copy, e.g. the shared tier's, was used), or the steps after the resume repeat the losses
    they had before the fault (damaged weights or moments would not)."""
    corruptions = [f for f in ev.faults if f.corrupted_step is not None and f.injected_t is not None]
    rejected = [e for e in ev.events if isinstance(e, CheckpointSkipped)]
    if not corruptions:
        note = f"; {len(rejected)} unreadable copies rejected by the workers" if rejected else ""
        return Check(True, "no checkpoint was corrupted by the harness" + note)
    runs = attempts(ev.events)
    members = _members(ev.events, runs)
    bad, fine = [], []
    for f, step in [(c, s) for c in corruptions for s in c.damaged()]:
        assert f.injected_t is not None
        node = f.corrupted_node
        rewritten = next((e.t for e in ev.events if isinstance(e, Step) and e.t > f.injected_t and e.step == step),
                         float("inf"))
        for r in (e for e in ev.events if isinstance(e, Resumed) and f.injected_t < e.t < rewritten and e.step == step):
            i = max((j for j, a in enumerate(runs) if a.start_t <= r.t), default=-1)
            ranks = members.get((i, node or ""), set())
            start = runs[i].start_t if i >= 0 else r.t
            if not ranks & set(f.corrupted_ranks):
                fine.append(f"step {step} resumed without {node}'s damaged rank files")
            elif any(e.step == step and e.node == node and start - 1 <= e.t <= r.t + 1 for e in rejected):
                fine.append(f"step {step}: {node} rejected its damaged copy and restored another one")
            elif same := _continues_as_before(runs, r, before=f.injected_t):
                fine.append(f"step {step} restored from an intact copy ({same})")
            else:
                bad.append(f"resumed from step {step} at t={r.t:.1f}s with {node} (ranks {sorted(ranks)}) in the "
                           f"group, whose rank files {list(f.corrupted_ranks)} the harness had damaged; no worker "
                           "reported the damage and the steps after it do not repeat their earlier losses")
    if bad:
        return Check(False, "; ".join(bad[:3]))
    steps = sorted({s for f in corruptions for s in f.damaged()})
    return Check(True, "; ".join([f"no damaged copy of steps {steps} was restored", *sorted(set(fine))]))


def _members(events: list[Event], runs: list[Attempt]) -> dict[tuple[int, str], set[int]]:
    """(attempt, node) -> the global ranks the node's workers held in that attempt."""
    out: dict[tuple[int, str], set[int]] = {}
    starts = [a.start_t for a in runs]
    for e in events:
        if isinstance(e, WorkerStart) and starts:
            i = min(range(len(starts)), key=lambda j: abs(starts[j] - e.t))
            out.setdefault((i, e.node), set()).add(e.rank)
    return out


def _continues_as_before(runs: list[Attempt], resumed: Resumed, *, before: float, compare: int = 3) -> str | None:
    """Whether the attempt that resumed at `resumed` repeats, for its first steps, the losses an attempt
    from before `before` had at the same steps and world size. Returns the evidence, or None."""
    after = next((a for a in runs if a.start_t <= resumed.t and a.resumed_from == resumed.step
                  and a.steps and a.steps[0].t > resumed.t), None)
    if after is None:
        return None
    earlier = {s.step: s.loss for a in runs if a.start_t < before and a.world == after.world for s in a.steps}
    pairs: list[tuple[int, float, float]] = []
    for s in after.steps[:compare]:
        old = earlier.get(s.step)
        if s.loss is not None and old is not None:
            pairs.append((s.step, s.loss, old))
    if not pairs or not all(_close(a, b) for _, a, b in pairs):
        return None
    return f"losses of steps {[n for n, _, _ in pairs]} equal those before the fault"


def _close(x: float, y: float) -> bool:
    """Losses equal up to float summation order; damaged weights or moments are far off."""
    return abs(x - y) <= 1e-4 * max(1.0, abs(y))


_KEEPS_STATE = frozenset({"kill-worker", "hang-worker", "kill-ckpt-helper"})
"""Faults that take no node's tier 0 or tier 1 away (a lost node's memory goes with it; a corruption damages
copies on purpose)."""


def steps_lost_within(ev: Evidence) -> Check:
    def allowed(f: FaultOutcome) -> int:
        return f.lost_bound * ev.ckpt_every + f.in_flight

    def cost(f: FaultOutcome) -> str:
        extra = f" ({f.in_flight} run while a save was being written)" if f.in_flight else ""
        return f"{f.kind} {f.steps_lost}{extra}"

    def why(f: FaultOutcome) -> str:
        if not f.in_flight:
            return ""
        return f" ({f.lost_bound * ev.ckpt_every} + {f.in_flight} run while a save was being written)"

    over = [f"{f.kind}: {f.steps_lost} steps lost > {allowed(f)}{why(f)}"
            for f in ev.faults if f.injected and f.steps_lost > allowed(f)]
    # Within the bound, still a step too old: a fault that leaves every node's state in place must resume from
    # the newest step all of them held, or newer (their memory).
    over += [f"{f.kind}: resumed from step {f.resumed_from}, older than step {f.held_everywhere}, which every node "
             "held whole (tier 0 or 1) when the fault hit" for f in ev.faults
             if f.injected and f.kind in _KEEPS_STATE and f.held_everywhere is not None
             and f.resumed_from is not None and f.resumed_from < f.held_everywhere]
    costs = ", ".join(cost(f) for f in ev.faults if f.injected)
    if over:
        return Check(False, "; ".join(over))
    if not any(f.injected for f in ev.faults):
        return Check(True, "no fault was injected")
    note = f"; {ev.startup_lost} steps re-run at start-up before all nodes joined" if ev.startup_lost else ""
    return Check(True, f"steps lost per fault: {costs} (interval {ev.ckpt_every}){note}")


def no_orphans(ev: Evidence) -> Check:
    if ev.orphans:
        return Check(False, "still alive: " + "; ".join(ev.orphans[:10]))
    return Check(True, "every process started for the run, and every descendant seen, is gone")


def all_injected(ev: Evidence) -> Check:
    problems = []
    for f in ev.faults:
        if f.skipped is None and not f.injected:
            problems.append(f"{f.kind} was planned but never fired" + (f" ({f.not_fired})" if f.not_fired else ""))
        if f.corrupted_step is not None and f.exercised is False and f.superseded_by is None:
            problems.append(f"{f.kind}: no restore ever read the corrupted step {f.corrupted_step}")
        if f.kind == "kill-ckpt-helper" and f.injected and not any(
                isinstance(e, AgentEvent) and e.name == "ckpt_helper_restarted" and e.node == f.node
                and (f.injected_t is None or e.t >= f.injected_t) for e in ev.events):
            problems.append(f"{f.kind}: the agent of {f.node} never started a new checkpoint helper")
    if problems:
        return Check(False, "; ".join(problems))
    fired = sum(1 for f in ev.faults if f.injected)
    skipped = sum(1 for f in ev.faults if f.skipped is not None)
    superseded = [f"step {f.corrupted_step} by {f.superseded_by}" for f in ev.faults
                  if f.exercised is False and f.superseded_by is not None]
    unread = f"; a corruption left unread, a newer intact state resumed: {', '.join(superseded)}" if superseded else ""
    return Check(True, f"{fired} fired, {skipped} skipped with a reason{unread}")


# New worker processes a fault may cause, where in-process re-formation keeps every other one: (on the hit node,
# elsewhere). None: any number (corrupt-checkpoint restarts every node's workers on purpose, so a restore reads it).
_NEW_PROCESSES: dict[str, tuple[int | None, int] | None] = {
    "kill-worker": (1, 0), "hang-worker": (1, 0), "kill-node": (0, 0), "partition-node": (None, 0),
    "add-node": (None, 0), "corrupt-checkpoint": None,
}


_REFORMS = frozenset({"kill-worker", "hang-worker", "kill-node", "partition-node", "add-node"})
"""Faults after which in-process re-formation keeps the other workers' processes (a `reform` or a `restart`
that replaced only the hit worker)."""


def only_hit_processes_restart(ev: Evidence) -> Check:
    fired = sorted((f for f in ev.faults if f.injected_t is not None), key=lambda f: f.injected_t or 0.0)
    if not fired:
        return Check(True, "no fault fired")
    agents = [e for e in ev.events if isinstance(e, AgentEvent)]
    if not any(e.name == "reform" or (e.name == "restart" and e.fields.get("replaced")) for e in agents):
        reforming = sorted({f.kind for f in fired if f.kind in _REFORMS})
        if ev.in_process_expected and reforming:
            return Check(False, f"no worker re-formed in place after {', '.join(reforming)}, with --reform "
                                "in-process and the default script: every worker restarted")
        return Check(None, "no worker re-formed in place (--reform restart, or a script without trainer): every "
                           "worker restarts on a fault by design")
    starts = [e for e in ev.events if isinstance(e, WorkerStart)]
    fallbacks = [e for e in ev.events if isinstance(e, AgentEvent) and e.name in ("reform_fallback", "hang_detected")]
    # A fault that landed once the job's last step was done (the harness saw its step late, on a loaded machine):
    # the workers had finished and no longer re-form in place; a membership change restarts them, by design.
    ended = min((e.t for e in ev.events if isinstance(e, Step | PeerStep) and e.step >= ev.steps), default=None)
    late: list[str] = []
    problems: list[str] = []
    for i, fault in enumerate(fired):
        begin = fault.injected_t or 0.0
        end = (fired[i + 1].injected_t or begin) if i + 1 < len(fired) else float("inf")
        allowed = _NEW_PROCESSES.get(fault.kind, (0, 0))
        if allowed is None:
            continue
        if ended is not None and begin > ended:
            late.append(f"{fault.kind} on {fault.node}")
            continue
        seen = {(e.node, e.pid) for e in starts if e.t < begin}
        new: dict[str, set[int]] = {}
        for e in starts:
            if begin <= e.t < end and (e.node, e.pid) not in seen:
                new.setdefault(e.node, set()).add(e.pid)
        # A stuck worker its agent restarted, or one judged hung: a worker waiting in a collective on a hung peer
        # makes no progress either, so its own agent's --hang-timeout may end it too. Not for hang-worker's
        # SIGSTOP on another node: a stopped worker is judged at half the timeout, so its blocked peers re-form
        # in place before their own agents judge them (elastic/agent.py STOPPED_SHARE).
        excused = {e.node for e in fallbacks if begin <= e.t < end
                   and not (fault.kind == "hang-worker" and e.name == "hang_detected" and e.node != fault.node)}
        for node, pids in sorted(new.items()):
            limit = allowed[0] if node == fault.node else allowed[1]
            if limit is not None and len(pids) > limit and node not in excused:
                where = "the hit node" if node == fault.node else "a node the fault did not hit"
                problems.append(f"{fault.kind} on {fault.node}: {len(pids)} new worker process(es) on {node} "
                                f"({where}; at most {limit}): pids {sorted(pids)}")
    if problems:
        return Check(False, "; ".join(problems))
    note = (f" (a worker its agent judged stuck or hung restarted on {', '.join(sorted({e.node for e in fallbacks}))})"
            if fallbacks else "")
    if late:
        note += f" ({', '.join(late)} landed after the job's last step: not judged)"
    return Check(True, f"after each of {len(fired)} fault(s), new processes only where it hit{note}")


def _ranges(values: list[int]) -> str:
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)
