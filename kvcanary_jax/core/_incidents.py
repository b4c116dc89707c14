"""Incidents: violation rows grouped by the fault behind them, so a person reads one headline per fault.

One fault writes many rows: HEAD and TAIL, K and V, FULL and SWA launches all flag the same batch entry, the entry
after a broken chain link fails its own chain check (a knock-on), a request a bad input left unwritten fails verify
at every later step, and a corrupted slot fails again at every step that reads it. The ring keeps every row
(SGLang's format, exact count); an :class:`Incidents` tracker folds them into :class:`Incident` s:

- a row whose slot (in its pool group) an incident already holds joins it (the same fault, seen again);
- else a row of a request row an incident holds joins it, at the root's position (the same batch entry, another
  launch or group) or past it (a knock-on); after an ``INVALID_INPUT`` root every later row of the request is one;
- else a verify row of a slot never written (its record all zero) joins the latest ``INVALID_INPUT`` incident that
  names no request row (a bad span, e.g. ``extend_lens``, leaves every request from it on unwritten), as a knock-on,
  and so does every later row of that request;
- else a ``write_token`` row whose tokens are crossed with a root of the same step (each holds the other's
  expected token) joins that root's incident: one swap, two requests;
- else the row opens a new incident and is its root. Within one step, ``INVALID_INPUT`` rows and lower positions
  come first, so the root is the earliest link that broke.

Rows of different scopes never share an incident: a mesh's data replicas hold their own requests and slots (its TP
shards share theirs, so a fault every shard sees is one incident).

With ``fold_repeats``, a row equal to one an earlier :meth:`Incidents.add` placed, but for its launch tag (the same
slot, position, stored and expected token, stored hash, expected aux and fail reason bits), is a repeat: counted
in its incident (``rows``, ``repeats``) and in ``Incidents.repeats``, but not returned to be shown again, so a
request whose corrupted slots are re-verified at every step does not flood the log. The ``_MAX_REMEMBERED`` distinct
rows seen most recently are remembered; a row forgotten, seen again, shows once more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from kvcanary_jax.core import _explain
from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason

_MAX_LISTED = 4  # knock-on slots named in a headline; the rest are counted
_MAX_REMEMBERED = 4096  # distinct rows kept to fold repeats: bounded memory on a server that runs for days
_WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH
_INPUT = FailReason.INVALID_INPUT


def _group(tag) -> str:
    return tag.name.rsplit("_", 1)[1] if isinstance(tag, CanaryLaunchTag) else "?"


def _slot_key(v) -> tuple[str, int]:
    return _group(v.launch_tag), v.slot_idx


def _input_key(v) -> tuple[int, ...]:
    return v.reason_detail, v.stored_chain_hash, v.stored_token, v.expected_aux, v.position, v.slot_idx


def _repeat_key(v) -> tuple[int, ...]:
    """A row's SGLang fields but its launch tag (``fail_reason_bits`` whole: its detail word too)."""
    return (v.slot_idx, v.position, v.stored_token, v.expected_token, v.stored_chain_hash, v.expected_aux,
            int(v.fail_reason), v.reason_detail)  # fmt: skip


def _position(v) -> int:
    """The request position the row checked: the expected one when the ring knows it (a remapped slot's record
    holds another position)."""
    return v.expected_position if v.expected_position is not None else v.position


def _unwritten(v) -> bool:
    """A verify row of a slot whose record is all zero: the mark of a request a rejected batch value left unwritten."""
    blank = (v.stored_token, v.position, v.stored_chain_hash) == (0, 0, 0)
    return blank and not v.fail_reason & (_INPUT | _WRITE_BITS)


def _order(v) -> tuple[int, int]:
    return (0 if v.fail_reason & _INPUT else 1, _position(v))


@dataclasses.dataclass
class Incident:
    """One fault: its root row and the rows it explains.

    Attributes:
      number: 1-based, in the order incidents were opened.
      root: the row that names the fault (a :class:`~kvcanary_jax.core._report.Violation`).
      step: the step whose launches wrote the root (None if unknown).
      rows: how many rows the incident explains, the root included.
      knock_ons: the first row of each knock-on slot (later positions of the request whose chain the root broke).
      partners: the first row of each other request the same fault hit (tokens crossed with the root's).
      last_step: the latest step that added a row.
      repeats: rows counted in ``rows`` that repeated an earlier step's row (see ``fold_repeats``), not shown.
    """

    number: int
    root: object
    step: int | None
    rows: int = 1
    knock_ons: list = dataclasses.field(default_factory=list)
    partners: list = dataclasses.field(default_factory=list)
    last_step: int | None = None
    repeats: int = 0
    _slots: set = dataclasses.field(default_factory=set, repr=False)

    @property
    def request_row(self) -> int | None:
        return self.root.request_row

    def where(self) -> str:
        """Request, position and slot of the root (an input problem names its batch field instead)."""
        r = self.root
        if r.fail_reason & _INPUT:
            request = f"request row {r.request_row}, " if r.request_row is not None else ""
            return f"{request}{_explain.input_line(r)}"
        if r.request_row is not None:
            request = f"request row {r.request_row}"
        else:
            request = "an idle prefix-cache slot" if _explain.phase_of(r.launch_tag) == "SWEEP" else "request unknown"
        return f"{request}, position {_position(r)}, slot {r.slot_idx} ({_group(r.launch_tag)})"

    def headline(self) -> str:
        """What, where, when, the likely cause and the rows explained; knock-ons named with their slots."""
        r = self.root
        when = f"step {self.step}" if self.step is not None else "an unknown step"
        lines = [
            f"kv-canary incident #{self.number}: {'+'.join(r.reason_labels) or 'none'} ({r.tag_label}) at "
            f"{self.where()}, written at {when}"
        ]
        cause = _explain.likely_cause(r)
        if cause is not None:
            lines.append(f"  likely cause: {cause}")
        detail = ""
        if self.knock_ons:
            listed = list(dict.fromkeys(f"{k.slot_idx}@{_position(k)}" for k in self.knock_ons))
            more = f" and {len(listed) - _MAX_LISTED} more" if len(listed) > _MAX_LISTED else ""
            slots = ", ".join(listed[:_MAX_LISTED])
            detail = f"; knock-ons of this root at slot@position {slots}{more}"
        for p in self.partners:
            detail += f"; tokens crossed with request row {p.request_row}, position {_position(p)}, slot {p.slot_idx}"
        lines.append(f"  explains {self.rows} row(s){detail}")
        return "\n".join(lines)

    def label(self, v) -> str:
        """How a raw row points at its incident: the root itself, or a knock-on of it."""
        if v is self.root:
            return f"  incident: #{self.number} (root)"
        if v.request_row != self.root.request_row and not self.root.fail_reason & _INPUT:
            kind = "crossed partner"
        else:
            kind = "knock-on" if _position(v) != _position(self.root) else "same fault"
        return f"  incident: {kind} of #{self.number} (root: {self.where()})"


class Incidents:
    """Folds rows into incidents as they arrive, one step at a time (see the module docstring).

    Args:
      fold_repeats: count a row that repeats one an earlier :meth:`add` placed without returning it (see the module
        docstring); ``repeats`` counts them.
    """

    def __init__(self, *, fold_repeats: bool = False):
        self.fold_repeats = fold_repeats
        self.repeats = 0
        self._placed_before: dict[tuple, Incident] = {}  # (scope, repeat key), oldest first: bounded
        self.incidents: list[Incident] = []
        self._by_slot: dict[tuple, Incident] = {}  # keys: (scope, (group, slot))
        self._by_request: dict[tuple, Incident] = {}  # keys: (scope, request row)
        self._by_input: dict[tuple, Incident] = {}  # the same bad value, seen again (no slot to key it by)
        self._unlinked_input: dict[object, Incident] = {}  # per scope: the latest bad value naming no request

    def add(self, rows: Iterable, *, step: int | None = None, scope=None) -> list[tuple[object, Incident]]:
        """Adds one step's rows of one scope (hashable; see the module docstring); returns each row with its incident,
        roots and lower positions first (repeats left out, with ``fold_repeats``)."""
        placed, opened, keys = [], [], {}
        for v in sorted(rows, key=_order):
            key = (scope, _repeat_key(v))
            if self.fold_repeats and key in self._placed_before:
                incident = self._placed_before[key] = self._placed_before.pop(key)  # now the newest: kept longest
                incident.rows += 1
                incident.repeats += 1
                incident.last_step = step
                self.repeats += 1
                continue
            incident = self._find(v, scope) or _crossed(v, opened)
            if incident is None:
                incident = Incident(len(self.incidents) + 1, v, step, rows=0)
                self.incidents.append(incident)
                opened.append(incident)
                if v.request_row is not None:
                    self._by_request.setdefault((scope, v.request_row), incident)
                elif v.fail_reason & _INPUT:
                    self._unlinked_input[scope] = incident
            elif v.request_row != incident.root.request_row and not incident.root.fail_reason & _INPUT:
                if v.request_row is not None and all(p.request_row != v.request_row for p in incident.partners):
                    incident.partners.append(v)
                    self._by_request.setdefault((scope, v.request_row), incident)
            elif _position(v) != _position(incident.root) and _slot_key(v) not in incident._slots:
                incident.knock_ons.append(v)
                if v.request_row is not None:  # a request a bad value left unwritten: its later rows join too
                    self._by_request.setdefault((scope, v.request_row), incident)
            incident.rows += 1
            incident.last_step = step
            if v.fail_reason & _INPUT:
                self._by_input.setdefault((scope, _input_key(v)), incident)
            else:
                incident._slots.add(_slot_key(v))
                self._by_slot.setdefault((scope, _slot_key(v)), incident)
            placed.append((v, incident))
            keys.setdefault(key, incident)
        if self.fold_repeats:
            self._remember(keys)
        return placed

    def _remember(self, keys: dict[tuple, Incident]) -> None:
        """Keeps this call's rows to fold their repeats in later calls; forgets the oldest past the bound."""
        for key, incident in keys.items():
            self._placed_before.pop(key, None)  # re-inserted: now the newest
            self._placed_before[key] = incident
        while len(self._placed_before) > _MAX_REMEMBERED:
            del self._placed_before[next(iter(self._placed_before))]

    def _find(self, v, scope) -> Incident | None:
        invalid = v.fail_reason & _INPUT
        found = self._by_input.get((scope, _input_key(v))) if invalid else self._by_slot.get((scope, _slot_key(v)))
        if found is not None:
            return found
        incident = self._by_request.get((scope, v.request_row)) if v.request_row is not None else None
        if incident is None:
            return self._unlinked_input.get(scope) if _unwritten(v) else None
        root = incident.root
        if root.fail_reason & _INPUT or _position(v) >= _position(root):
            return incident
        return None


def _crossed(v, opened: list[Incident]) -> Incident | None:
    """The incident opened this step by a ``write_token`` root whose tokens ``v`` holds crossed."""
    if not v.fail_reason & FailReason.WRITE_TOKEN:
        return None
    for incident in opened:
        r = incident.root
        if r.fail_reason & FailReason.WRITE_TOKEN and (r.stored_token, r.expected_token) == (
            v.expected_token,
            v.stored_token,
        ):
            return incident
    return None


def group(violations: Iterable, *, step: int | None = None) -> list[Incident]:
    """The incidents of a batch of rows (a whole ring: steps unknown)."""
    tracker = Incidents()
    tracker.add(violations, step=step)
    return tracker.incidents


def messages(
    placed: list[tuple[object, Incident]],
    *,
    opened: int,
    raw: Callable[[object], str],
    verbose: bool = False,
    note: Callable[[Incident], str] | None = None,
) -> list[str]:
    """One message per incident that ``placed`` (from :meth:`Incidents.add`) touches, in order.

    An incident numbered past ``opened`` is new: its headline, then ``raw`` (SGLang's lines) of its root row. An
    older one gets one line counting its new rows. ``note`` adds a line under either (e.g. the devices that saw it);
    ``verbose`` adds ``raw`` of every row, labelled with its incident.
    """
    out: dict[int, list[str]] = {}
    for v, incident in placed:
        if incident.number not in out:
            new = incident.number > opened
            if new:
                lines = [incident.headline()]
            else:
                added = sum(1 for _, i in placed if i is incident)
                repeats = f", {incident.repeats} repeat(s) not shown" if incident.repeats else ""
                lines = [
                    f"kv-canary incident #{incident.number}: {added} more row(s) at step {incident.last_step} "
                    f"({incident.rows} in all{repeats}): the same fault, already reported"
                ]
            if note is not None:
                lines.append(note(incident))
            if new and not verbose:
                lines.append(raw(incident.root))
            out[incident.number] = lines
        if verbose:
            out[incident.number] += [raw(v), incident.label(v)]
    return ["\n".join(lines) for lines in out.values()]
