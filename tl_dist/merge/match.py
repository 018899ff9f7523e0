"""Joining collectives across ranks and giving each a verdict (PyTorch Flight Recorder's taxonomy).

Collectives are keyed by (group's global ranks, group sequence number), which c10d keeps equal on every member.
A sequence number alone cannot tell *which* op diverged, though: when one rank skips a collective, its later
collectives shift by one sequence number and every later pair looks wrong. So within a group each rank's
collectives (in sequence order) are aligned to a reference member's on where they were issued -- (func,
module, source line) -- the way ``diff`` aligns lines. Identical sequences (the common, healthy case) pair
by position without running the aligner. p2p send/recv pair by (group, src, dst, n-th occurrence).

Verdict per joined collective, first that applies:

- when every member issued it at the same position: ``type_mismatch`` (different collectives),
  ``dtype_mismatch``, ``size_mismatch`` (sizes break the kind's rule -- all_reduce, broadcast, reduce:
  in == out and equal on all members; all_gather / gather: equal inputs, out == in x group size; reduce_scatter / scatter: equal
  outputs, in == out x group size; all_to_all: total in == total out; others: equal payloads). A
  disagreement is the cause even when the collective then failed on some members.
- ``not_completed``  a member whose shard is incomplete issued it but never saw it complete, or never
  reached it (the hang signature).
- ``order``          the ranks issued it at different positions (swapped collectives).
- ``missing``        some members never issued it (skipped, or did something else there).
- ``shifted``        the members agree on it but not on its sequence number: an earlier skip or extra call
  shifted the group, and backends pair calls by count (one finding per group and step).
- ``matched``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any, NamedTuple

from ..schema import P2P_ROLES, module_name

VERDICTS = (
    "matched",
    "not_completed",
    "order",
    "missing",
    "type_mismatch",
    "dtype_mismatch",
    "size_mismatch",
    "shifted",
)
# Swapped collectives are looked for within this many joined collectives of each other.
_SWAP_WINDOW = 3


class Entry(NamedTuple):
    """One rank's record of one collective: its collective-table row plus where in the model it ran.

    ``key`` is (func, module, source) as interned string ids (:class:`~.sources.Interner`): what the aligner
    compares across ranks.
    """

    rank: int
    row: int
    op: int
    func: str
    group: tuple[int, ...]
    group_name: str
    seq: int
    peer: int
    root: int
    in_numel: int
    out_numel: int
    dtype: str
    nbytes: int
    is_async: bool
    issue_ns: int
    complete_ns: int
    state: str
    label: str
    module: str
    source: str
    in_module: bool  # the op ran inside a module call (a non-empty module_stack): '' is then the root module
    key: tuple[int, int, int]

    @property
    def module_name(self) -> str:
        """How views name the op's module: its address, ``<root>``, or ``(outside modules)``."""
        return module_name({"module": self.module, "module_stack": self.in_module})

    def where(self) -> dict[str, Any]:
        """The op's place in the model, for findings (``module`` as views name it, see :attr:`module_name`)."""
        return {
            "op": self.op,
            "label": self.label,
            "func": self.func,
            "module": self.module_name,
            "source": self.source,
            "seq": self.seq,
            "state": self.state,
        }

    @property
    def payload(self) -> int:
        return self.in_numel if self.in_numel > 0 else self.out_numel


@dataclass
class Joined:
    """One collective joined across the ranks that issued it."""

    step: int
    group: tuple[int, ...]
    group_name: str
    entries: dict[int, Entry]
    expected: tuple[int, ...]  # members that have a shard for this step
    absent: tuple[int, ...]  # members without a (readable) shard
    p2p: bool = False
    order: bool = False
    swapped: bool = False  # inside an `order` swap: the members' numbers differ by the reordering
    verdict: str = "matched"
    detail: str = ""
    blame: tuple[int, ...] = ()  # the ranks breaking a size rule, when the rule tells (else a vote decides)

    @property
    def func(self) -> str:
        if self.p2p:
            return "send/recv"
        funcs = sorted({e.func for e in self.entries.values()})
        return funcs[0] if len(funcs) == 1 else "/".join(funcs)

    @property
    def seq(self) -> int:
        seqs = [e.seq for e in self.entries.values()]
        return min(seqs) if seqs else -1

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r in self.expected if r not in self.entries)


@dataclass
class Finding:
    """A problem the merge found.

    Attributes:
        kind: a verdict other than ``matched`` (see :mod:`tl_dist.merge.match`), ``missing_rank`` (no shard
            for a rank of the world), ``unreadable_shard`` (``strict=False`` only), ``foreign_shard`` (written by
            another job) or ``incomplete_shard`` (the window ended early).
        step: the captured step (window) it belongs to.
        group: global ranks of the process group; ``()`` for rank-level findings.
        seq: the group's sequence number of the collective (the lowest among ranks); -1 when none.
        ranks: the ranks at fault: those that lack it (for a hang: never reached it, else the ones stuck in
            it), or the minority that disagrees with the others.
        message: one readable sentence.
        where: per rank, the op's label / func / module / source / seq / state; ranks that never issued it get
            ``absent: True`` and their last recorded op, so the user sees where each rank was.
        primary: False for a consequence of an earlier finding in the same group: a hang, or a ``shifted``
            (in the same step, or after a finding of an earlier step: :func:`mark_consequences`).
    """

    kind: str
    step: int
    group: tuple[int, ...]
    seq: int
    ranks: tuple[int, ...]
    message: str
    where: dict[int, dict[str, Any]] = field(default_factory=dict)
    primary: bool = True

    def __str__(self) -> str:
        return f"[step {self.step}] {self.kind}: {self.message}"


# -- alignment ----------------------------------------------------------------------------------------------
def _align(lists: dict[int, list[Entry]], ranks: list[int]) -> list[dict[int, Entry]]:
    """Align each rank's collectives of one group to the reference (first) rank's; returns joined slots."""
    ref = ranks[0]
    ref_list = lists.get(ref, [])
    ref_keys = [e.key for e in ref_list]
    slots: list[dict[int, Entry]] = [{ref: e} for e in ref_list]
    # Collectives the reference lacks, by gap (they come before reference position p), merged across ranks
    # by (key, occurrence within the gap).
    extras: dict[int, dict[tuple, dict[int, Entry]]] = {}
    for r in ranks[1:]:
        lst = lists.get(r, [])
        keys = [e.key for e in lst]
        if keys == ref_keys:
            for i, e in enumerate(lst):
                slots[i][r] = e
            continue
        inserted: list[tuple[int, Entry]] = []
        for _tag, i1, i2, j1, j2 in SequenceMatcher(None, ref_keys, keys, autojunk=False).get_opcodes():
            n = min(i2 - i1, j2 - j1)
            for k in range(n):
                slots[i1 + k][r] = lst[j1 + k]
            inserted.extend((i1 + n, lst[j]) for j in range(j1 + n, j2))
        seen: dict[tuple, int] = {}
        for gap, e in inserted:
            occ = seen.get((gap, e.key), 0)
            seen[(gap, e.key)] = occ + 1
            extras.setdefault(gap, {}).setdefault((e.key, occ), {})[r] = e
    ordered: list[dict[int, Entry]] = []
    for p in range(len(ref_list) + 1):
        ordered.extend(extras.get(p, {}).values())
        if p < len(ref_list):
            ordered.append(slots[p])
    return ordered


def _merge_swaps(
    slots: list[dict[int, Entry]], present: set[int]
) -> list[tuple[dict[int, Entry], bool, bool]]:
    """Fold a collective one set of ranks issued early and the rest late into one slot marked ``order``. Each
    slot comes with (its entries, ``order``, whether it lies inside such a swap: its members' numbers differ
    because of the reordering, not because of a shift)."""
    out: list[tuple[dict[int, Entry], bool, bool]] = [(s, False, False) for s in slots]
    i = 0
    while i < len(out):
        a = out[i][0]
        if set(a) != present:
            keys = {e.key for e in a.values()}
            for j in range(i + 1, min(i + 1 + _SWAP_WINDOW, len(out))):
                b = out[j][0]
                if set(a) & set(b) or (set(a) | set(b)) != present:
                    continue
                if {e.key for e in b.values()} == keys and len(keys) == 1:
                    out[i] = ({**a, **b}, True, out[i][2])
                    for k in range(i + 1, j):
                        out[k] = (out[k][0], out[k][1], True)
                    del out[j]
                    break
        i += 1
    return out


# -- verdicts -----------------------------------------------------------------------------------------------
# Kinds where one side is a rank's share and the other the whole: (the side equal on every member, the side
# that must be group size x it where present -- a gather's non-root output and a scatter's non-root input are 0).
_FAN_SIDES = {
    "all_gather": ("input", "output"),
    "gather": ("input", "output"),
    "reduce_scatter": ("output", "input"),
    "scatter": ("output", "input"),
}

# Kinds that reduce or copy one buffer of the same size on every member: in == out on each.
_IN_PLACE = frozenset({"all_reduce", "broadcast", "reduce"})


def _minority(values: dict[int, Any]) -> tuple[int, ...]:
    """The ranks outside the largest group of equal values (ties: the group with the lowest rank wins)."""
    votes: dict[Any, list[int]] = {}
    for r, v in values.items():
        votes.setdefault(v, []).append(r)
    if len(votes) < 2:
        return tuple(sorted(values))
    groups = sorted(votes.values(), key=lambda rs: (-len(rs), sorted(rs)))
    return tuple(sorted(r for rs in groups[1:] for r in rs))


def _size_problem(func: str, entries: list[Entry], group_size: int) -> tuple[str, tuple[int, ...]]:
    """Why the sizes break ``func``'s rule ('' when they don't), and the ranks that break it."""
    sizes = {
        "input": {e.rank: e.in_numel for e in entries},
        "output": {e.rank: e.out_numel for e in entries},
    }
    ins, outs = sizes["input"], sizes["output"]
    if func == "barrier":
        return "", ()
    sides = _FAN_SIDES.get(func)
    if sides is not None:
        share_side, whole_side = sides
        share, whole = sizes[share_side], sizes[whole_side]
        if len(set(share.values())) > 1:
            return f"{share_side}s differ across ranks: {share}", _minority(share)
        bad = {r: w for r, w in whole.items() if w > 0 and w != share[r] * group_size}
        return (f"{whole_side} != {share_side} x {group_size} on ranks {bad}" if bad else ""), tuple(
            sorted(bad)
        )
    if func == "all_to_all":
        # Splits may be uneven (all_to_all_single with split sizes): only the totals must agree.
        total_in, total_out = sum(ins.values()), sum(outs.values())
        if total_in == total_out:
            return "", ()
        return f"total input {total_in} != total output {total_out}", _minority(
            {r: (ins[r], outs[r]) for r in ins}
        )
    if func in _IN_PLACE:
        bad = {r: (ins[r], outs[r]) for r in ins if outs[r] > 0 and ins[r] > 0 and outs[r] != ins[r]}
        if bad:
            return f"input != output (in, out) on ranks {bad}", tuple(sorted(bad))
    pay = {e.rank: e.payload for e in entries}
    return (f"sizes differ across ranks: {pay}", _minority(pay)) if len(set(pay.values())) > 1 else ("", ())


def _mismatch(slot: Joined, entries: list, group_size: int) -> tuple[str, str, tuple[int, ...]] | None:
    """Type, dtype or size disagreement among members that all issued the collective, with the ranks to blame
    (``()``: the minority of a vote, see :func:`_culprits`); None if they agree."""
    if not slot.p2p and len({(e.func, e.dtype, e.in_numel, e.out_numel) for e in entries}) == 1:
        # Every member issued the same thing (the healthy case): the kind's rule holds for all if for one.
        if not _size_problem(entries[0].func, entries[:1], group_size)[0]:
            return None
    if not slot.p2p and len({e.func for e in entries}) > 1:
        detail = "different collectives: " + ", ".join(f"rank {e.rank} {e.func}" for e in entries)
        return "type_mismatch", detail, ()
    if len({e.dtype for e in entries}) > 1:
        detail = "different dtypes: " + ", ".join(f"rank {e.rank} {e.dtype}" for e in entries)
        return "dtype_mismatch", detail, ()
    if slot.p2p:
        if len({e.payload for e in entries}) > 1:
            detail = "send and recv sizes differ: " + ", ".join(f"rank {e.rank} {e.payload}" for e in entries)
            return "size_mismatch", detail, ()
        return None
    problem, blame = _size_problem(entries[0].func, entries, group_size)
    return ("size_mismatch", problem, blame) if problem else None


def _judge(slot: Joined, group_size: int, incomplete: set[int], last_pos: dict[int, int], pos: int) -> None:
    entries = list(slot.entries.values())
    # Stuck: never seen complete by a rank whose window then ended early (hang, crash, signal). A window that
    # closed normally went past it; its completion was only not observed (a functional collective whose
    # result the window never read), which is no hang.
    stuck = [e.rank for e in entries if e.state != "completed" and e.rank in incomplete]
    missing = slot.missing
    never_reached = [r for r in missing if r in incomplete and last_pos.get(r, -1) < pos]
    # When every member issued it, a disagreement is the cause and a failure to complete its consequence
    # (gloo fails both sides of an all_reduce met by a broadcast).
    mismatch = None if missing or slot.order else _mismatch(slot, entries, group_size)
    if mismatch is not None:
        slot.verdict, slot.detail, slot.blame = mismatch
        if stuck:
            slot.detail += f"; never completed on rank(s) {stuck}"
    elif stuck or (missing and len(never_reached) == len(missing)):
        slot.verdict = "not_completed"
        parts = []
        if stuck:
            parts.append(f"issued but never completed on rank(s) {stuck}")
        if never_reached:
            parts.append(f"never reached by rank(s) {never_reached} (incomplete shard)")
        skipped = [r for r in missing if r not in never_reached]
        if skipped:
            parts.append(f"not issued by rank(s) {skipped}")
        slot.detail = "; ".join(parts)
    elif slot.order:
        seqs = {e.rank: e.seq for e in entries}
        slot.verdict = "order"
        slot.detail = f"issued at different positions (sequence numbers {seqs})"
    elif missing:
        slot.verdict = "missing"
        slot.detail = f"not issued by rank(s) {list(missing)}"


def _culprits(slot: Joined) -> tuple[int, ...]:
    """The ranks to blame: those lacking it or stuck, else the minority of a split vote."""
    if slot.verdict == "not_completed":
        # Ranks that never got there kept the others waiting; with none such, the ones stuck in it.
        if slot.missing:
            return slot.missing
        return tuple(sorted(r for r, e in slot.entries.items() if e.state != "completed"))
    if slot.verdict == "missing":
        return slot.missing
    if slot.blame:
        return slot.blame
    attr = {
        "type_mismatch": lambda e: e.func,
        "dtype_mismatch": lambda e: e.dtype,
        "size_mismatch": lambda e: (e.in_numel, e.out_numel),
        "order": lambda e: e.seq,
    }.get(slot.verdict)
    if attr is None:
        return ()
    return _minority({r: attr(e) for r, e in slot.entries.items()})


# -- per step -----------------------------------------------------------------------------------------------
def match_step(
    step: int,
    entries: dict[int, list[Entry]],
    *,
    incomplete: set[int],
    absent: set[int],
    last_op: dict[int, dict[str, Any]],
    ended: dict[int, dict[str, Any]] | None = None,
) -> tuple[list[Joined], list[Finding]]:
    """Join one step's collectives across ranks and judge them.

    Args:
        step: the step these shards captured.
        entries: per rank with a shard, its collectives (:class:`Entry`, as ``sources.read_rank`` reads them).
        incomplete: ranks whose shard is marked incomplete (written at a crash, hang or signal).
        absent: ranks of the world without a readable shard for this step.
        last_op: per rank, where its last recorded op was (reported for ranks that never reached a collective).
        ended: per rank with an incomplete shard, how it ended (``end_reason``, ``error``) and where its thread
            was (``stack_at``, ``stack``): added to the findings it takes part in.

    Returns:
        The joined collectives (in group, then issue order) and the findings about them.
    """
    # Two groups can have the same members (a second group over all ranks): the name tells them apart.
    groups: dict[tuple[str, tuple[int, ...]], dict[int, list[Entry]]] = {}
    p2p: dict[tuple, dict[str, list[Entry]]] = {}
    for rank, lst in entries.items():
        name = group = bucket = None
        for e in lst:
            kind = P2P_ROLES.get(e.func)
            if kind is not None:
                src, dst = (rank, e.peer) if kind == "send" else (e.peer, rank)
                p2p.setdefault((e.group_name, e.group, src, dst), {"send": [], "recv": []})[kind].append(e)
                continue
            # A rank's collectives mostly run in one group, whose name and member tuple are shared objects:
            # compare by identity before building the key.
            if e.group is not group or e.group_name is not name:
                name, group = e.group_name, e.group
                bucket = groups.setdefault((name, group), {}).setdefault(rank, [])
            bucket.append(e)

    joined: list[Joined] = []
    findings: list[Finding] = []
    members = [group for _, group in groups]
    twins = frozenset(g for g in members if members.count(g) > 1)
    for name, group in sorted(groups, key=lambda k: (k[1], k[0])):
        per_rank = groups[(name, group)]
        for lst in per_rank.values():
            lst.sort(key=lambda e: (e.seq if e.seq >= 0 else float("inf"), e.op))
        present = [r for r in group if r in entries]
        if not present:
            continue
        slots = _merge_swaps(_align(per_rank, present), set(present))
        last_pos: dict[int, int] = {}
        group_joined = []
        for pos, (slot_entries, order, swapped) in enumerate(slots):
            for r in slot_entries:
                last_pos[r] = pos
            group_joined.append(
                Joined(
                    step,
                    group,
                    name,
                    slot_entries,
                    tuple(present),
                    tuple(r for r in group if r in absent),
                    order=order,
                    swapped=swapped,
                )
            )
        for pos, slot in enumerate(group_joined):
            _judge(slot, len(group), incomplete, last_pos, pos)
        joined.extend(group_joined)
        group_findings = _findings(group_joined, last_op, ended or {}, twins)
        shifted = _shifted(group_joined, primary=not group_findings)
        findings.extend(
            group_findings if shifted is None else sorted([*group_findings, shifted], key=_by_seq)
        )

    for (name, group, src, dst), sides in sorted(p2p.items(), key=lambda kv: kv[0][1:] + (kv[0][0],)):
        if src in absent or dst in absent or src not in entries or dst not in entries:
            continue
        sends, recvs = sides["send"], sides["recv"]
        pairs = []
        for n in range(max(len(sends), len(recvs))):
            slot_entries = {}
            if n < len(sends):
                slot_entries[src] = sends[n]
            if n < len(recvs):
                slot_entries[dst] = recvs[n]
            pairs.append(Joined(step, group, name, slot_entries, (src, dst), (), p2p=True))
        last_pos = {src: len(sends) - 1, dst: len(recvs) - 1}
        for pos, slot in enumerate(pairs):
            _judge(slot, 2, incomplete, last_pos, pos)
        joined.extend(pairs)
        findings.extend(_findings(pairs, last_op, ended or {}))
    return joined, findings


def _by_seq(f: Finding) -> int:
    return f.seq


def _shifted(slots: list[Joined], *, primary: bool) -> Finding | None:
    """One finding for a group's collectives that paired calls with different sequence numbers: a collective
    skipped (or added) earlier on some rank shifted every later one, and gloo pairs by count, so each of them
    exchanged data between different calls (and their timings compare different calls). Marks those slots
    ``shifted``. None when every joined collective's members agree on its number."""
    shifted = []
    for slot in slots:
        numbers = {e.seq for e in slot.entries.values() if e.seq >= 0}
        if slot.verdict == "matched" and not slot.swapped and len(numbers) > 1:
            slot.verdict = "shifted"
            slot.detail = "paired calls with different sequence numbers"
            shifted.append(slot)
    if not shifted:
        return None
    first = shifted[0]
    seqs = {r: e.seq for r, e in sorted(first.entries.items())}
    behind = tuple(r for r, s in seqs.items() if s < max(seqs.values()))  # issued fewer: skipped one
    at = next(iter(first.entries.values()))
    message = (
        f"{len(shifted)} collective(s) of group {list(first.group)}, from {at.label} ({at.source or 'no source'}) "
        f"on, paired calls with different sequence numbers ({', '.join(f'{s} on rank {r}' for r, s in seqs.items())}): "
        f"rank(s) {list(behind)} issued fewer collectives before them (a skipped one: see the earlier finding in "
        "this group), so each exchanged data with another call, and their timing says nothing"
    )
    where = {r: e.where() for r, e in sorted(first.entries.items())}
    return Finding("shifted", first.step, first.group, first.seq, behind, message, where, primary=primary)


def mark_consequences(findings: list[Finding]) -> None:
    """A finding in a group after a primary finding of an earlier step in that group is its consequence
    (``primary=False``): one skipped collective shifts every later one of the group, step after step."""
    first_cause: dict[tuple[int, ...], int] = {}
    for f in sorted(findings, key=lambda f: f.step):
        if not f.group:
            continue
        cause = first_cause.get(f.group)
        if cause is not None and cause < f.step:
            f.primary = False
        elif f.primary and cause is None:
            first_cause[f.group] = f.step


def ending(info: dict[str, Any]) -> str:
    """``SIGTERM`` / ``exception (RuntimeError: Timed out ...)``: how an incomplete shard's window ended."""
    error = (info.get("error") or "").strip().splitlines()
    text = info.get("end_reason") or "unknown"
    if error:
        first = error[0] if len(error[0]) <= 120 else error[0][:117] + "..."
        text += f" ({first})"
    return text


def _findings(
    slots: list[Joined],
    last_op: dict[int, dict[str, Any]],
    ended: dict[int, dict[str, Any]],
    twins: frozenset[tuple[int, ...]] = frozenset(),
) -> list[Finding]:
    """Findings of one group's joined collectives; ``twins``: member tuples that several process groups of the
    step share (a subgroup over every rank beside the default one), whose messages name the group too."""
    out: list[Finding] = []
    for slot in slots:
        if slot.verdict in ("matched", "shifted"):
            continue
        where = {r: e.where() for r, e in sorted(slot.entries.items())}
        for r in slot.missing:
            where[r] = {"absent": True, **{f"last_{k}": v for k, v in last_op.get(r, {}).items()}}
        first = next(iter(slot.entries.values()))
        at = f"{first.label} in {first.module_name} ({first.source or 'no source'})"
        kind = "p2p " if slot.p2p else ""
        seqs = {r: e.seq for r, e in sorted(slot.entries.items())}
        # Aligned across a skipped collective: each rank's own number (an order finding's detail has them).
        if len(set(seqs.values())) > 1 and slot.verdict != "order":
            seq = ", ".join(f"{s} on rank {r}" for r, s in seqs.items())
        else:
            seq = str(slot.seq)
        group = f"{list(slot.group)}" + (
            f" (process group {slot.group_name!r})" if slot.group in twins else ""
        )
        message = f"{kind}{slot.func} seq {seq} of group {group} at {at}: {slot.detail}"
        for r in slot.missing:
            stack_at = ended.get(r, {}).get("stack_at")
            if stack_at:
                message += f"; rank {r} never reached {first.label}: it was at {stack_at}"
        notes = []
        for r in sorted(where):
            info = ended.get(r)
            if info:
                where[r].update(info)
                notes.append(f"rank {r} {ending(info)}")
        if notes:
            message += "; incomplete shards: " + ", ".join(notes)
        out.append(
            Finding(
                slot.verdict,
                slot.step,
                slot.group,
                slot.seq,
                _culprits(slot),
                message,
                where,
                # A hang after an earlier desync in the same group is that desync's consequence.
                primary=not (slot.verdict == "not_completed" and out),
            )
        )
    return out
